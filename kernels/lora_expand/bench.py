"""GB/s of the segmented expand vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_expand.bench   (GPU)
"""

import torch
import triton
import triton.testing

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora_expand.op import launch_lora_expand
from ditserve.kernels.lora_expand.reference import lora_expand_ref


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["tokens_per_request"],
        x_vals=[256, 1024, 4608],
        line_arg="provider",
        line_vals=["reference", "ours", "copy"],
        line_names=["torch loop", "triton", "copy (floor)"],
        ylabel="GB/s",
        plot_name="lora_expand rank 64, QKV 3x3072, hidden 3072",
        args={"rank": 64, "sizes": (3072, 3072, 3072)},
    )
)
def bench(tokens_per_request, provider, rank, sizes):
    p = make_problem([(tokens_per_request, i) for i in range(4)], rank, list(sizes))
    m = p.meta
    nbytes = p.expand_bytes()
    s = torch.randn(len(sizes), m.num_tokens, m.max_rank, device="cuda")
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    if provider == "reference":
        fn = lambda: lora_expand_ref(p.y, s, p.b, *seg, list(sizes))  # noqa: E731
    elif provider == "ours":
        fn = lambda: launch_lora_expand(p.y, s, p.b, m.token_seg, *seg, list(sizes))  # noqa: E731
    else:
        buf = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        fn = lambda: buf.clone()  # noqa: E731
    ms = triton.testing.do_bench(fn, return_mode="median")
    return nbytes / (ms * 1e-3) / 1e9


if __name__ == "__main__":
    bench.run(print_data=True)
