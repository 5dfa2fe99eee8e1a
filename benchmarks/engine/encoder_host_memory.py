"""Host memory of loading a sharded text encoder: each encoder rank's anonymous memory (``RssAnon``: what
the process itself holds, not the page cache its memory-mapped files share) while the engine's
``load_pipeline`` loads and cuts the encoder, at ``--encoder-tp-size`` 1 and 2, for a checkpoint stored in
the served dtype and one stored wider.

    python benchmarks/engine/encoder_host_memory.py                       # a T5 of ~0.7 GB in bf16
    python benchmarks/engine/encoder_host_memory.py --layers 4 --out /tmp/r   # smaller, quicker

The folder is the tiny SD3 pipeline with its T5 widened (T5-large's width, ``--layers`` blocks); its two
CLIPs stay tiny and whole. Each rank samples its own ``/proc/self/status`` every 2 ms from a thread while
loading (a peak between two samples can be missed; allocations of this size take longer than that).
Served dtype: bf16. Linux only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GB = 1e9


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """The peak of RssAnon above its value at entry, sampled from a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.stop = threading.Event()

    def __enter__(self) -> AnonPeak:
        self.base = self.peak = rss_anon()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_anon())
        self.end = rss_anon()


def build_folder(path: Path, layers: int, stored: torch.dtype) -> Path:
    from transformers import T5Config, T5EncoderModel

    from tests.families.sd3 import build_pipeline

    pipe = build_pipeline("tiny")
    old = pipe.text_encoder_3.config
    config = T5Config(
        vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=layers, num_heads=16,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        pad_token_id=old.pad_token_id, eos_token_id=old.eos_token_id,
        decoder_start_token_id=old.decoder_start_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    encoder = T5EncoderModel(config).eval()
    # wider than the tiny transformer's joint attention: this folder is loaded, never run
    pipe.register_modules(text_encoder_3=encoder.to(stored))
    pipe.save_pretrained(path)
    return path


def _load(rank: int, world_size: int, folder: str, degree: int) -> dict:
    from ditserve.replica.models.registry import resolve_model
    from ditserve.replica.worker import load_pipeline

    spec = resolve_model(folder)
    group = torch.distributed.new_group(list(range(degree))) if degree > 1 else None
    with AnonPeak() as mem:
        pipe = load_pipeline(spec, torch.bfloat16, torch.device("cpu"), encoder_group=group)
    encoder = pipe.text_encoder_3
    return {
        "rank": rank,
        "peak_gb": (mem.peak - mem.base) / GB,
        "end_gb": (mem.end - mem.base) / GB,
        "held_gb": sum(p.numel() * p.element_size() for p in encoder.parameters()) / GB,
    }


def main() -> None:
    from report import markdown_table, write_results

    from ditserve.replica.parallel.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="T5 blocks (24: T5-large's depth, ~0.7 GB bf16)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stored in (torch.bfloat16, torch.float32):
            folder = build_folder(Path(tmp) / str(stored).split(".")[1], args.layers, stored)
            for degree in (1, 2):
                results = run_distributed(_load, degree, str(folder), degree, timeout_s=600)
                for r in results:
                    rows.append(
                        {
                            "stored": str(stored).split(".")[1],
                            "--encoder-tp-size": degree,
                            "rank": r["rank"],
                            "T5 held (GB)": f"{r['held_gb']:.3f}",
                            "peak RssAnon while loading (GB)": f"{r['peak_gb']:.3f}",
                            "RssAnon after (GB)": f"{r['end_gb']:.3f}",
                        }
                    )
                    print(rows[-1], flush=True)
    note = (
        "Served in bf16 on the CPU device (the weights stay in host memory, as they would be before "
        "`pipe.to(cuda)`). The whole pipeline is loaded; its VAE, transformer and CLIPs are tiny."
    )
    write_results("encoder_host_memory", markdown_table(rows) + "\n\n" + note + "\n", rows, out=args.out)


if __name__ == "__main__":
    main()
