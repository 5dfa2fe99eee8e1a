"""The LoRA linear op (`lora_linear_op`): on batches whose segments start on row-block boundaries the shrink
runs inside the GEMM launch (SHRINK_IN), elsewhere as its own kernel first; both against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ditserve.kernels.lora_linear.op as linear_op
from ditserve.kernels._dispatch import num_programs_limit
from ditserve.kernels._hopper import SMEM_LIMIT, gluon_triton_ok
from ditserve.kernels.lora_gemm.op import gemm_config, shrink_in_ok
from ditserve.kernels.lora_linear.op import launch_lora_linear, lora_linear_op
from ditserve.kernels.lora_linear.reference import lora_linear_ref
from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref
from ditserve.kernels.policy import KernelPolicy
from tests.kernels.lora_cases import MAX_LORAS, gluon_launches, gpu_problem, layouts, make_case

GLUON = KernelPolicy(gluon=True)
TRITON = KernelPolicy(gluon=False)
ANY_ONE_LAUNCH = KernelPolicy(gluon=True, one_launch_rule=False)
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=2e-2)}


def _cfg(bm, bn, bk, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1, PERSISTENT=1, TMA=1, **kw)


# the interpreter runs 4 persistent programs: with most tile counts some of them get one tile more (their
# first tile starts before the shrink); flattened and plain tile loops, TMA and pointer stores of y
# shrink units of every slice at once (wide) or one slice each, of a whole row block or half of one
SHRINK_IN_CONFIGS = [
    _cfg(16, 16, 16),
    _cfg(16, 32, 16, FLATTEN=1, TMA_STORE=1, SHRINK_WIDE=0),
    _cfg(32, 16, 32, FLATTEN=1, GROUP_M=2, SHRINK_M=16),
    _cfg(32, 16, 16, SHRINK_M=16, SHRINK_K=32, SHRINK_WIDE=0, SHRINK_STAGES=1),
]


@st.composite
def aligned_layouts(draw):
    """Requests of whole 32-token row blocks (0 included), slot -1, rank 0, repeated and mixed ranks."""
    ranks = draw(st.lists(st.sampled_from([0, 1, 4, 8, 13, 16, 32]), min_size=MAX_LORAS, max_size=MAX_LORAS))
    requests = draw(
        st.lists(
            st.tuples(st.sampled_from([0, 32, 64, 96]), st.integers(-1, MAX_LORAS - 1)),
            min_size=1,
            max_size=5,
        )  # fmt: skip
    )
    scales = draw(
        st.lists(st.sampled_from([0.5, 1.0, -0.75]), min_size=len(requests), max_size=len(requests))
    )
    return requests, ranks, scales


def weights(c, dtype, with_bias, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = c.x.shape[1]
    w = (torch.randn(sum(c.sizes), hidden, generator=g) * hidden**-0.5).to(dtype)
    bias = torch.randn(sum(c.sizes), generator=g).to(dtype) if with_bias else None
    return w, bias


def run(c, w, bias, cfg=None):
    m = c.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    return launch_lora_linear(c.x, w, bias, c.a, c.b, *seg, m.max_rank, c.sizes, m.seg_align, config=cfg)


def expected(c, w, bias):
    """y from the reference with the output slices' A, s for every slice of c.a (the group's)."""
    m = c.meta
    y = lora_linear_ref(c.x, w, bias, c.a[: len(c.sizes)], c.b, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale,
                        m.slot_rank, m.max_rank, c.sizes)  # fmt: skip
    s = lora_shrink_scaled_ref(c.x, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank,
                               m.max_rank)  # fmt: skip
    return y, s


@pytest.fixture
def no_shrink_kernel(monkeypatch):
    """The shrink kernel must not run: SHRINK_IN computes s inside the GEMM launch."""

    def fail(*a, **k):
        raise AssertionError("the shrink kernel ran")

    monkeypatch.setattr(linear_op, "launch_lora_shrink", fail)


@SETTINGS
@given(aligned_layouts(), st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3), st.integers(0, 1),
       st.sampled_from([32, 48]), st.sampled_from([torch.float32, torch.float16]), st.booleans(),
       st.sampled_from(SHRINK_IN_CONFIGS))  # fmt: skip
def test_shrink_in_launch_matches_reference(layout, sizes, extra_slices, hidden, dtype, with_bias, cfg):
    """Aligned batches: one launch gives y = x · Wᵀ + bias + scale · (x · Aᵀ) · Bᵀ per request and s for every
    slice of A (a group may hold more slices than the output), zeros for rows without an adapter."""
    c = make_case(layout, len(sizes) + extra_slices, sizes, hidden, dtype)
    if not c.meta.has_lora or c.meta.num_tokens == 0:
        return
    w, bias = weights(c, dtype, with_bias)
    assert shrink_in_ok(c.x, w, c.a, c.b, c.meta.seg_align, cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_op, "launch_lora_shrink", lambda *a, **k: pytest.fail("the shrink kernel ran"))
        y, s = run(c, w, bias, cfg)
    want_y, want_s = expected(c, w, bias)
    torch.testing.assert_close(y, want_y, **TOL[dtype])
    torch.testing.assert_close(s, want_s, **TOL[dtype])


@SETTINGS
@given(layouts(), st.lists(st.sampled_from([8, 16, 40]), min_size=1, max_size=3), st.sampled_from([32, 40]),
       st.booleans())  # fmt: skip
def test_unaligned_batches_take_two_launches(layout, sizes, hidden, with_bias):
    """Segments that start inside a row block (any layout): the shrink kernel first, then lora_gemm; same
    results."""
    c = make_case(layout, len(sizes), sizes, hidden, torch.float32)
    if not c.meta.has_lora:
        return
    w, bias = weights(c, torch.float32, with_bias)
    y, s = run(c, w, bias, SHRINK_IN_CONFIGS[1])
    want_y, want_s = expected(c, w, bias)
    torch.testing.assert_close(y, want_y, **TOL[torch.float32])
    torch.testing.assert_close(s, want_s, **TOL[torch.float32])


def test_first_tiles_wait_for_their_shrink(no_shrink_kernel):
    """9 row blocks × 3 column blocks = 27 tiles on 4 programs: programs 0-2 get a tile more and run it before
    any shrink unit exists (row block 0, adapter 1); their LoRA terms must still be right, as must those of
    the other adapter's rows and the rows without one."""
    c = make_case(([(48, 1), (32, -1), (48, 3), (16, 1)], [0, 16, 0, 32], [1.0, 1.0, -0.5, 2.0]), 3,
                  [16, 16, 16], 32, torch.float32)  # fmt: skip
    w, _ = weights(c, torch.float32, False)
    assert c.meta.num_tokens // 16 * 3 % 4 == 3
    y, s = run(c, w, None, _cfg(16, 16, 16, GROUP_M=1))
    want_y, want_s = expected(c, w, None)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


def test_gluon_kernels_only_with_the_triton_they_were_tested_with():
    """The Gluon kernels run with the Triton versions in GLUON_TRITON (3.6, the one they were tested with on
    the GPU); Triton 3.9, whose Gluon refuses them, runs the Triton kernels."""

    assert gluon_triton_ok("3.6.0") and gluon_triton_ok("3.6.1+git1234")
    assert not gluon_triton_ok("3.9.0") and not gluon_triton_ok("3.10.0")


def test_gluon_units_due_early_where_tiles_wait_before_their_k_steps():
    """The one Gluon launch's spread units: due with their group (LEAD 0, the default) only where its tiles
    wait for s after their K steps (LATE); where they wait before them (no FOLD at rank > 16, or LATE off),
    at least a tile early, else every tile of a group would wait for its units; a negative lead is refused."""
    from ditserve.kernels.lora_gemm import gluon_op

    cfg = gluon_op.GLUON_CONFIG
    assert cfg["LATE"] and gluon_op.unit_lead(cfg, late=True) == cfg["LEAD"] == 0
    assert gluon_op.unit_lead(cfg, late=False) >= 1
    assert gluon_op.unit_lead({**cfg, "LATE": 0, "LEAD_NOT_LATE": 3}, late=False) == 3
    with pytest.raises(AssertionError, match="LEAD"):
        gluon_op.unit_lead({**cfg, "LEAD": -1}, late=True)


def test_gluon_split_tail_policy():
    """Where the Gluon GEMM cuts its last round of tiles along K (`tail_parts`): into as many pieces as the
    idle programs allow, each of at least 4 K steps; not where that round fills more than half the programs,
    where the tiles divide evenly, or where there are fewer tiles than programs."""
    from ditserve.kernels.lora_gemm import gluon_op

    assert gluon_op.tail_parts(5184, 132, 48) == 3  # QKV of 4 × 4608 tokens: 36 tiles in the last round
    assert gluon_op.tail_parts(2688, 132, 48) == 2  # 48 tiles
    assert gluon_op.tail_parts(5184, 132, 8) == 2  # hidden 512: pieces of 4 K steps at most 2
    assert gluon_op.tail_parts(1296, 132, 48) == 1  # 108 tiles: fills more than half the programs
    assert gluon_op.tail_parts(264, 132, 48) == 1 and gluon_op.tail_parts(100, 132, 48) == 1


def test_gluon_gemm_shared_memory_and_fold():
    """The Gluon GEMM's shared memory (ring, y's staging, FOLD's boxes) and where FOLD still fits: the default
    (3 slots, y in 4 chunks through 2 buffers) and y staged whole, both with FOLD; 4 slots with y in 2 chunks
    fit only without FOLD's boxes, so FOLD is dropped there (the LoRA step goes into the ring); with 4 chunks
    and one buffer it fits again."""
    from ditserve.kernels.lora_gemm import gluon_op

    cfg = gluon_op.GLUON_CONFIG
    assert gluon_op.gemm_smem(cfg, False) == 2 * (3 * 384 * 64 + 2 * 128 * 64)
    whole = {**cfg, "EPI_SPLIT": 1}
    assert gluon_op.gemm_smem(whole, False) == 2 * (3 * 384 * 64 + 128 * 256)
    assert gluon_op._fold(cfg, 1, 16, 3072) and gluon_op._fold(whole, 1, 16, 3072)
    four = {**cfg, "NUM_BUFFERS": 4, "EPI_SPLIT": 2, "EPI_BUFS": 1}
    assert gluon_op.gemm_smem(four, False) <= SMEM_LIMIT < gluon_op.gemm_smem(four, True)
    assert not gluon_op._fold(four, 1, 16, 3072)
    assert gluon_op._fold({**four, "EPI_SPLIT": 4}, 1, 16, 3072)
    assert not gluon_op._fold({**four, "EPI_SPLIT": 4, "EPI_BUFS": 2}, 1, 16, 3072)
    assert not gluon_op._fold(cfg, 1, 32, 3072) and not gluon_op._fold(cfg, 1, 16, 128)


def test_gluon_request_off_hopper_runs_the_triton_path(monkeypatch):
    """`KernelPolicy.gluon` (the default) where the Gluon kernels cannot run (here: not a CUDA tensor)
    takes the Triton path with the same results, and no Gluon launcher is called."""
    from ditserve.kernels.lora_gemm import gluon_op

    for name in ("launch_gluon_lora_linear", "launch_gluon_lora_gemm"):
        monkeypatch.setattr(gluon_op, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran"))
    c = make_case(([(32, 1), (32, -1), (32, 3)], [0, 16, 0, 32], [1.0, 1.0, -0.5]), 3, [16, 16, 16], 32,
                  torch.float32)  # fmt: skip
    w, bias = weights(c, torch.float32, True)
    m = c.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    y, s = launch_lora_linear(c.x, w, bias, c.a, c.b, *seg, m.max_rank, c.sizes, m.seg_align, policy=GLUON)
    want_y, want_s = expected(c, w, bias)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)


def test_custom_op_contract():
    c = make_case(([(16, 0), (32, 1)], [16, 8, 0, 0], [1.0, 0.5]), 3, [16, 24], 32, torch.float32)
    w, bias = weights(c, torch.float32, True)
    m = c.meta
    args = (c.x, w, bias, c.a, c.b, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank,
            m.max_rank, c.sizes, m.seg_align)  # fmt: skip
    torch.library.opcheck(lora_linear_op, args)


# --- GPU, bf16, Flux sizes ---------------------------------------------------------------------------

ALIGNED = [(4608, 0), (512, -1), (4608, 1), (4096, 3), (512, 1)]


def aligned_case(num_slices: int, groups: int):
    """The Flux-sized aligned batch with `groups` slices of A and the first `num_slices` output slices:
    (meta, x, a, b, w, bias, sizes, seg, want y, want s)."""
    meta, x, a, b, w, bias, sizes = gpu_problem(groups, ALIGNED)
    sizes = sizes[:num_slices]
    n = sum(sizes)
    w, bias, b = w[:n].contiguous(), bias[:n].contiguous(), b[:, :n].contiguous()
    m = meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    want = lora_linear_ref(x, w, bias, a[:num_slices], b, *seg[1:], m.max_rank, sizes)
    want_s = lora_shrink_scaled_ref(x, a, *seg, m.max_rank)
    return m, x, a, b, w, bias, sizes, seg, want, want_s


@pytest.mark.gpu
@pytest.mark.parametrize("num_slices,groups", [(3, 3), (4, 4), (1, 3)])
def test_bf16_gpu_shrink_in(num_slices, groups, no_shrink_kernel):
    """Flux-sized aligned batch (4608/512-token requests, one without LoRA, ranks 16/64/32): one launch, the
    tuned config, y and s equal the reference; three launches in a row (the sync buffer starts at zero each
    time); a q linear leading a q/k/v group (1 output slice, 3 slices of s)."""
    m, x, a, b, w, bias, sizes, seg, want, want_s = aligned_case(num_slices, groups)
    assert m.seg_align % 128 == 0 and shrink_in_ok(x, w, a, b, m.seg_align)
    for _ in range(3):
        y, s = launch_lora_linear(x, w, bias, a, b, *seg, m.max_rank, sizes, m.seg_align, policy=TRITON)
        torch.testing.assert_close(y.float(), want.float(), atol=5e-2, rtol=3e-2)
        torch.testing.assert_close(s.float(), want_s.float(), atol=2e-2, rtol=2e-2)
    assert gemm_config(m.num_tokens, sum(sizes))["TMA"]


@pytest.mark.gpu
@pytest.mark.parametrize("num_slices,groups", [(3, 3), (4, 4), (1, 3)])
@pytest.mark.parametrize(
    "mode",
    [
        "shrink in the launch",
        "spread",
        "spread, y in chunks",
        "units first",
        "shrink kernel first",
        "default",
    ],
)
def test_bf16_gpu_gluon_lora_linear(num_slices, groups, mode, monkeypatch):
    """The same batches through the Gluon kernels (Hopper): the shrink inside the launch (three launches in a
    row: the sync buffer starts at zero each time; at rank 64 its units run first), the same with the units
    spread over the run (SPREAD 2), with every unit first (SPREAD 0), or the shrink kernel first; y and s
    equal the reference. By default (units 3 × 64 columns wide, more than GLUON_ONE_LAUNCH_COLS) the shrink
    kernel and the Gluon GEMM run."""
    from ditserve.kernels.lora_gemm import gluon_op

    calls = gluon_launches(monkeypatch)
    shrink_in = mode not in ("shrink kernel first", "default")
    policy = KernelPolicy(shrink_in=mode != "shrink kernel first", one_launch_rule=mode == "default")
    if mode != "default":
        monkeypatch.setattr(linear_op, "GLUON_ONE_LAUNCH_COLS", 256)  # the one launch at rank 64 as well
    over = {
        "spread": dict(SPREAD=2),
        "spread, y in chunks": dict(SPREAD=2, EPI_SPLIT=4, EPI_BUFS=2),
        "units first": dict(SPREAD=0),
    }
    for key, value in over.get(mode, {}).items():
        monkeypatch.setitem(gluon_op.GLUON_CONFIG, key, value)
    m, x, a, b, w, bias, sizes, seg, want, want_s = aligned_case(num_slices, groups)
    runs = 3 if shrink_in else 1
    for _ in range(runs):
        y, s = launch_lora_linear(x, w, bias, a, b, *seg, m.max_rank, sizes, m.seg_align, policy=policy)
        torch.testing.assert_close(y.float(), want.float(), atol=5e-2, rtol=3e-2)
        torch.testing.assert_close(s.float(), want_s.float(), atol=2e-2, rtol=2e-2)
    assert calls == ["linear" if shrink_in else "gemm"] * runs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "requests,groups",
    [
        ([(4608, 0), (512, -1), (4608, 0), (4096, 0)], 3),
        ([(4608, 0), (512, -1), (4608, 0), (4096, 0)], 4),
        ([(512, -1), (256, -1)], 3),
    ],
)
@pytest.mark.parametrize("fold", [1, 0])
@pytest.mark.parametrize("epi", [(4, 2), (1, 1), (2, 1)])
@pytest.mark.parametrize("late", [0, 1])
def test_bf16_gpu_gluon_lora_linear_rank16(requests, groups, fold, epi, late, monkeypatch):
    """Rank 16 only (shrink units with two K steps per ring slot, spread over the run, 3 slices as MMAs of 2
    and 1 slices or 4 slices in one; the 16-wide LoRA MMA after the last K step (FOLD) or as a ring step; y
    stored whole or in 2 or 4 column chunks, the first tile kept in registers until its s is there), and a
    batch without any adapter (every unit writes zeros); also with the tiles waiting for s after their K
    steps and the units due with their group (LATE, LEAD 0): one Gluon launch, y and s equal the reference."""
    from ditserve.kernels.lora_gemm import gluon_op

    if late and epi == (2, 1):
        pytest.skip("LATE with y whole and in 4 chunks is enough")
    monkeypatch.setitem(gluon_op.GLUON_CONFIG, "LATE", late)
    monkeypatch.setitem(gluon_op.GLUON_CONFIG, "LEAD", 0 if late else 2)
    monkeypatch.setitem(gluon_op.GLUON_CONFIG, "FOLD", fold)
    monkeypatch.setitem(gluon_op.GLUON_CONFIG, "EPI_SPLIT", epi[0])
    monkeypatch.setitem(gluon_op.GLUON_CONFIG, "EPI_BUFS", epi[1])
    calls = gluon_launches(monkeypatch)
    meta, x, a, b, w, bias, sizes = gpu_problem(groups, requests)
    m = meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    max_rank = max(m.max_rank, 1)
    want = lora_linear_ref(x, w, bias, a, b, *seg[1:], max_rank, sizes)
    want_s = lora_shrink_scaled_ref(x, a, *seg, max_rank)
    # the one launch whatever `one_launch_pays` says
    y, s = launch_lora_linear(x, w, bias, a, b, *seg, max_rank, sizes, m.seg_align, policy=ANY_ONE_LAUNCH)
    torch.testing.assert_close(y.float(), want.float(), atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(s.float(), want_s.float(), atol=2e-2, rtol=2e-2)
    assert calls == ["linear"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "requests,split",
    [
        ([(4608, 0), (4608, 2), (4608, -1), (4608, 3)], True),  # 144 units, 96 short programs: 48 split
        ([(4608, 3)], True),  # 36 units, 24 short programs: 12 split
        ([(2048, 0), (128, 1), (6016, 2), (512, -1)], True),  # 68 units, 60 short programs: 8 split
        ([(4608, 2), (512, 1), (1024, -1), (4096, 3), (2048, 0)], False),  # 96 units, 108 short programs
    ],
)
@pytest.mark.parametrize("epi", [(4, 2), (1, 1)])
@pytest.mark.parametrize("defer", [1, 0])
def test_bf16_gpu_gluon_lora_linear_unit_halves(requests, split, epi, defer, monkeypatch):
    """UNIT_HALVES: where the shrink units outnumber the programs with one tile less (on an H200's 132), the
    units past whole rounds of them run as two halves of their K steps on two programs, the second half to
    finish adding the first's partial sums and storing s. Several rank-16 adapters, one of rank 13, one of rank
    0, rows without any: y and s equal the reference launch after launch (the partial sums' buffer is left
    zeroed), and the split units' halves were counted (or none split where the units are fewer); also with a
    tile's second half of y stored while the next tile's first MMA runs (DEFER, the default with y in 4 chunks)
    or at its end."""
    from ditserve.kernels.lora_gemm import gluon_op
    from tests.kernels import lora_cases

    if defer and epi != (4, 2):
        pytest.skip("DEFER stores y in 4 chunks")
    gluon_launches(monkeypatch)
    if num_programs_limit(torch.device("cuda")) != 132:
        pytest.skip("the layouts' split units are counted for the 132 programs of an H200")
    monkeypatch.setattr(lora_cases, "GPU_RANKS", [16, 0, 16, 13, 0])
    cfg = {**gluon_op.GLUON_CONFIG, "UNIT_HALVES": 1, "EPI_SPLIT": epi[0], "EPI_BUFS": epi[1], "DEFER": defer}
    m, x, a, b, w, bias, sizes = lora_cases.gpu_problem(3, requests)
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    want = lora_linear_ref(x, w, bias, a, b, *seg[1:], 16, sizes)
    want_s = lora_shrink_scaled_ref(x, a, *seg, 16)
    units = m.num_tokens // 128
    for _ in range(3):
        sync = torch.zeros(2 * units + 2, dtype=torch.int32, device="cuda")
        y, s = gluon_op.launch_gluon_lora_linear(
            x, w, bias, a, b, m.token_seg, m.seg_slot, m.seg_scale, m.slot_rank, 16, sizes, cfg, sync=sync
        )
        torch.testing.assert_close(y.float(), want.float(), atol=5e-2, rtol=3e-2)
        torch.testing.assert_close(s.float(), want_s.float(), atol=2e-2, rtol=2e-2)
        halves = sync[units + 2 :]
        assert set(halves.tolist()) == ({0, 2} if split else {0}) and (halves == 2).any() == split


@pytest.mark.parametrize(
    "tokens,hidden,sizes,one",
    [
        (4 * 4608, 3072, [3072] * 3, True),  # 144 row blocks, 96 programs with a tile less
        (4 * 4096, 3072, [3072] * 3, False),  # 128 row blocks, 12 such programs
        (4 * 4608, 3072, [3072] * 3 + [12288], True),  # the single blocks' q/k/v/mlp: 48
        (4 * 4096, 3072, [12288], True),  # the feed-forward's up projection: 60
        (4 * 512, 3072, [3072] * 3, True),  # text tokens: 16 row blocks
        (4 * 4608, 15360, [3072], False),  # the single blocks' proj_out: rows past 12288
        (132 * 128, 3072, [256], False),  # tiles fill the last round: no program has one tile less
    ],
)
def test_one_launch_pays(tokens, hidden, sizes, one):
    """Where the shrink runs inside the GEMM launch on an H200 (132 programs), FLUX.1-dev shapes at 1024²:
    not where its units far outnumber the programs with one tile less, nor over rows longer than 12288."""
    assert linear_op.one_launch_pays(tokens, hidden, sizes, 132) is one
