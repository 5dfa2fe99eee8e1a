"""GB/s of the chunked SGMV expand vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_expand_sgmv.bench   (GPU)
"""

import torch
import triton
import triton.testing

from ditserve.kernels._bench import make_problem
from ditserve.kernels.lora_expand_sgmv.op import launch_lora_expand_sgmv
from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["tokens_per_request"],
        x_vals=[256, 1024, 4608],
        line_arg="provider",
        line_vals=["reference", "ours", "copy"],
        line_names=["torch loop", "triton", "copy (floor)"],
        ylabel="GB/s",
        plot_name="lora_expand_sgmv rank 64, QKV 3x3072, hidden 3072",
        args={"rank": 64, "sizes": (3072, 3072, 3072)},
    )
)
def bench(tokens_per_request, provider, rank, sizes):
    p = make_problem([(tokens_per_request, i) for i in range(4)], rank, list(sizes))
    m = p.meta
    nbytes = p.expand_bytes()
    s = torch.randn(len(sizes), m.num_tokens, m.max_rank, device="cuda")
    ids = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    if provider == "reference":
        fn = lambda: lora_expand_sgmv_ref(p.y, s, p.b, *ids, list(sizes))  # noqa: E731
    elif provider == "ours":
        fn = lambda: launch_lora_expand_sgmv(p.y, s, p.b, *ids, list(sizes), m.chunk_size)  # noqa: E731
    else:
        buf = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        fn = lambda: buf.clone()  # noqa: E731
    ms = triton.testing.do_bench(fn, return_mode="median")
    return nbytes / (ms * 1e-3) / 1e9


if __name__ == "__main__":
    bench.run(print_data=True)
