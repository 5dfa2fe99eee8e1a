"""Step caching on demo-scenes' held-out prompts: forwards cached, prompts drawn right, PSNR vs uncached.

The held-out prompts (the 16 of tests/e2e/test_scenes_engine.py, seeds 1000 + i, the model's recommended
sampling) run through the engine once uncached (the baseline of the same run) and once per cache setting;
for each setting: the share of transformer forwards its cache answered (the requests' ``usage``), how many
prompts the repo's scorer reads right, and the PSNR of each image against its uncached one.

    python benchmarks/engine/cache_scenes.py                       # the settings below
    python benchmarks/engine/cache_scenes.py --setting fbcache:0.3 --setting taylorseer:3
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import write_results  # noqa: E402

from ditserve.replica.caching import CacheSettings  # noqa: E402
from ditserve.replica.config import EngineConfig  # noqa: E402
from ditserve.replica.engine import Engine  # noqa: E402
from ditserve.replica.models.registry import resolve_model  # noqa: E402
from ditserve.replica.models.scenes import held_out_scenes  # noqa: E402
from ditserve.replica.models.scorer import score_scene  # noqa: E402
from ditserve.replica.request import GenerationParams  # noqa: E402

SEED = 1000
SETTINGS = ["fbcache:0.1", "fbcache:0.2", "fbcache:0.3", "fbcache:0.45", "taylorseer:2", "taylorseer:3"]


def parse(setting: str) -> CacheSettings:
    policy, _, value = setting.partition(":")
    if policy == "none":
        return CacheSettings(policy="none")
    if policy == "fbcache":
        return CacheSettings(policy="fbcache", threshold=float(value or 0.1))
    if policy == "taylorseer":
        return CacheSettings(policy="taylorseer", interval=int(value or 3))
    raise SystemExit(f"--setting {setting!r}: expected none, fbcache:THRESHOLD or taylorseer:INTERVAL")


def requests(cache: CacheSettings, count: int) -> list[tuple]:
    spec = resolve_model("demo-scenes")
    negative, true_cfg = spec.guidance_defaults(None, None)
    steps = spec.sampling.get("num_inference_steps", 20)
    return [
        (
            s,
            GenerationParams(
                prompt=s.caption,
                negative_prompt=negative,
                true_cfg_scale=true_cfg,
                width=64,
                height=64,
                num_inference_steps=steps,
                seed=SEED + i,
                cache=cache,
            ),
        )
        for i, s in enumerate(held_out_scenes()[:count])
    ]


def run(engine: Engine, cache: CacheSettings, count: int) -> dict:
    from PIL import Image

    reqs = requests(cache, count)
    results = [f.result(timeout=1200) for f in [engine.submit(p) for _, p in reqs]]
    images = [np.array(Image.open(io.BytesIO(r.outputs[0])).convert("RGB")) for r in results]
    right = sum(
        score_scene(Image.fromarray(img)) == (s.background, s.colour)
        for (s, _), img in zip(reqs, images, strict=True)
    )
    forwards = sum(r.usage["transformer_forwards"] for r in results)
    cached = sum(r.usage["cached_forwards"] for r in results)
    return {"images": images, "right": int(right), "forwards": forwards, "cached": cached}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setting", action="append", help="none | fbcache:THRESHOLD | taylorseer:INTERVAL")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model="demo-scenes", cache_policy="none")).start()
    try:
        base = run(engine, CacheSettings(policy="none"), args.prompts)
        rows, records = [], []
        for setting in args.setting or SETTINGS:
            got = run(engine, parse(setting), args.prompts)
            psnrs = [_psnr(a, b) for a, b in zip(got["images"], base["images"], strict=True)]
            record = {
                "setting": setting,
                "cached_share": got["cached"] / got["forwards"],
                "right": got["right"],
                "uncached_right": base["right"],
                "psnr_min": min(psnrs),
                "psnr_median": float(np.median(psnrs)),
            }
            records.append(record)
            rows.append(
                f"| {setting} | {record['cached_share']:.0%} | {got['right']}/{args.prompts} | "
                f"{record['psnr_median']:.1f} | {record['psnr_min']:.1f} |"
            )
            print(rows[-1], flush=True)
    finally:
        engine.shutdown()
    markdown = "\n".join(
        [
            f"Uncached (baseline, same run): {base['right']}/{args.prompts} prompts right.",
            "",
            "| setting | forwards cached | prompts right | PSNR vs uncached, median (dB) | min (dB) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    write_results("cache_scenes", markdown, records, out=args.out, baseline="the same prompts uncached")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


if __name__ == "__main__":
    main()
