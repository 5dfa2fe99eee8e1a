"""The adaLN-Zero norm and the projection after it, with and without LoRA (GPU): what the shrink costs
when it runs inside the norm's pass (`kernels/adaln_shrink`) instead of reading the norm's output again.

    python benchmarks/adaln_lora.py --out DIR [--ranks 16,64] [--slices 3,4] [--rounds 7] [--gap-s 0.3]

Flux shapes: x [4, 4608, 3072] bf16 (4 requests, one adapter each), shift and scale [4, 3072]; the
projection after the norm is QKV (3 × 3072) or a single block's q, k, v and proj_mlp (3 × 3072 + 12288).
Timed in interleaved rounds (lora_kernels.interleaved: CUDA-graph replays, L2 emptied before each call);
ratios are to the first row, "adaln + cuBLAS":
- torch norm + cuBLAS: diffusers' modulation as it runs eagerly (F.layer_norm, · (1 + scale), + shift) and
  F.linear;
- adaln + cuBLAS: our one-pass norm (no LoRA) and F.linear — the base the LoRA rows are measured against;
- adaln + lora_linear: our norm, then the engine's LoRA projection with its own shrink (y read again);
- adaln_shrink + lora_gemm: the norm writes y and s in one pass, `lora_linear(..., s=s)`;
- the norms alone (torch, adaln, adaln with the shrink, each --configs tile) and the shrink alone.
Every LoRA row is checked against the torch reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import make_problem  # noqa: E402
from ditserve.kernels.adaln_shrink.op import SWEEP, adaln, launch_adaln_shrink  # noqa: E402
from ditserve.kernels.adaln_shrink.reference import adaln_ref  # noqa: E402
from ditserve.kernels.lora import lora_linear, lora_shrink  # noqa: E402

BATCH, TOKENS, HIDDEN = 4, 4608, 3072
SLICES = {3: [3072] * 3, 4: [3072] * 3 + [12288]}


def torch_norm(x, shift, scale):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def run_shape(nsl: int, rank: int, args, lines: list[str]) -> dict:
    """Check and time one (slices, rank) shape; appends its table to lines, returns its record."""
    p = make_problem([(TOKENS, i) for i in range(BATCH)], rank, SLICES[nsl])
    m = p.meta
    g = torch.Generator(device="cuda").manual_seed(1)
    x3 = (torch.randn(BATCH, TOKENS, HIDDEN, device="cuda", generator=g) * 2 + 0.5).bfloat16()
    shift = (torch.randn(BATCH, HIDDEN, device="cuda", generator=g)).bfloat16()
    scale = (torch.randn(BATCH, HIDDEN, device="cuda", generator=g) * 0.3).bfloat16()
    x2 = x3.view(-1, HIDDEN)
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank, m.seg_scale)

    # correctness first: y against the fp32 reference, s against the shrink of that y
    y, s = adaln(x3, shift, scale, 1e-6, p.a, m)
    want_y = adaln_ref(x2.float(), shift.float(), scale.float(), 1e-6)
    y_err = (y.view(-1, HIDDEN).float() - want_y).abs().max().item()
    s_err = (s.float() - lora_shrink(y.view(-1, HIDDEN), p.a, m, scaled=True).float()).abs().max().item()
    y2 = y.view(-1, HIDDEN)
    out_err = (lora_linear(y2, p.w, None, p.a, p.b, m, p.sizes, s=s).float()
               - lora_linear(y2, p.w, None, p.a, p.b, m, p.sizes).float()).abs().max().item()  # fmt: skip
    check = f"max |y - ref| {y_err:.3g}, |s - shrink(y)| {s_err:.3g}, |out - engine path| {out_err:.3g}"

    def fused_block(x3=x3, shift=shift, scale=scale, p=p, m=m):
        y, s = adaln(x3, shift, scale, 1e-6, p.a, m)
        return lora_linear(y.view(-1, HIDDEN), p.w, None, p.a, p.b, m, p.sizes, s=s)

    fns = {
        "adaln + cuBLAS": lambda: F.linear(adaln(x3, shift, scale, 1e-6).view(-1, HIDDEN), p.w),
        "torch norm + cuBLAS": lambda: F.linear(torch_norm(x3, shift, scale).view(-1, HIDDEN), p.w),
        "adaln + lora_linear": lambda: lora_linear(
            adaln(x3, shift, scale, 1e-6).view(-1, HIDDEN), p.w, None, p.a, p.b, m, p.sizes
        ),
        "adaln_shrink + lora_gemm": fused_block,
        "torch norm": lambda: torch_norm(x3, shift, scale),
        "adaln": lambda: adaln(x3, shift, scale, 1e-6),
        "adaln_shrink": lambda: adaln(x3, shift, scale, 1e-6, p.a, m),
        "shrink": lambda: lora_shrink(x2, p.a, m, scaled=True),
    }
    for name in filter(None, args.configs.split(",")):
        cfg = SWEEP[name]
        fns[f"adaln {name}"] = lambda cfg=cfg: launch_adaln_shrink(x2, shift, scale, 1e-6, config=cfg)
        fns[f"adaln_shrink {name}"] = lambda cfg=cfg: launch_adaln_shrink(
            x2, shift, scale, 1e-6, p.a, *seg, config=cfg
        )
    res = lk.interleaved(fns, args.rounds, args.gap_s)
    base = res["adaln + cuBLAS"][0]
    lines += ["", f"### {nsl} slices ({sum(SLICES[nsl])} columns), rank {rank} — {check}", "",
              "| row | µs (median) | vs adaln + cuBLAS (median of per-round ratios) |", "|---|---|---|"]  # fmt: skip
    for name, (ms, ratio) in res.items():
        lines.append(f"| {name} | {ms * 1e3:.1f} | {100 * (ratio - 1):+.1f}% |")
    lines.append(
        f"\nLoRA on the norm + projection: {100 * (res['adaln_shrink + lora_gemm'][1] - 1):+.1f}% "
        f"(shrink in the norm) / {100 * (res['adaln + lora_linear'][1] - 1):+.1f}% (shrink on its "
        f"own) over adaln + cuBLAS ({base * 1e3:.0f} µs); the LoRA norm costs "
        f"{(res['adaln_shrink'][0] - res['adaln'][0]) * 1e3:+.1f} µs over the plain one"
    )
    print("\n".join(lines[-len(res) - 6 :]), flush=True)
    return dict(slices=nsl, rank=rank, check=check, res=res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--slices", default="3,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.3)
    ap.add_argument("--configs", default=",".join(SWEEP), help="adaln_shrink SWEEP names timed alone")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    head = [
        f"machine: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {lk.commit()}, {time.strftime('%Y-%m-%d')}, flush {lk.FLUSH_MODE}",
        f"bf16, x [{BATCH}, {TOKENS}, {HIDDEN}], one adapter per request, scale 0.5",
    ]
    print("\n".join(head), flush=True)
    lines = list(head)
    records = []
    t0 = time.time()
    for nsl in map(int, args.slices.split(",")):
        for rank in map(int, args.ranks.split(",")):
            records.append(run_shape(nsl, rank, args, lines))
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, "adaln_lora.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
    lines.append(f"\nwall time {time.time() - t0:.0f} s")
    with open(os.path.join(args.out, "adaln_lora.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "adaln_lora.json"), "w") as f:
        json.dump(dict(head=head, records=records), f, indent=1)


if __name__ == "__main__":
    main()
