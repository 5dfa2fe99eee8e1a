"""Launches for a profiler: the default scaled shrink (bf16 scale · s, what the fused GEMM reads) on 4 requests ×
4608 tokens (hidden 3072) at each slice count and rank, and on one request at rank 16, then cuBLAS on the same
bytes and FLOPs (x · Aᵀ with one adapter for every row) at 3 slices, each inside the NVTX range "prof". One H200:

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 benchmarks/lora_shrink_profile.py
"""

from __future__ import annotations

import torch

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora import lora_shrink

CASES = [(4, 3, 16), (4, 4, 16), (4, 3, 32), (4, 4, 32), (4, 3, 64), (4, 4, 64), (1, 3, 16)]


def main() -> None:
    for requests, slices, rank in CASES:
        p = make_problem([(4608, i) for i in range(requests)], rank, [3072] * 3 + [12288] * (slices - 3))
        lora_shrink(p.x, p.a, p.meta, scaled=True)  # compiled outside the range
        dense = p.a[:, 0].reshape(-1, p.a.shape[-1]).contiguous()
        _ = p.x @ dense.T
        torch.cuda.synchronize()
        print(f"case {requests}x4608 slices={slices} rank={rank}", flush=True)
        torch.cuda.nvtx.range_push("prof")
        lora_shrink(p.x, p.a, p.meta, scaled=True)
        if requests == 4 and slices == 3:
            _ = p.x @ dense.T
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
