"""Where the fused QKV projection's LoRA overhead goes (GPU): `lora_gemm` and its shrink timed in parts,
in interleaved rounds against cuBLAS, under both ways of emptying the L2 before a call.

    python benchmarks/lora_gemm_parts.py --out DIR [--ranks 16,64] [--rounds 7] [--gap-s 0.3]
    python benchmarks/lora_gemm_parts.py --ncu     # one launch of each lora_gemm variant, for ncu

Rows, on 4 requests × 4608 tokens, hidden 3072, QKV 3×3072, 4 adapters (one per request):
- cuBLAS `F.linear`; `lora_linear` as the engine calls it (scaled shrink + `lora_gemm`); the shrink alone;
- `lora_gemm` on a given s: with the adapters; with every request's slot -1 (the LoRA iteration runs, its
  TMA loads point past the last row and move no bytes); without LoRA (the kernel compiled without it);
- cuBLAS and `lora_gemm` without LoRA on hidden 3136 (49 K steps of 64 instead of 48: what one more K
  iteration of the base GEMM costs, the nominal price of the LoRA iteration).
Flush modes (lora_kernels.FLUSH_MODE): "write" memsets 256 MB (dirty lines left in L2), "read" sums it.
Also: read-only and copy bandwidth of 2 GiB (torch sum / clone).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

import ditserve.kernels.lora_shrink.op as shrink_op  # noqa: E402
from ditserve.kernels.lora import lora_linear  # noqa: E402
from ditserve.kernels.lora_gemm.op import launch_lora_gemm  # noqa: E402
from ditserve.kernels.lora_gemm.reference import lora_gemm_ref  # noqa: E402
from ditserve.kernels.lora_meta import LoRABatchMeta  # noqa: E402
from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref  # noqa: E402

BATCH = [(4608, i) for i in range(4)]
SIZES = [3072] * 3


def _gemm(p, s):
    m = p.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    return lambda: launch_lora_gemm(
        p.x, p.w, None, s, p.b, *seg, p.sizes, s_scaled=True, seg_align=m.seg_align
    )


def with_shrink(name: str, fn):
    """fn() with the segmented shrink's default set to SCALED_SWEEP[name] for the call (the launch
    reads SEGMENTED_TUNED when it runs, also while a CUDA graph is captured)."""

    def call():
        saved = dict(shrink_op.SEGMENTED_TUNED)
        cfg = shrink_op.SCALED_SWEEP[name]
        shrink_op.SEGMENTED_TUNED.update({(n, r): (cfg,) for n in (1, 2, 3, 4) for r in (16, 32, 64, 128)})
        try:
            return fn()
        finally:
            shrink_op.SEGMENTED_TUNED.clear()
            shrink_op.SEGMENTED_TUNED.update(saved)

    return call


def variants(
    rank: int, check: bool = True, shrinks: tuple[str, ...] = ()
) -> tuple[dict[str, object], list[str]]:
    """The timed callables of one rank, each output checked first (check); returns (fns, failures)."""
    p = lk.make_problem(BATCH, rank, SIZES)
    m = p.meta
    s = lora_shrink_scaled_ref(p.x, p.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale,
                               m.slot_rank, m.max_rank)  # fmt: skip
    no_slot = LoRABatchMeta.build([(n, -1) for n, _ in BATCH], [rank] * 8, [0.5] * len(BATCH), device="cuda")
    p_none = dataclasses.replace(p, meta=no_slot)
    s0 = p.x.new_empty((3, m.num_tokens, 0))
    g = torch.Generator(device="cuda").manual_seed(1)
    x49 = torch.randn(m.num_tokens, 3136, generator=g, device="cuda").to(torch.bfloat16)
    w49 = (torch.randn(sum(SIZES), 3136, generator=g, device="cuda") * 3136**-0.5).to(torch.bfloat16)
    p49 = dataclasses.replace(p, x=x49, w=w49)
    fns = {
        "cuBLAS": lambda: F.linear(p.x, p.w),
        "lora_linear": lambda: lora_linear(p.x, p.w, None, p.a, p.b, m, p.sizes),
        "shrink": lk._shrink_call(p),
        "lora_gemm, adapters": _gemm(p, s),
        "lora_gemm, slots -1": _gemm(p_none, s),
        "lora_gemm, no LoRA": _gemm(p, s0),
        "cuBLAS, hidden 3136": lambda: F.linear(x49, w49),
        "lora_gemm, no LoRA, hidden 3136": _gemm(p49, s0),
    }
    for name in shrinks:
        fns[f"shrink {name}"] = lk._shrink_call(p, shrink_op.SCALED_SWEEP[name])
        fns[f"lora_linear, shrink {name}"] = with_shrink(
            name, lambda: lora_linear(p.x, p.w, None, p.a, p.b, m, p.sizes)
        )
    wants = {
        "lora_gemm, adapters": lora_gemm_ref(
            p.x,
            p.w,
            None,
            s,
            p.b,
            m.seg_start,
            m.seg_len,
            m.seg_slot,
            m.seg_scale,
            m.slot_rank,
            p.sizes,
            s_scaled=True,
        ),  # fmt: skip
        "lora_gemm, no LoRA": F.linear(p.x, p.w),
        "lora_gemm, no LoRA, hidden 3136": F.linear(x49, w49),
    }
    wants["lora_gemm, slots -1"] = wants["lora_gemm, no LoRA"]
    wants["lora_linear"] = wants["lora_gemm, adapters"]
    for name in shrinks:
        wants[f"lora_linear, shrink {name}"] = wants["lora_gemm, adapters"]
    bad = []
    for name, want in wants.items() if check else ():
        got = fns[name]()
        if not torch.allclose(got.float(), want.float(), atol=5e-2, rtol=3e-2):
            bad.append(name)
    return fns, bad


def bandwidths() -> tuple[float, float]:
    """(read-only, copy read+write) bytes/s over 2 GiB."""
    src = torch.ones(1 << 28, dtype=torch.int64, device="cuda")  # 2 GiB
    rd = triton.testing.do_bench(lambda: src.sum(), warmup=25, rep=200, return_mode="median")
    cp = triton.testing.do_bench(lambda: src.clone(), warmup=25, rep=200, return_mode="median")
    n = src.numel() * 8
    return n / (rd * 1e-3), 2 * n / (cp * 1e-3)


def ncu_run() -> None:
    """Each lora_gemm variant of rank 64 once to compile, then once more (profile with --launch-skip 3)."""
    fns, bad = variants(64, check=False)
    names = ["lora_gemm, adapters", "lora_gemm, slots -1", "lora_gemm, no LoRA"]
    for _ in range(2):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    print("profiled in this order:", names, "wrong:", bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.3)
    ap.add_argument("--modes", default="write,read")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--shrink-configs", default="", help="SCALED_SWEEP names: each timed alone and as the "
                    "default shrink of lora_linear")  # fmt: skip
    args = ap.parse_args()
    if args.ncu:
        ncu_run()
        return
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    rd, cp = bandwidths()
    lines = [
        f"machine: {props.name}, torch {torch.__version__}, triton {triton.__version__}, commit {lk.commit()}, "
        f"{time.strftime('%Y-%m-%d')}",
        f"read-only bandwidth (torch sum of 2 GiB): {rd / 1e9:.0f} GB/s; copy (clone, read+write): "
        f"{cp / 1e9:.0f} GB/s",
        f"4x4608 tokens, QKV 3x3072, hidden 3072; {args.rounds} interleaved rounds, {args.gap_s:g} s idle before "
        "each timing; medians; vs cuBLAS = median of per-round ratios to cuBLAS (hidden 3072) - 1",
        "",
        "| rank | L2 flush | row | time | vs cuBLAS |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    shrinks = tuple(n for n in args.shrink_configs.split(",") if n)
    for rank in map(int, args.ranks.split(",")):
        fns, bad = variants(rank, shrinks=shrinks)
        if bad:
            lines.append(f"rank {rank}: WRONG output: {bad}")
        for mode in args.modes.split(","):
            lk.FLUSH_MODE = mode
            res = lk.interleaved(fns, args.rounds, args.gap_s)
            for name, (ms, r) in res.items():
                lines.append(f"| {rank} | {mode} | {name} | {ms * 1e3:.1f} µs | {100 * (r - 1):+.1f} % |")
            print("\n".join(lines[-len(res) :]), flush=True)
            with open(os.path.join(args.out, "lora_gemm_parts.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
