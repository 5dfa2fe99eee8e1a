"""The Gluon lora_gemm without LoRA, compiled two ways, against cuBLAS (one H200): HAS_LORA=False (the plain
loop) and HAS_LORA=True with zero LoRA steps (the same work through the LoRA variant's code). QKV of 4 × 4608
tokens (hidden 3072, 3 × 3072 outputs), bf16; each timing a CUDA graph of 10 launches after 0.2 s of idle
GPU, 7 interleaved rounds, medians; "+%" = median per-round ratio to cuBLAS minus 1.

    python3 benchmarks/gluon_gemm_codegen.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ditserve.kernels._tiling import column_blocks
    from ditserve.kernels.lora_gemm.gluon_kernel import _gluon_lora_gemm_kernel

    t, h, n = 18432, 3072, 9216
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.02
    y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    token_seg = torch.zeros(t, device="cuda", dtype=torch.int32)
    seg_slot = torch.full((1,), -1, device="cuda", dtype=torch.int32)

    def desc(a, block):
        return TensorDescriptor.from_tensor(
            a, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        )

    xd, wd, yd = desc(x, [128, 64]), desc(w, [256, 64]), desc(y, [128, 256])
    cols, blks, ncb = column_blocks([3072] * 3, 256)

    def run(lora_code: bool) -> None:
        _gluon_lora_gemm_kernel[(132,)](
            xd, wd, xd, wd, yd, y, token_seg, seg_slot, t, n, *cols, *blks, ncb, 0, t, n,
            BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, LORA_K=16, GROUP_M=16, NUM_BUFFERS=3, HAS_LORA=lora_code,
            HAS_BIAS=False, num_warps=8,
        )  # fmt: skip

    fns = {
        "cuBLAS": lambda: F.linear(x, w),
        "Gluon, plain loop": lambda: run(False),
        "Gluon, LoRA code with 0 LoRA steps": lambda: run(True),
    }
    want = F.linear(x, w).float()
    for name in list(fns)[1:]:
        fns[name]()
        torch.cuda.synchronize()
        print(f"{name}: max |y - cuBLAS| {(y.float() - want).abs().max().item():.3g}")
    graphs = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                fn()
        graphs[name] = g
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(7):
        for name, g in graphs.items():
            time.sleep(0.2)
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 10)
    for name, ms in times.items():
        ratio = statistics.median(a / b for a, b in zip(ms, times["cuBLAS"], strict=True)) - 1
        print(f"{name}: {statistics.median(ms) * 1e3:.0f} µs ({ratio:+.1%})")


if __name__ == "__main__":
    main()
