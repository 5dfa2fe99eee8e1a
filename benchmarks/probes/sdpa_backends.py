"""Which kernel ``F.scaled_dot_product_attention`` runs by default here, and how fast each SDPA backend is on
the families' attention shapes (bf16, q/k/v as diffusers' processors hand them over: (B, L, H, D) transposed
to (B, H, L, D)). TFLOP/s count 4·B·H·Lq·Lk·D per call.

    python benchmarks/probes/sdpa_backends.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, heads, tokens, head_dim): 1024² images (text tokens included), 480p × 33 frames videos.
SHAPES = [
    ("FLUX.1 1024²", 1, 24, 4608, 128),
    ("FLUX.2 dev 1024²", 1, 48, 4608, 128),
    ("SD3.5 large 1024² (CFG rows)", 2, 38, 4429, 64),
    ("Wan 2.2 A14B 832x480x33 (CFG rows)", 2, 40, 14040, 128),
    ("HunyuanVideo 1.5 848x480x33 (CFG rows)", 2, 16, 15310, 128),
]


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    print(
        torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version(), flush=True
    )
    for name, b, h, n, d in SHAPES:
        q, k, v = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)
        )
        flops = 4 * b * h * n * n * d
        row = []
        for label, backends in (
            ("default", None),
            ("flash", [SDPBackend.FLASH_ATTENTION]),
            ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
            ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
        ):

            def call(backends=backends, q=q, k=k, v=v):
                if backends is None:
                    return F.scaled_dot_product_attention(q, k, v)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, k, v)

            try:
                ms = timed(call)
                row.append(f"{label} {ms:.2f} ms ({flops / ms / 1e9:.0f} TF/s)")
            except RuntimeError as error:
                row.append(f"{label} refused ({str(error)[:40]})")
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with prof:
            F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
        kernels = sorted({e.key[:50] for e in prof.key_averages() if e.device_time_total > 0})
        print(f"{name}: " + "; ".join(row) + f"; default runs {kernels}", flush=True)


if __name__ == "__main__":
    main()
