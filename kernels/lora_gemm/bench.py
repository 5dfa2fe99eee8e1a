"""TFLOP/s of the GEMM with the LoRA epilogue vs cuBLAS F.linear alone and the torch reference
(4 requests, 4 adapters, rank 64, QKV 3x3072, hidden 3072).

python -m ditserve.kernels.lora_gemm.bench   (GPU)
"""

import torch.nn.functional as F
import triton
import triton.testing

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora import lora_shrink
from ditserve.kernels.lora_gemm.op import launch_lora_gemm
from ditserve.kernels.lora_gemm.reference import lora_gemm_ref


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["tokens_per_request"],
        x_vals=[256, 1024, 4608],
        line_arg="provider",
        line_vals=["reference", "ours", "cublas"],
        line_names=["torch (fp32 GEMM + loop)", "triton GEMM+LoRA", "cuBLAS GEMM, no LoRA"],
        ylabel="TFLOP/s (base GEMM FLOPs)",
        plot_name="lora_gemm rank 64, QKV 3x3072, hidden 3072",
        args={"rank": 64, "sizes": (3072, 3072, 3072)},
    )
)
def bench(tokens_per_request, provider, rank, sizes):
    p = make_problem([(tokens_per_request, i) for i in range(4)], rank, list(sizes))
    m = p.meta
    s = lora_shrink(p.x, p.a, m)
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    if provider == "reference":
        fn = lambda: lora_gemm_ref(p.x, p.w, None, s, p.b, *seg, p.sizes)  # noqa: E731
    elif provider == "ours":
        fn = lambda: launch_lora_gemm(p.x, p.w, None, s, p.b, m.token_seg, *seg, p.sizes)  # noqa: E731
    else:
        fn = lambda: F.linear(p.x, p.w)  # noqa: E731
    ms = triton.testing.do_bench(fn, return_mode="median")
    return 2 * m.num_tokens * p.x.shape[1] * sum(sizes) / (ms * 1e-3) / 1e12


if __name__ == "__main__":
    bench.run(print_data=True)
