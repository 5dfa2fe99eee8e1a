"""The Gluon kernels compile for Hopper (sm_90) without a GPU: the launchers' arguments, built from CPU tensors,
go to `warmup` against an sm_90 target, through the Triton installed here (its Gluon front end, its ptxas).
This catches what the GPU tests would only see on a Hopper machine: a kernel that no longer traces, type
checks or fits shared memory. Whether the code is right, and fast, is for the GPU tests and benchmarks.

Without FOLD (the rank-16 LoRA MMA after the K steps, from boxes of their own): Triton 3.9's Gluon refuses
the ring's LoRA load that FOLD leaves dead (a box narrower than its ring slot), so those kernels compile only
with the Triton they run with (3.6, `gluon_op.GLUON_TRITON`)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from ditserve.kernels.lora_gemm import gluon_kernel, gluon_op  # noqa: E402

HIDDEN = 3072
SIZES = [3072, 3072, 3072]


class _Hopper:
    """The active driver for the compile: an sm_90 target, CPU tensors."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def compiled(monkeypatch):
    """Compiled kernels by name: the launchers' `kernel[grid](...)` becomes `kernel.warmup(...)` (no launch)."""
    out: dict[str, object] = {}

    class _Warmup:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                out[self.name] = self.fn.warmup(*args, grid=grid, **kwargs)

            return run

    for name in ("_gluon_lora_gemm_kernel", "_gluon_lora_linear_kernel"):
        monkeypatch.setattr(gluon_kernel, name, _Warmup(name, getattr(gluon_kernel, name)))
    # the active driver back as it was after the test (`driver.active` itself would create one: none on CPU)
    monkeypatch.setattr(driver, "_active", getattr(driver, "_active", None))
    driver.set_active(_Hopper())
    return out


def _batch(num_tokens: int, groups: int, rank: int, loras: int = 4):
    """bf16 CPU tensors of a batch of 4 equal requests, one adapter each (the values are never read)."""
    x = torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16)
    w = torch.zeros(sum(SIZES), HIDDEN, dtype=torch.bfloat16)
    a = torch.zeros(groups, loras, rank, HIDDEN, dtype=torch.bfloat16)
    b = torch.zeros(loras, sum(SIZES), rank, dtype=torch.bfloat16)
    token_seg = torch.arange(num_tokens, dtype=torch.int32) // (num_tokens // 4)
    seg_slot = torch.arange(4, dtype=torch.int32)
    seg_scale = torch.ones(4)
    slot_rank = torch.full((loras,), rank, dtype=torch.int32)
    return x, w, a, b, token_seg, seg_slot, seg_scale, slot_rank


def _assert_hopper_kernel(kernel):
    ptx = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert kernel.metadata.shared <= gluon_op.SMEM_LIMIT


@pytest.mark.parametrize(
    "cfg",
    [
        {"FOLD": 0},  # units spread over the run (some in halves), y in chunks, the LoRA MMA as a ring step
        {"FOLD": 0, "EPI_SPLIT": 1, "EPI_BUFS": 1},  # y whole
        {"SPREAD": 0, "FOLD": 0},  # the units first
        {"FOLD": 0, "UNIT_HALVES": 0},  # whole units only
    ],
)
def test_one_launch_compiles_for_hopper(compiled, cfg):
    x, w, a, b, token_seg, seg_slot, seg_scale, slot_rank = _batch(1024, 3, 16)
    gluon_op.launch_gluon_lora_linear(
        x,
        w,
        None,
        a,
        b,
        token_seg,
        seg_slot,
        seg_scale,
        slot_rank,
        16,
        SIZES,
        {**gluon_op.GLUON_CONFIG, **cfg},
    )
    _assert_hopper_kernel(compiled["_gluon_lora_linear_kernel"])


@pytest.mark.parametrize("rank", [16, 64])
def test_gemm_compiles_for_hopper(compiled, rank):
    """The GEMM on a given s with its LoRA steps in the ring, the last round cut along K (18 row blocks × 36
    column blocks leave a partial round on the 4 programs of a CPU device)."""
    x, w, _, b, token_seg, seg_slot, _, _ = _batch(2304, 3, rank)
    s = torch.zeros(3, x.shape[0], rank, dtype=torch.bfloat16)
    gluon_op.launch_gluon_lora_gemm(
        x, w, None, s, b, token_seg, seg_slot, SIZES, {**gluon_op.GLUON_CONFIG, "FOLD": 0}
    )
    _assert_hopper_kernel(compiled["_gluon_lora_gemm_kernel"])
