"""The Gluon kernels compile for Hopper (sm_90) without a GPU: the launchers' arguments, built from CPU tensors,
go to `warmup` against an sm_90 target, through the Triton installed here (its Gluon front end, its ptxas).
This catches what the GPU tests would only see on a Hopper machine: a kernel that no longer traces, type
checks or fits shared memory. Whether the code is right, and fast, is for the GPU tests and benchmarks.

Without FOLD (the rank-16 LoRA MMA after the K steps, from boxes of their own): Triton 3.9's Gluon refuses
the ring's LoRA load that FOLD leaves dead (a box narrower than its ring slot), so those kernels compile only
with the Triton they run with (3.6, `_hopper.GLUON_TRITON`)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402

from ditserve.kernels._hopper import SMEM_LIMIT  # noqa: E402

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


class _Warmup:
    """`kernel[grid](...)` as `kernel.warmup(...)`: the compiled kernel into out[name], no launch."""

    def __init__(self, name, kernel, out):
        self.name, self.kernel, self.out = name, kernel, out

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.out[self.name] = self.kernel.warmup(*args, grid=grid, **kwargs)

        return run


def _compile(kernel: str, cfg: dict, rank: int) -> dict:
    """In a fresh process: the launcher's `kernel[grid](...)` becomes `kernel.warmup(...)` against an sm_90
    target (no launch); what the compiled kernel holds. A fresh process because Triton's interpreter, which the
    CPU tests run kernels in, leaves the language's builtins patched after a kernel calls a jit helper, and a
    compile after that fails."""
    from triton.runtime import driver

    from ditserve.kernels.lora_expand import gluon_kernel as expand_kernel
    from ditserve.kernels.lora_expand import gluon_op as expand_op
    from ditserve.kernels.lora_gemm import gluon_kernel, gluon_op
    from ditserve.kernels.lora_shrink import gluon_kernel as shrink_kernel
    from ditserve.kernels.lora_shrink import gluon_op as shrink_op

    driver.set_active(_Hopper())
    out: dict[str, object] = {}
    for module, name in (
        (gluon_kernel, "_gluon_lora_gemm_kernel"),
        (gluon_kernel, "_gluon_lora_linear_kernel"),
        (shrink_kernel, "_gluon_lora_shrink_kernel"),
        (expand_kernel, "_gluon_lora_expand_kernel"),
    ):
        fn = getattr(module, name)
        setattr(module, name, _Warmup(name, fn.kernel if isinstance(fn, _Warmup) else fn, out))
    config = {**gluon_op.GLUON_CONFIG, **cfg}
    if kernel == "shrink":
        # 20 row blocks of 64 on the 4 programs of a CPU device: 5 consecutive ones each
        x, _, a, _, token_seg, seg_slot, seg_scale, slot_rank = _batch(1280, cfg["slices"], rank)
        scaled = cfg["scaled"]
        s = torch.zeros(cfg["slices"], x.shape[0], -(-rank // 16) * 16 if scaled else rank,
                        dtype=torch.bfloat16 if scaled else torch.float32)  # fmt: skip
        shrink_cfg = {**shrink_op.GLUON_SHRINK_CONFIG, **cfg.get("shrink", {})}
        seg_start = torch.arange(4, dtype=torch.int32) * (x.shape[0] // 4)
        seg_len = torch.full((4,), x.shape[0] // 4, dtype=torch.int32)
        seg = (token_seg, seg_start, seg_len, seg_slot, seg_scale if scaled else None, slot_rank)
        shrink_op.launch_gluon_lora_shrink(x, a, s, *seg, shrink_cfg)
        compiled = out["_gluon_lora_shrink_kernel"]
    elif kernel == "expand":
        # 12 row blocks of 128 × 144 column blocks of 64 in equal spans on the 4 programs of a CPU device
        sizes = SIZES if cfg["slices"] == 3 else [*SIZES, 4 * HIDDEN]
        x, _, _, _, token_seg, seg_slot, seg_scale, slot_rank = _batch(1536, 3, rank)
        y = torch.zeros(x.shape[0], sum(sizes), dtype=torch.bfloat16)
        b = torch.zeros(4, sum(sizes), rank, dtype=torch.bfloat16)
        s = torch.zeros(len(sizes), x.shape[0], rank)
        expand_cfg = {**expand_op.GLUON_EXPAND_CONFIG, **cfg.get("expand", {})}
        expand_op.launch_gluon_lora_expand(
            y, s, b, token_seg, seg_slot, seg_scale, slot_rank, sizes, expand_cfg
        )
        compiled = out["_gluon_lora_expand_kernel"]
    elif kernel == "linear":
        x, w, a, b, token_seg, seg_slot, seg_scale, slot_rank = _batch(1024, 3, rank)
        gluon_op.launch_gluon_lora_linear(
            x, w, None, a, b, token_seg, seg_slot, seg_scale, slot_rank, rank, SIZES, config
        )
        compiled = out["_gluon_lora_linear_kernel"]
    else:
        x, w, _, b, token_seg, seg_slot, _, _ = _batch(2304, 3, rank)
        s = torch.zeros(3, x.shape[0], rank, dtype=torch.bfloat16)
        gluon_op.launch_gluon_lora_gemm(x, w, None, s, b, token_seg, seg_slot, SIZES, config)
        compiled = out["_gluon_lora_gemm_kernel"]
    ptx = compiled.asm["ptx"]
    return dict(
        sm_90a=".target sm_90a" in ptx,
        wgmma="wgmma.mma_async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
        shared=compiled.metadata.shared,
        limit=SMEM_LIMIT,
    )


@pytest.fixture(scope="module")
def compile_in_child():
    """`_compile` in one spawned process for the module's tests."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda *args: pool.submit(_compile, *args).result(timeout=600)


def _assert_hopper_kernel(info: dict):
    assert info["sm_90a"] and info["wgmma"] and info["tma"]
    assert info["shared"] <= info["limit"]


@pytest.mark.parametrize(
    "cfg",
    [
        {"FOLD": 0},  # units spread over the run (some in halves), y in chunks, the LoRA MMA as a ring step
        {"FOLD": 0, "EPI_SPLIT": 1, "EPI_BUFS": 1},  # y whole
        {"SPREAD": 0, "FOLD": 0},  # the units first
        {"FOLD": 0, "UNIT_HALVES": 0},  # whole units only
    ],
)
def test_one_launch_compiles_for_hopper(compile_in_child, cfg):
    _assert_hopper_kernel(compile_in_child("linear", cfg, 16))


@pytest.mark.parametrize("rank,defer", [(16, 1), (64, 1), (16, 0)])
def test_gemm_compiles_for_hopper(compile_in_child, rank, defer):
    """The GEMM on a given s with its LoRA steps in the ring, the last round cut along K (18 row blocks × 36
    column blocks leave a partial round on the 4 programs of a CPU device); a tile's second half of y stored
    while the next tile's first MMA runs (DEFER, the default) or at its end."""
    _assert_hopper_kernel(compile_in_child("gemm", {"FOLD": 0, "DEFER": defer}, rank))


@pytest.mark.parametrize(
    "slices,rank,scaled,shrink",
    [
        (3, 64, 1, {}),
        (3, 16, 0, {}),
        (4, 64, 1, {}),
        (2, 128, 1, {}),
        (1, 32, 1, {}),
        (4, 16, 0, {"BLOCK_M": 128, "num_warps": 8}),
        (3, 16, 1, {"BLOCK_K": 128}),
        (4, 32, 0, {"WG": 3}),
        (3, 64, 1, {"WG": 3}),
        (3, 32, 0, {"WG": 2}),
        (4, 32, 1, {"WG": 3, "BLOCK_K": 32}),
    ],
)
def test_shrink_compiles_for_hopper(compile_in_child, slices, rank, scaled, shrink):
    """The Gluon shrink: a few row blocks per program, two MMAs a step for 3 slices, one or two MMA warpgroups,
    2-3 MMA partitions (WG), 64- and 128-wide K steps, the bf16 scaled and the fp32 s; its ring fills shared
    memory up to the limit (as many slots as fit)."""
    cfg = {"slices": slices, "scaled": scaled, "shrink": shrink}
    _assert_hopper_kernel(compile_in_child("shrink", cfg, rank))


@pytest.mark.parametrize(
    "slices,rank,expand",
    [
        (3, 16, {}),
        (4, 128, {}),
        (3, 64, {"LAG": 1}),
        (3, 128, {"BLOCK_N": 128, "LAG": 1}),
        (4, 32, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}),
        (3, 128, {"WG": 2, "num_warps": 4, "LAG": 0}),
        (4, 64, {"WG": 2, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "LAG": 1}),
    ],
)
def test_expand_compiles_for_hopper(compile_in_child, slices, rank, expand):
    """The Gluon in-place expand: 3 and 4 output slices, ranks 16-128, 64- and 128-row tiles, 64- and 128-wide
    column blocks, none to two TMA stores in flight, one or two compute partitions (WG; a partition of one
    warpgroup covering 128 rows); its ring fills shared memory up to the limit."""
    _assert_hopper_kernel(compile_in_child("expand", {"slices": slices, "expand": expand}, rank))
