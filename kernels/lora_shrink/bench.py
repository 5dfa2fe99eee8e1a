"""GB/s of the segmented shrink vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_shrink.bench   (GPU)
"""

import torch
import triton
import triton.testing

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora_shrink.op import launch_lora_shrink
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["tokens_per_request"],
        x_vals=[256, 1024, 4608],
        line_arg="provider",
        line_vals=["reference", "ours", "copy"],
        line_names=["torch loop", "triton", "copy (floor)"],
        ylabel="GB/s",
        plot_name="lora_shrink rank 64, 3 slices, hidden 3072",
        args={"rank": 64, "num_slices": 3},
    )
)
def bench(tokens_per_request, provider, rank, num_slices):
    p = make_problem([(tokens_per_request, i) for i in range(4)], rank, [3072] * num_slices)
    m = p.meta
    nbytes = p.shrink_bytes()
    if provider == "reference":
        fn = lambda: lora_shrink_ref(p.x, p.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)  # noqa: E731
    elif provider == "ours":
        args = (p.x, p.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
        fn = lambda: launch_lora_shrink(*args)  # noqa: E731
    else:
        buf = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        fn = lambda: buf.clone()  # noqa: E731
    ms = triton.testing.do_bench(fn, return_mode="median")
    return nbytes / (ms * 1e-3) / 1e9


if __name__ == "__main__":
    bench.run(print_data=True)
