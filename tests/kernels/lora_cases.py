"""Random multi-LoRA batches for the kernel tests: segment layouts, slot ranks, weights."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from ditserve.kernels.lora_meta import LoRABatchMeta

MAX_LORAS = 4
MAX_RANK = 32


@dataclasses.dataclass
class Case:
    meta: LoRABatchMeta
    x: torch.Tensor  # [num_tokens, hidden]
    a: torch.Tensor  # [num_slices, MAX_LORAS, MAX_RANK, hidden]
    b: torch.Tensor  # [MAX_LORAS, sum(sizes), MAX_RANK]
    y: torch.Tensor  # [num_tokens, sum(sizes)]
    sizes: list[int]


# token counts: empty and 1-token segments are common, a few longer than a 16..128 tile
token_counts = st.one_of(st.sampled_from([0, 1, 1, 2, 17]), st.integers(0, 150))


@st.composite
def layouts(draw, max_requests: int = 6):
    """(requests, slot_ranks, scales): rank 0 slots, mixed ranks, slot -1, repeated slots."""
    ranks = draw(st.lists(st.sampled_from([0, 1, 4, 8, 13, 16, 32]), min_size=MAX_LORAS, max_size=MAX_LORAS))
    requests = draw(
        st.lists(st.tuples(token_counts, st.integers(-1, MAX_LORAS - 1)), min_size=1, max_size=max_requests)
    )
    scales = draw(
        st.lists(st.sampled_from([0.5, 1.0, 2.0, -0.75]), min_size=len(requests), max_size=len(requests))
    )
    return requests, ranks, scales


def make_case(
    layout,
    num_slices: int,
    sizes: list[int],
    hidden: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    chunk_size: int | None = None,
    max_rank: int = MAX_RANK,
) -> Case:
    requests, ranks, scales = layout
    meta = LoRABatchMeta.build(requests, ranks, scales, device=device, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(seed)
    t = meta.num_tokens

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    x = rnd(t, hidden)
    a = rnd(num_slices, MAX_LORAS, max_rank, hidden, std=hidden**-0.5)
    b = rnd(MAX_LORAS, sum(sizes), max_rank, std=max_rank**-0.5)
    y = rnd(t, sum(sizes))
    return Case(meta, x, a, b, y, sizes)


def dense_oracle(case: Case) -> torch.Tensor:
    """Token by token, in fp64: y + scale · (x · Aᵀ) · Bᵀ for the token's slot."""
    m = case.meta
    ranks = m.slot_rank.tolist()
    seg_of = m.token_seg.tolist()
    slots, scales = m.seg_slot.tolist(), m.seg_scale.tolist()
    out = case.y.double().clone()
    offsets = [0]
    for n in case.sizes:
        offsets.append(offsets[-1] + n)
    for t in range(m.num_tokens):
        slot = slots[seg_of[t]]
        if slot < 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        for j in range(len(case.sizes)):
            low = case.x[t].double() @ case.a[j, slot, :r].double().T
            out[t, offsets[j] : offsets[j + 1]] += scales[seg_of[t]] * (
                case.b[slot, offsets[j] : offsets[j + 1], :r].double() @ low
            )
    return out


# --- GPU, bf16, Flux sizes: straddling tiles, 0/1-token requests, no-LoRA rows, ranks up to 128 ----------

HIDDEN = 3072
GPU_REQUESTS = [(1000, 0), (1, 1), (0, 2), (517, 3), (300, -1), (2000, 1), (129, 0)]
GPU_RANKS = [16, 64, 128, 32, 0]
GPU_SIZES = {3: [3072] * 3, 4: [3072, 3072, 3072, 12288]}


GPU_SCALES = [0.5, 1.0, 2.0, 0.25, 1.0, 1.0, -1.0]


def gpu_problem(num_slices: int, requests=GPU_REQUESTS):
    """(meta, x, a, b, w, bias, sizes) on the GPU in bf16, hidden 3072, 3 or 4 Flux output slices."""
    scales = [GPU_SCALES[i % len(GPU_SCALES)] for i in range(len(requests))]
    meta = LoRABatchMeta.build(requests, GPU_RANKS, scales, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = GPU_SIZES[num_slices]

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    x = rnd(meta.num_tokens, HIDDEN)
    a = rnd(num_slices, len(GPU_RANKS), 128, HIDDEN, std=HIDDEN**-0.5)
    b = rnd(len(GPU_RANKS), sum(sizes), 128, std=128**-0.5)
    w = rnd(sum(sizes), HIDDEN, std=HIDDEN**-0.5)
    bias = rnd(sum(sizes))
    return meta, x, a, b, w, bias, sizes


def gluon_launches(monkeypatch) -> list[str]:
    """Skip unless the Gluon kernels can run (Hopper, Triton's Gluon); else a list that gets an entry for every
    launch of one: "gemm" (the GEMM on a given s) or "linear" (the shrink inside the launch)."""
    import pytest

    from ditserve.kernels._hopper import gluon_available
    from ditserve.kernels.lora_gemm import gluon_op

    if not gluon_available(torch.cuda.current_device()):
        pytest.skip(
            "the Gluon kernel needs a Hopper GPU (sm_90) and a Triton it was tested with (GLUON_TRITON)"
        )
    calls: list[str] = []
    for name, fn in (
        ("gemm", gluon_op.launch_gluon_lora_gemm),
        ("linear", gluon_op.launch_gluon_lora_linear),
    ):
        monkeypatch.setattr(
            gluon_op, fn.__name__, lambda *a, name=name, fn=fn, **k: calls.append(name) or fn(*a, **k)
        )
    return calls
