"""The adaLN-Zero norm of a Flux block (GPU): diffusers' eager ops, the same ops under torch.compile, and the
one-pass kernel (`kernels/adaln`, what ``--fused-epilogues`` runs eagerly), against the HBM floor.

    python benchmarks/kernels/adaln.py --out DIR [--rounds 7] [--gap-s 0.25]

y = LayerNorm(x) · (1 + scale[:, None]) + shift[:, None], x [batch, tokens, 3072] bf16, shift and scale
[batch, 3072]; shapes: 4 × 4608 (4 requests of 1024², image + text: a single block's norm), 4 × 512 (the
text stream's norm1_context). Timed in interleaved rounds (lora_kernels.interleaved: CUDA-graph replays,
L2 emptied before each call); ratios to the first row. The floor: x read once and y written once at the
copy bandwidth measured in the same run. Every row is checked against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth  # noqa: E402
from ditserve.kernels.adaln.op import SWEEP, launch_adaln  # noqa: E402
from ditserve.kernels.adaln.reference import adaln_ref  # noqa: E402

HIDDEN = 3072
SHAPES = {"4 × 4608": (4, 4608), "4 × 512": (4, 512)}


def stock(x, shift, scale):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def run_shape(name: str, batch: int, tokens: int, args, bw: float, lines: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(batch, tokens, HIDDEN, device="cuda", generator=g) * 2 + 0.5).bfloat16()
    shift = torch.randn(batch, HIDDEN, device="cuda", generator=g).bfloat16()
    scale = (torch.randn(batch, HIDDEN, device="cuda", generator=g) * 0.3).bfloat16()
    x2 = x.view(-1, HIDDEN)
    compiled = torch.compile(stock, fullgraph=True)
    fns = {
        "torch eager (diffusers)": lambda: stock(x, shift, scale),
        "torch.compile": lambda: compiled(x, shift, scale),
    }
    for k, cfg in SWEEP.items():
        fns[f"adaln {k}"] = lambda cfg=cfg: launch_adaln(x2, shift, scale, 1e-6, config=cfg)
    want = adaln_ref(x2.float(), shift.float(), scale.float(), 1e-6)
    errors = {k: (fn().reshape(-1, HIDDEN).float() - want).abs().max().item() for k, fn in fns.items()}
    res = lk.interleaved(fns, args.rounds, args.gap_s)
    floor_ms = 2 * x.numel() * x.element_size() / bw * 1e3
    lines += [
        "",
        f"### x [{batch}, {tokens}, {HIDDEN}] ({name}); floor {floor_ms * 1e3:.1f} µs",
        "",
        "| row | µs (median) | vs torch eager | % of floor | max abs error vs fp32 |",
        "|---|---|---|---|---|",
    ]
    for k, (ms, ratio) in res.items():
        lines.append(
            f"| {k} | {ms * 1e3:.1f} | {ratio:.3f}× | {100 * floor_ms / ms:.0f}% | {errors[k]:.3g} |"
        )
    print("\n".join(lines[-len(res) - 4 :]), flush=True)
    return dict(shape=name, res=res, errors=errors, floor_ms=floor_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.25)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    head = [
        f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {lk.commit()}, {time.strftime('%Y-%m-%d')}, flush {lk.FLUSH_MODE}",
        f"copy bandwidth (torch clone, read + write): {bw / 1e9:.0f} GB/s",
    ]
    print("\n".join(head), flush=True)
    lines = list(head)
    records = [run_shape(name, b, t, args, bw, lines) for name, (b, t) in SHAPES.items()]
    lk.save(args.out, lines, "adaln", dict(head=head, records=records))


if __name__ == "__main__":
    main()
