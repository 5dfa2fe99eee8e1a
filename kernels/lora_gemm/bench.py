"""TFLOP/s of the GEMM with the LoRA epilogue vs cuBLAS F.linear alone and the torch reference
(4 requests, 4 adapters, rank 64, QKV 3x3072, hidden 3072).

python -m ditserve.kernels.lora_gemm.bench   (GPU)
"""

import torch.nn.functional as F

from ditserve.kernels._bench import LoRAProblem, perf_table
from ditserve.kernels.lora import lora_shrink
from ditserve.kernels.lora_gemm.op import launch_lora_gemm
from ditserve.kernels.lora_gemm.reference import lora_gemm_ref


def calls(p: LoRAProblem):
    m = p.meta
    s = lora_shrink(p.x, p.a, m)
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    return {
        "reference": lambda: lora_gemm_ref(p.x, p.w, None, s, p.b, *seg, p.sizes),
        "ours": lambda: launch_lora_gemm(p.x, p.w, None, s, p.b, m.token_seg, *seg, p.sizes),
        "cublas": lambda: F.linear(p.x, p.w),
    }


def tflops(p: LoRAProblem, provider: str, ms: float) -> float:
    return 2 * p.meta.num_tokens * p.x.shape[1] * sum(p.sizes) / (ms * 1e-3) / 1e12


if __name__ == "__main__":
    lines = {
        "reference": "torch (fp32 GEMM + loop)",
        "ours": "triton GEMM+LoRA",
        "cublas": "cuBLAS GEMM, no LoRA",
    }
    perf_table(
        "lora_gemm rank 64, QKV 3x3072, hidden 3072", "TFLOP/s (base GEMM FLOPs)", lines, tflops, calls
    )
