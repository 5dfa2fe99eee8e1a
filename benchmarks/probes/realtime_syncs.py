"""Where a realtime chunk makes the host wait on the GPU: AnyFlow-FAR-size (random bf16), 480p, the engine a
replica runs (in process, ``--compile``), one session.

After a warm-up session (compiling), a second session runs with CUDA's sync debug mode on
(``torch.cuda.set_sync_debug_mode("warn")``): every operation that blocks the host on the device (a
device-to-host read, a blocking host-to-device copy, a stream synchronisation) warns, from whichever engine
thread ran it. The probe prints the sites, counted per steady chunk, by their innermost frames in ditserve
and diffusers, and each chunk's interval (the time between the frames of consecutive chunks).

    python benchmarks/probes/realtime_syncs.py [--chunks 5] [--tiny for a CPU smoke run]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "a red fox running through the snow"


def site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames of ``stack`` in ditserve or diffusers (three at most), innermost last."""
    keep = [
        f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in stack
        if ("ditserve" in f.filename or "/replica/" in f.filename or "diffusers" in f.filename)
        and "realtime_syncs" not in f.filename
    ]
    return " <- ".join(reversed(keep[-3:])) or "(outside ditserve and diffusers)"


def main() -> None:
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine
    from ditserve.replica.request import GenerationParams
    from tests.families import anyflow

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    settings = dict(anyflow.REAL_SETTINGS)
    width, height = (64, 64) if args.tiny else tuple(int(v) for v in settings["size"].split("x"))
    frames = 8 if args.tiny else settings["num_frames"]
    steps = settings["num_inference_steps"]
    folder = Path(tempfile.mkdtemp()) / "anyflow-far"
    pipe = anyflow.build_pipeline(size="tiny" if args.tiny else "real", dtype=torch.float32 if args.tiny else torch.bfloat16, device="cpu")  # fmt: skip
    pipe.save_pretrained(folder)
    del pipe
    config = EngineConfig(
        model=str(folder), device=device, dtype="float32" if args.tiny else "bfloat16", compile=not args.tiny,
        max_batch_size=8, cuda_graphs=False,
    )  # fmt: skip
    engine = Engine(config).start()

    current = {"chunk": -1}  # the chunk last submitted (the sites are counted under it)
    sites: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    recording = threading.Event()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not recording.is_set():
            return
        where = site(traceback.extract_stack()[:-1])
        with lock:
            sites[current["chunk"]][f"{str(message)[:60]} @ {where}"] += 1

    def stream(sid: str, intervals: list[float]) -> None:
        def submit(k: int):
            params = GenerationParams(
                prompt=PROMPT, width=width, height=height, num_frames=frames, num_inference_steps=steps,
                seed=0, guidance_scale=1.0,
            )  # fmt: skip
            current["chunk"] = k
            return engine.submit_chunk(sid, k, params, args.chunks)

        last = time.perf_counter()
        chunk = submit(0)
        for k in range(args.chunks):
            chunk.denoised.result(timeout=600)
            after = submit(k + 1) if k + 1 < args.chunks else None
            chunk.frames.result(timeout=600)
            now = time.perf_counter()
            intervals.append(now - last)
            last = now
            if after is not None:
                chunk = after
        engine.close_session(sid).result(timeout=120)

    try:
        stream("warm", [])
        warnings.showwarning = show
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        recording.set()
        intervals: list[float] = []
        stream("probe", intervals)
        recording.clear()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        print("chunk intervals (s):", [round(x, 3) for x in intervals], flush=True)
        for k in sorted(sites):
            total = sum(sites[k].values())
            print(f"\n== while chunk {k} was the latest submitted: {total} blocking calls", flush=True)
            for text, n in sites[k].most_common(25):
                print(f"{n:5d}  {text}", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
