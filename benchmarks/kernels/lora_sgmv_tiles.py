"""The chunked SGMV kernels' defaults against their candidates (the expand's row-stationary walk,
lora_expand_sgmv/op.py SGMV_ROWS_SWEEP; the shrink's program per slice, lora_shrink_sgmv/op.py
SGMV_SHRINK_SWEEP) and the segmented kernels' defaults, every result checked against the reference (GPU):

    python benchmarks/kernels/lora_sgmv_tiles.py --out DIR [--op expand|shrink] [--batches "4x4608,interleaved 8x2304"]

Times: CUDA-graph replay with the L2 flushed before each call (`lora_kernels.quick_graph_ms`), µs, and % of the
HBM floor (the expand's bytes over the 2 GiB clone's bandwidth); WRONG after a time whose output is off. The
"interleaved" batches give 2 adapters to alternating requests, where SGMV groups tokens the segments do not.
`--op chunks` times both SGMV defaults with the batch's chunk size set to each of `--chunks` (the column "chunk"
is the one the policy, `choose_chunk_size`, picks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth, make_problem  # noqa: E402
from ditserve.kernels._dispatch import block_rank  # noqa: E402
from ditserve.kernels.lora import LoRABatchMeta, lora_shrink  # noqa: E402
from ditserve.kernels.lora_expand.configs import triton_tiles  # noqa: E402
from ditserve.kernels.lora_expand.op import launch_lora_expand  # noqa: E402
from ditserve.kernels.lora_expand_sgmv.op import SGMV_ROWS_SWEEP, launch_lora_expand_sgmv  # noqa: E402
from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref  # noqa: E402
from ditserve.kernels.lora_shrink.op import launch_lora_shrink  # noqa: E402
from ditserve.kernels.lora_shrink_sgmv.op import SGMV_SHRINK_SWEEP, launch_lora_shrink_sgmv  # noqa: E402
from ditserve.kernels.lora_shrink_sgmv.reference import lora_shrink_sgmv_ref  # noqa: E402

BATCHES = {
    **lk.BATCHES,
    "interleaved 8x2304": [(2304, i % 2) for i in range(8)],
}


def launch(name: str, y: torch.Tensor, p, s: torch.Tensor) -> None:
    """One expand into y: the segmented default ("segmented"), the SGMV default ("sgmv"), the SGMV kernel of one
    y tile per program ("sgmv tiles", the default before the row-stationary walk), or a candidate."""
    m = p.meta
    if name == "segmented":
        seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
        launch_lora_expand(y, s, p.b, *seg, p.sizes, seg_align=m.seg_align)
        return
    ids = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    cfg = triton_tiles(block_rank(s.shape[2])) if name == "sgmv tiles" else SGMV_ROWS_SWEEP.get(name)
    launch_lora_expand_sgmv(y, s, p.b, *ids, p.sizes, m.chunk_size, config=cfg)


def launch_shrink(name: str, p) -> torch.Tensor:
    """One shrink (fp32 s): the segmented default ("segmented"), the SGMV default ("sgmv"), or a candidate."""
    m = p.meta
    if name == "segmented":
        seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot)
        return launch_lora_shrink(p.x, p.a, *seg, m.slot_rank, m.max_rank, seg_align=m.seg_align)
    ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank, m.max_rank)
    return launch_lora_shrink_sgmv(p.x, p.a, *ids, m.chunk_size, config=SGMV_SHRINK_SWEEP.get(name))


def shrink_cells(p, bw: float) -> list[str]:
    """µs (% of the HBM floor) of each shrink on problem p, WRONG where its output is off."""
    m = p.meta
    ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank, m.max_rank)
    want = lora_shrink_sgmv_ref(p.x, p.a, *ids)
    floor_us = p.shrink_bytes() / bw * 1e6
    out = []
    for name in ["segmented", "sgmv", *SGMV_SHRINK_SWEEP]:
        ok = torch.allclose(launch_shrink(name, p), want, atol=2e-2, rtol=2e-2)
        us = lk.quick_graph_ms(lambda name=name: launch_shrink(name, p)) * 1e3
        out.append(f"{us:.1f} ({100 * floor_us / us:.0f}%){'' if ok else ' WRONG'}")
    return out


def cells(p, bw: float) -> list[str]:
    """µs (% of the HBM floor) of each expand on problem p, WRONG where its output is off."""
    m = p.meta
    s = lora_shrink(p.x, p.a, m)
    ids = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    y0 = p.y.clone()  # the timed launches add into p.y over and over: each check starts from this copy
    want = y0.clone()
    lora_expand_sgmv_ref(want, s, p.b, *ids, p.sizes)
    floor_us = p.expand_bytes() / bw * 1e6
    out = []
    for name in ["segmented", "sgmv", "sgmv tiles", *SGMV_ROWS_SWEEP]:
        y = y0.clone()
        launch(name, y, p, s)
        ok = (y.float() - want.float()).abs().max().item() <= 0.1
        us = lk.quick_graph_ms(lambda name=name: launch(name, p.y, p, s)) * 1e3
        out.append(f"{us:.1f} ({100 * floor_us / us:.0f}%){'' if ok else ' WRONG'}")
    return out


def chunk_cells(p, requests: list[tuple[int, int]], chunks: list[int], bw: float) -> list[str]:
    """Both SGMV defaults on problem p with its meta rebuilt for each chunk size: "shrink µs / expand µs" (% of
    their HBM floors), WRONG where an output is off."""
    out = []
    y0 = p.y.clone()  # the timed expands add into p.y: each check starts from this copy
    for chunk in chunks:
        meta = LoRABatchMeta.build(requests, [p.rank] * p.a.shape[1], [0.5] * len(requests), "cuda", chunk)
        q = dataclasses.replace(p, meta=meta)
        m = q.meta
        ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank, m.max_rank)
        s_want = lora_shrink_sgmv_ref(q.x, q.a, *ids)
        s = launch_shrink("sgmv", q)
        ok = torch.allclose(s, s_want, atol=2e-2, rtol=2e-2)
        shrink_us = lk.quick_graph_ms(lambda q=q: launch_shrink("sgmv", q)) * 1e3
        want = y0.clone()
        e_ids = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
        lora_expand_sgmv_ref(want, s_want, q.b, *e_ids, q.sizes)
        y = y0.clone()
        launch("sgmv", y, q, s_want)
        ok = ok and (y.float() - want.float()).abs().max().item() <= 0.1
        expand_us = lk.quick_graph_ms(lambda q=q, s=s_want: launch("sgmv", q.y, q, s)) * 1e3
        shrink_pct = 100 * q.shrink_bytes() / bw * 1e6 / shrink_us
        expand_pct = 100 * q.expand_bytes() / bw * 1e6 / expand_us
        out.append(
            f"{shrink_us:.1f} ({shrink_pct:.0f}%) / {expand_us:.1f} ({expand_pct:.0f}%){'' if ok else ' WRONG'}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--op", default="expand", choices=["expand", "shrink", "chunks"])
    ap.add_argument("--chunks", default="16,32,64,128", help="--op chunks: the chunk sizes to time")
    ap.add_argument("--batches", default="4x4608,skew 4608/1024/4608/256,1x4608,interleaved 8x2304")
    ap.add_argument("--slices", default="3,4")
    ap.add_argument("--ranks", default="16,32,64,128")
    args = ap.parse_args()
    bw = copy_bandwidth()
    chunks = [int(c) for c in args.chunks.split(",")]
    names = {
        "expand": ["SGMV one tile a program", *SGMV_ROWS_SWEEP],
        "shrink": list(SGMV_SHRINK_SWEEP),
        "chunks": [f"chunk {c}: shrink / expand" for c in chunks],
    }[args.op]
    lines = [
        f"machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, commit {lk.commit()}, "
        f"{time.strftime('%Y-%m-%d')}; copy bandwidth {bw / 1e9:.0f} GB/s; {args.op}",
        "",
        "| batch | slices | rank | chunk | segmented default | SGMV default | " + " | ".join(names) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    print("\n".join(lines), flush=True)
    for batch in args.batches.split(","):
        for nsl in map(int, args.slices.split(",")):
            for rank in map(int, args.ranks.split(",")):
                p = make_problem(BATCHES[batch], rank, lk.SLICES[nsl])
                if args.op == "chunks":
                    row = ["", "", *chunk_cells(p, BATCHES[batch], chunks, bw)]
                else:
                    row = cells(p, bw) if args.op == "expand" else shrink_cells(p, bw)
                lines.append(f"| {batch} | {nsl} | {rank} | {p.meta.chunk_size} | " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
                lk.save(args.out, lines, f"lora_sgmv_tiles_{args.op}")
                del p
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
