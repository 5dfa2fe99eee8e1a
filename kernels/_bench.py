"""Shared helpers for the LoRA kernel benchmarks: problems, byte counts, copy bandwidth."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ditserve.kernels.lora_meta import LoRABatchMeta


@dataclasses.dataclass
class LoRAProblem:
    meta: LoRABatchMeta
    x: torch.Tensor  # [num_tokens, hidden]
    a: torch.Tensor  # [num_slices, max_loras, rank, hidden]
    b: torch.Tensor  # [max_loras, sum(sizes), rank]
    y: torch.Tensor  # [num_tokens, sum(sizes)]
    w: torch.Tensor  # [sum(sizes), hidden], the fused base weight
    sizes: list[int]
    rank: int

    @property
    def num_active_slots(self) -> int:
        return len({s for s in self.meta.seg_slot.tolist() if s >= 0})

    @property
    def num_lora_tokens(self) -> int:
        return sum(
            n for n, s in zip(self.meta.seg_len.tolist(), self.meta.seg_slot.tolist(), strict=True) if s >= 0
        )

    def shrink_bytes(self) -> int:
        """Bytes a shrink must move: x once, A of the active slots, s written in fp32."""
        t, h = self.x.shape
        s_ = len(self.sizes)
        return (
            t * h * self.x.element_size()
            + s_ * self.num_active_slots * self.rank * h * 2
            + s_ * t * self.rank * 4
        )

    def expand_bytes(self) -> int:
        """Bytes an in-place expand must move: LoRA rows of y read and written, s, B of the active slots."""
        n = sum(self.sizes)
        es = self.y.element_size()
        return (
            2 * self.num_lora_tokens * n * es
            + len(self.sizes) * self.x.shape[0] * self.rank * 4
            + (self.num_active_slots * n * self.rank * es)
        )

    def shrink_flops(self) -> int:
        return 2 * self.num_lora_tokens * self.x.shape[1] * self.rank * len(self.sizes)

    def expand_flops(self) -> int:
        return 2 * self.num_lora_tokens * sum(self.sizes) * self.rank


def make_problem(
    requests: list[tuple[int, int]],  # (num_tokens, slot)
    rank: int,
    sizes: list[int],
    hidden: int = 3072,
    max_loras: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> LoRAProblem:
    meta = LoRABatchMeta.build(requests, [rank] * max_loras, [0.5] * len(requests), device=device)
    t = meta.num_tokens
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    return LoRAProblem(
        meta=meta,
        x=rnd(t, hidden),
        a=rnd(len(sizes), max_loras, rank, hidden, std=hidden**-0.5),
        b=rnd(max_loras, sum(sizes), rank, std=rank**-0.5),
        y=rnd(t, sum(sizes)),
        w=rnd(sum(sizes), hidden, std=hidden**-0.5),
        sizes=list(sizes),
        rank=rank,
    )


def copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device bytes/s of torch clone (read + write counted), the practical HBM ceiling."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = triton.testing.do_bench(lambda: src.clone(), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def matmul_flops(device: str = "cuda") -> float:
    """bf16 FLOP/s of an 8192³ torch matmul on random data, the practical tensor-core ceiling."""
    import triton.testing

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def perf_table(
    plot_name: str,
    ylabel: str,
    lines: dict[str, str],  # provider → legend
    value: Callable[[LoRAProblem, str, float], float],  # (problem, provider, ms) → the plotted value
    calls: Callable[[LoRAProblem], dict[str, Callable[[], object]]],  # problem → provider → call
    sizes: tuple[int, ...] = (3072, 3072, 3072),
    rank: int = 64,
) -> None:
    """An op's providers timed (do_bench median) for 4 requests of 256 / 1024 / 4608 tokens with 4 adapters
    (GPU); prints triton's perf_report table."""
    import triton.testing

    @triton.testing.perf_report(
        triton.testing.Benchmark(
            x_names=["tokens_per_request"],
            x_vals=[256, 1024, 4608],
            line_arg="provider",
            line_vals=list(lines),
            line_names=list(lines.values()),
            ylabel=ylabel,
            plot_name=plot_name,
            args={},
        )
    )
    def bench(tokens_per_request, provider):
        p = make_problem([(tokens_per_request, i) for i in range(4)], rank, list(sizes))
        ms = triton.testing.do_bench(calls(p)[provider], return_mode="median")
        return value(p, provider, ms)

    bench.run(print_data=True)


def gbps_report(
    plot_name: str,
    nbytes: Callable[[LoRAProblem], int],
    calls: Callable[[LoRAProblem], tuple[Callable[[], object], Callable[[], object]]],
) -> None:
    """GB/s of an op's kernel (`calls(p)` → (torch reference, ours)) against a copy of the same bytes."""

    def providers(p: LoRAProblem) -> dict[str, Callable[[], object]]:
        reference, ours = calls(p)
        return {"reference": reference, "ours": ours, "copy": torch.empty(nbytes(p) // 4, dtype=torch.bfloat16,
                                                                          device="cuda").clone}  # fmt: skip

    lines = {"reference": "torch loop", "ours": "triton", "copy": "copy (floor)"}
    perf_table(plot_name, "GB/s", lines, lambda p, _, ms: nbytes(p) / (ms * 1e-3) / 1e9, providers)
