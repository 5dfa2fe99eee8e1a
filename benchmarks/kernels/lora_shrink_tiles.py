"""The segmented LoRA shrink's default tiles against named candidates, for both outputs it writes (fp32 s
for the unfused path, bf16 scale · s for the fused GEMM), every result checked against the reference.

    python benchmarks/kernels/lora_shrink_tiles.py --out DIR [--batches 4x4608,1x4608] [--slices 3,4] \
        [--ranks 32,64,128] [--configs "tma 128/64/8/4 split,128/64/8/3 split"]

Times: CUDA-graph replay with L2 flushed before each call (`lora_kernels.quick_graph_ms`), µs; WRONG after
a time whose output is not within 2e-2 of the reference. Candidates are lora_shrink/op.py SCALED_SWEEP names.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels.lora_shrink.op import SCALED_SWEEP, launch_lora_shrink  # noqa: E402
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref  # noqa: E402

# batches whose requests do not lie on 128- or 192-row blocks (image sizes that are not multiples of 256 px):
# the Gluon forms' pieces end at segment ends there
BATCHES = {
    **lk.BATCHES,
    "4x4544": [(4544, i) for i in range(4)],
    "4x4600": [(4600, i) for i in range(4)],
    "1x4600": [(4600, 0)],
    "skew 4600/1000/4544/300": [(4600, 0), (1000, 1), (4544, 2), (300, 3)],
}
DEFAULT_CONFIGS = ["tma 128/64/8/4 split", "tma 64/64/4/4 split", "tma 64/64/4/4", "128/64/8/3 split",
                   "64/64/4/4 split"]  # fmt: skip


def time_cell(fn, want) -> str:
    try:
        got = fn()
        ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        return f"{lk.quick_graph_ms(fn) * 1e3:.1f}{'' if ok else ' WRONG'}"
    except Exception as e:  # a candidate that does not fit shared memory at this rank
        return f"fail ({type(e).__name__})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--batches", default="4x4608,1x4608,skew 4608/1024/4608/256")
    ap.add_argument("--slices", default="3,4")
    ap.add_argument("--ranks", default="32,64,128")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"machine: {props.name}, torch {torch.__version__}, commit {lk.commit()}, {time.strftime('%Y-%m-%d')}",
        "segmented shrink, hidden 3072, bf16 x and A, one adapter per request; µs per call",
        "",
        "| batch | slices | rank | output | default | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    print("\n".join(lines), flush=True)
    for batch in args.batches.split(","):
        for nsl in map(int, args.slices.split(",")):
            for rank in map(int, args.ranks.split(",")):
                p = lk.make_problem(BATCHES[batch], rank, lk.SLICES[nsl])
                m = p.meta
                seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot)
                wants = {
                    "fp32": lora_shrink_ref(p.x, p.a, *seg[1:], m.slot_rank, m.max_rank),
                    "bf16 scaled": lora_shrink_scaled_ref(
                        p.x, p.a, *seg, m.seg_scale, m.slot_rank, m.max_rank
                    ),
                }
                for out, want in wants.items():
                    kw = dict(seg_scale=m.seg_scale) if out != "fp32" else {}
                    cells = []
                    # the default timed twice, the first discarded: a problem's first timed cell reads slow
                    # (the fp32 s up to a third over the same kernel's own column)
                    for name in [None, None, *names]:
                        cfg = SCALED_SWEEP[name] if name else None

                        def fn(cfg=cfg, kw=kw, p=p, m=m, seg=seg):
                            return launch_lora_shrink(
                                p.x,
                                p.a,
                                *seg,
                                m.slot_rank,
                                m.max_rank,
                                config=cfg,
                                seg_align=m.seg_align,
                                **kw,
                            )

                        cells.append(time_cell(fn, want))
                    lines.append(f"| {batch} | {nsl} | {rank} | {out} | " + " | ".join(cells[1:]) + " |")
                    print(lines[-1], flush=True)
                    lk.save(args.out, lines, "lora_shrink_tiles")
                del p, wants
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
