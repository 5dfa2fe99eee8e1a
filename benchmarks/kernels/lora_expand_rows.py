"""The in-place LoRA expand (GPU): the one-tile-per-program kernel against the row-stationary one and its
candidate tiles, in interleaved rounds, on 4 (--requests) × 4608 tokens, hidden 3072, 3 and 4 output slices.

    PYTHONPATH=<dir holding ditserve/> python3 benchmarks/kernels/lora_expand_rows.py --out DIR

Every config's output is checked against the torch reference first (WRONG configs are left out). "% HBM" =
(bytes that must move / copy bandwidth measured in the same run) / time; "x" = median of the per-round
ratios to the one-tile-per-program kernel. Writes DIR/lora_expand_rows_<requests>x4608.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth, make_problem  # noqa: E402
from ditserve.kernels._dispatch import block_rank  # noqa: E402
from ditserve.kernels.lora import lora_shrink  # noqa: E402
from ditserve.kernels.lora_expand.configs import ExpandProblem, choose, triton_tiles  # noqa: E402
from ditserve.kernels.lora_expand.gluon_op import gluon_expand_ok  # noqa: E402
from ditserve.kernels.lora_expand.op import launch_lora_expand  # noqa: E402
from ditserve.kernels.lora_expand.reference import lora_expand_ref  # noqa: E402


def rows(bm: int, bn: int, chunk: int, stages: int, warps: int, tma: int = 0) -> dict[str, int]:
    """tma: 1 = B tiles through a TMA descriptor, 2 = y tiles of one-segment row blocks too, 3 = and their s
    loaded before the segment metadata (S_EARLY)."""
    return dict(ROWS=1, BLOCK_M=bm, BLOCK_N=bn, CHUNK=chunk, STAGES=stages, num_warps=warps,
                B_TMA=int(tma >= 1), Y_TMA=int(tma >= 2), S_EARLY=int(tma >= 3))  # fmt: skip


CANDIDATES = {
    "rows 32x128 c8 s3 w4 B+y tma": rows(32, 128, 8, 3, 4, 2),
    "rows 64x128 c8 s3 w4 B+y tma": rows(64, 128, 8, 3, 4, 2),
    "rows 128x128 c16 s3 w8 B+y tma": rows(128, 128, 16, 3, 8, 2),
    "rows 64x128 c8 s3 w4 B+y tma s early": rows(64, 128, 8, 3, 4, 3),
    "rows 128x128 c12 s3 w8 B+y tma s early": rows(128, 128, 12, 3, 8, 3),
    # the Gluon kernel for Hopper (lora_expand/gluon_kernel.py): equal spans of tiles, a loader warp, a ring as
    # deep as shared memory allows, a slot freed LAG TMA stores later
    "gluon 128x64 lag2": dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=2, num_warps=8),
    "gluon 128x64 lag1": dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=1, num_warps=8),
    "gluon 128x128 lag1": dict(GLUON=1, BLOCK_M=128, BLOCK_N=128, STAGES=0, LAG=1, num_warps=8),
    "gluon 64x128 lag2": dict(GLUON=1, BLOCK_M=64, BLOCK_N=128, STAGES=0, LAG=2, num_warps=4),
    # two compute partitions of one warpgroup each, every other tile
    "gluon w2 128x64 lag0": dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=0, num_warps=4, WG=2),
    "gluon w2 64x128 lag0": dict(GLUON=1, BLOCK_M=64, BLOCK_N=128, STAGES=0, LAG=0, num_warps=4, WG=2),
    "gluon w2 64x64 lag1": dict(GLUON=1, BLOCK_M=64, BLOCK_N=64, STAGES=0, LAG=1, num_warps=4, WG=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--ranks", default="16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4, help="requests of 4608 tokens, one adapter each")
    ap.add_argument("--slices", default="3,4", help="3 (QKV) and/or 4 (a single block's q, k, v, mlp)")
    ap.add_argument(
        "--chunks", default="", help="also time every candidate tile with these CHUNK values (e.g. 2,4,24)"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="KEY=VAL[,KEY=VAL]: also time the default tile with these settings (repeatable), e.g. S_EARLY=1",
    )
    ap.add_argument(
        "--candidates",
        default=None,
        help="comma-separated CANDIDATES names to time (default: all; empty: only the default and --variant)",
    )
    args = ap.parse_args()
    if args.candidates is not None:
        keep = set(filter(None, args.candidates.split(",")))
        for name in set(CANDIDATES) - keep:
            del CANDIDATES[name]
    variants = {v: dict((k, int(x)) for k, x in (kv.split("=") for kv in v.split(","))) for v in args.variant}
    bw = copy_bandwidth()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s",
        "",
    ]
    lines += ["| slices | rank | config | µs | % HBM | x one tile per program |", "|---|---|---|---|---|---|"]
    lines[0] += f"; {args.requests} × 4608 tokens"
    for nsl in map(int, args.slices.split(",")):
        sizes = {3: [3072] * 3, 4: [3072] * 3 + [12288]}[nsl]  # QKV, or a single block's q, k, v, mlp
        for rank in map(int, args.ranks.split(",")):
            p = make_problem([(4608, i) for i in range(args.requests)], rank, sizes)
            m = p.meta
            s = lora_shrink(p.x, p.a, m)
            seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
            want = p.y.clone()
            lora_expand_ref(want, s, p.b, *seg[1:], sizes)
            configs = {"one tile per program": triton_tiles(block_rank(rank)), **CANDIDATES}
            for c in filter(None, args.chunks.split(",")):
                for name, cfg in CANDIDATES.items():
                    configs[f"{name} -> c{c}"] = {**cfg, "CHUNK": int(c)}
            configs[f"default ({choose(ExpandProblem(nsl, block_rank(rank)), p.y.device)})"] = None
            for name, kv in variants.items():
                configs[f"default + {name}"] = {**triton_tiles(block_rank(rank), accumulate=True), **kv}
            fns = {}
            for name, cfg in configs.items():
                if cfg and cfg.get("GLUON") and not gluon_expand_ok(p.y, s, p.b, sizes, m.seg_align, cfg):
                    lines.append(f"| {nsl} | {rank} | {name} | outside its contract | | |")
                    continue
                y = p.y.clone()
                try:
                    launch_lora_expand(y, s, p.b, *seg, sizes, config=cfg, seg_align=m.seg_align)
                except Exception as e:  # out of shared memory
                    lines.append(f"| {nsl} | {rank} | {name} | fail ({type(e).__name__}) | | |")
                    continue
                if (y.float() - want.float()).abs().max().item() > 0.1:
                    lines.append(f"| {nsl} | {rank} | {name} | WRONG | | |")
                    continue
                fns[name] = lambda cfg=cfg, p=p, s=s, seg=seg, sizes=sizes: launch_lora_expand(
                    p.y, s, p.b, *seg, sizes, config=cfg, seg_align=p.meta.seg_align
                )
            res = lk.interleaved(fns, args.rounds, 0.1)
            floor_ms = p.expand_bytes() / bw * 1e3
            for name, (ms, ratio) in res.items():
                lines.append(
                    f"| {nsl} | {rank} | {name} | {ms * 1e3:.1f} | {100 * floor_ms / ms:.0f}% | {ratio:.3f} |"
                )
            print("\n".join(lines[-len(res) :]), flush=True)
            del p, s, want
            torch.cuda.empty_cache()
    lk.save(args.out, lines, f"lora_expand_rows_{args.requests}x4608")


if __name__ == "__main__":
    main()
