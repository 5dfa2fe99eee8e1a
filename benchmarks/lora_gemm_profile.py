"""Launches for a profiler: `lora_gemm` on the Flux QKV shape (4 requests × 4608 tokens, hidden 3072, 3 × 3072
outputs, 4 rank-16 adapters), three rounds of the Gluon kernel without LoRA, the Gluon kernel with the
adapters, and the Triton kernel without LoRA. For example (one H200):

    ncu --clock-control none --kernel-name regex:"_lora_gemm_kernel" --launch-skip 6 --launch-count 3 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python3 benchmarks/lora_gemm_profile.py
"""

from __future__ import annotations

import torch

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora_gemm.op import SWEEP, launch_lora_gemm
from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref


def main() -> None:
    p = make_problem([(4608, i) for i in range(4)], 16, [3072] * 3)
    m = p.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    s = lora_shrink_scaled_ref(p.x, p.a, *seg[:4], m.seg_scale, m.slot_rank, m.max_rank)
    gluon = SWEEP["gluon"]
    for _ in range(3):
        for cfg, s_in in ((gluon, s[:, :, :0]), (gluon, s), (None, s[:, :, :0])):
            launch_lora_gemm(p.x, p.w, None, s_in, p.b, *seg, p.sizes, config=cfg, s_scaled=True,
                             seg_align=m.seg_align)  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
