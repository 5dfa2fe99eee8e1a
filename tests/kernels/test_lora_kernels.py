"""LoRA shrink/expand kernels (segmented and chunked SGMV) against their torch references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ditserve.kernels._dispatch import tma_ok
from ditserve.kernels.lora import LoRABatchMeta, apply_lora, choose_chunk_size, lora_linear, lora_shrink
from ditserve.kernels.lora_expand.op import launch_lora_expand, wave_chunk
from ditserve.kernels.lora_expand.reference import lora_expand_ref
from ditserve.kernels.lora_expand_sgmv.op import launch_lora_expand_sgmv
from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref
from ditserve.kernels.lora_shrink.op import launch_lora_shrink
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref
from ditserve.kernels.lora_shrink_sgmv.op import launch_lora_shrink_sgmv
from ditserve.kernels.lora_shrink_sgmv.reference import lora_shrink_sgmv_ref
from ditserve.kernels.policy import KernelPolicy
from tests.kernels.lora_cases import dense_oracle, layouts, make_case

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
dtypes = st.sampled_from([torch.float32, torch.float16])
hiddens = st.sampled_from([32, 48, 96])
# small tiles make segments straddle tile edges; None = the launcher's own config
shrink_cfgs = st.sampled_from([None, dict(BLOCK_M=16, BLOCK_K=16, num_warps=4, num_stages=1)])
expand_cfgs = st.sampled_from([None, dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)])
# the row-stationary kernel (y += delta): chunks of 1-3 column blocks, a chunk cut short at a slice's end
rows_cfgs = st.sampled_from(
    [
        dict(ROWS=1, BLOCK_M=16, BLOCK_N=16, CHUNK=1, STAGES=1, num_warps=4),
        dict(ROWS=1, BLOCK_M=16, BLOCK_N=16, CHUNK=3, STAGES=2, num_warps=4),
        dict(ROWS=1, BLOCK_M=32, BLOCK_N=16, CHUNK=2, STAGES=3, num_warps=4),
        dict(ROWS=1, BLOCK_M=16, BLOCK_N=16, CHUNK=3, STAGES=2, B_TMA=1, num_warps=4),
    ]
)
# the SGMV shrink: every slice in one program, or one program per (chunk, slice) (SPLIT)
sgmv_shrink_cfgs = st.sampled_from(
    [
        None,
        dict(BLOCK_M=16, BLOCK_K=16, num_warps=4, num_stages=1),
        dict(BLOCK_M=16, BLOCK_K=16, num_warps=4, num_stages=2, SPLIT=1),
        dict(BLOCK_M=32, BLOCK_K=32, num_warps=4, num_stages=1, SPLIT=1),
    ]
)
# the SGMV expand: its column-stationary default and the row-stationary walk over gathered rows (chunks of 1-3
# column blocks, B through TMA or pointers; BLOCK_M 32 under chunks of 16 is capped at the chunk)
sgmv_expand_cfgs = st.one_of(
    expand_cfgs,
    st.sampled_from(
        [
            dict(ROWS=1, BLOCK_M=16, BLOCK_N=16, CHUNK=1, STAGES=1, num_warps=4),
            dict(ROWS=1, BLOCK_M=32, BLOCK_N=16, CHUNK=3, STAGES=2, num_warps=4),
            dict(ROWS=1, BLOCK_M=16, BLOCK_N=16, CHUNK=2, STAGES=2, B_TMA=1, num_warps=4),
        ]
    ),
)


@st.composite
def out_slices(draw):
    """1..4 output slices of unequal, odd sizes (a column block never straddles two)."""
    return draw(st.lists(st.sampled_from([8, 16, 24, 40, 17, 70]), min_size=1, max_size=4))


def shrink_args(c):
    m = c.meta
    return c.x, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank


# --- metadata ---------------------------------------------------------------------------------------


@SETTINGS
@given(layouts(max_requests=10), st.sampled_from([None, 16, 32]))
def test_meta_build_is_consistent(layout, chunk_size):
    requests, ranks, scales = layout
    m = LoRABatchMeta.build(requests, ranks, scales, chunk_size=chunk_size)
    assert m.num_tokens == sum(n for n, _ in requests) == m.token_seg.shape[0]
    assert sorted(m.sorted_token_ids.tolist()) == list(range(m.num_tokens))
    active = [s if s >= 0 and ranks[s] > 0 and n > 0 else -1 for n, s in requests]
    assert m.seg_slot.tolist() == active
    assert m.max_rank == max((ranks[s] for s in active if s >= 0), default=0)
    seg_of = m.token_seg.tolist()
    ids = m.sorted_token_ids.tolist()
    covered = []
    for slot, start, n in zip(
        m.chunk_slot.tolist(), m.chunk_start.tolist(), m.chunk_len.tolist(), strict=True
    ):
        assert 1 <= n <= m.chunk_size
        toks = ids[start : start + n]
        assert all(active[seg_of[t]] == slot for t in toks), "a chunk mixes slots"
        covered += toks
    assert sorted(covered) == list(range(m.num_tokens))
    assert m.token_scale.tolist() == [float(scales[seg_of[t]]) for t in range(m.num_tokens)]


def test_meta_build_rejects_bad_input():
    with pytest.raises(ValueError, match="slot 4"):
        LoRABatchMeta.build([(3, 4)], [8, 8, 8, 8])
    with pytest.raises(ValueError, match="num_tokens=-1"):
        LoRABatchMeta.build([(-1, 0)], [8])
    with pytest.raises(ValueError, match="rank 256"):
        LoRABatchMeta.build([(3, 0)], [256])
    with pytest.raises(ValueError, match="scales"):
        LoRABatchMeta.build([(3, 0)], [8], scales=[1.0, 2.0])


def test_chunk_size_policy():
    # few tokens: chunks of the kernels' 64-row tiles; many: the largest chunk that still gives every SM two
    assert choose_chunk_size([100], num_sms=132) == 64  # never below the kernels' 64-row tiles
    assert choose_chunk_size([4608], num_sms=132) == 64
    assert choose_chunk_size([4608] * 4, num_sms=132) == 64
    assert choose_chunk_size([4608, 1024, 4608, 256], num_sms=132) == 64
    assert choose_chunk_size([9 * 4608], num_sms=132) == 128  # 324 chunks of 128: two per SM and more
    assert choose_chunk_size([200_000], num_sms=132) == 256
    assert choose_chunk_size([], num_sms=132) == 64


# --- references against a token-by-token oracle ----------------------------------------------------


@SETTINGS
@given(layouts(), out_slices())
def test_references_match_dense_oracle(layout, sizes):
    c = make_case(layout, len(sizes), sizes, hidden=32, dtype=torch.float64)
    m = c.meta
    y = c.y.clone()
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    lora_expand_ref(y, s.double(), c.b, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank, sizes)
    torch.testing.assert_close(y, dense_oracle(c), atol=1e-5, rtol=1e-5)
    y = c.y.clone()
    ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len)
    s = lora_shrink_sgmv_ref(c.x, c.a, *ids, m.slot_rank, m.max_rank)
    lora_expand_sgmv_ref(
        y, s.double(), c.b, m.sorted_token_ids, m.token_scale.double(), *ids[1:], m.slot_rank, sizes
    )
    torch.testing.assert_close(y, dense_oracle(c), atol=1e-5, rtol=1e-5)


# --- Triton kernels (interpreter on CPU) against the references ------------------------------------


@SETTINGS
@given(layouts(), st.integers(1, 4), hiddens, dtypes, shrink_cfgs)
def test_shrink_matches_reference(layout, num_slices, hidden, dtype, cfg):
    c = make_case(layout, num_slices, [16] * num_slices, hidden, dtype)
    got = launch_lora_shrink(*shrink_args(c), config=cfg)
    m = c.meta
    want = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    assert got.shape == want.shape == (num_slices, m.num_tokens, m.max_rank)
    torch.testing.assert_close(got, want, **TOL[dtype])


@SETTINGS
@given(layouts(), out_slices(), hiddens, dtypes, expand_cfgs, st.sampled_from(["add", "write", "write+bias"]))
def test_expand_matches_reference(layout, sizes, hidden, dtype, cfg, mode):
    c = make_case(layout, len(sizes), sizes, hidden, dtype)
    m = c.meta
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    accumulate = mode == "add"
    bias = torch.randn(sum(sizes)).to(dtype) if mode == "write+bias" else None
    got, want = c.y.clone(), c.y.clone()
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    launch_lora_expand(got, s, c.b, m.token_seg, *seg, sizes, accumulate=accumulate, bias=bias, config=cfg)
    lora_expand_ref(want, s, c.b, *seg, sizes, accumulate=accumulate, bias=bias)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if accumulate:
        # rows without LoRA are bit-for-bit untouched
        no_lora = [m.seg_slot[t].item() < 0 for t in m.token_seg.tolist()]
        torch.testing.assert_close(got[no_lora], c.y[no_lora], atol=0, rtol=0)


def check_expand_in_place(c, cfg):
    """y += delta through launch_lora_expand(config=cfg) equals the reference; rows without LoRA are
    bit-for-bit untouched."""
    m, sizes = c.meta, c.sizes
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    ranks = m.slot_rank.tolist()
    for start, n, slot in zip(m.seg_start.tolist(), m.seg_len.tolist(), m.seg_slot.tolist(), strict=True):
        s[:, start : start + n, ranks[slot] if slot >= 0 else 0 :] = 7.0  # past a row's rank: never read
    got, want = c.y.clone(), c.y.clone()
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    launch_lora_expand(got, s, c.b, m.token_seg, *seg, sizes, config=cfg)
    lora_expand_ref(want, s, c.b, *seg, sizes)
    torch.testing.assert_close(got, want, **TOL[c.y.dtype])
    no_lora = [m.seg_slot[t].item() < 0 for t in m.token_seg.tolist()]
    torch.testing.assert_close(got[no_lora], c.y[no_lora], atol=0, rtol=0)


@SETTINGS
@given(layouts(), out_slices(), hiddens, dtypes, rows_cfgs)
def test_row_stationary_expand_matches_reference(layout, sizes, hidden, dtype, cfg):
    """y += delta by the kernel that keeps a token block's s and walks a chunk of column blocks: straddling
    segments, empty and 1-token requests, slot -1, rank 0, mixed ranks, 1-4 unequal slices; rows without
    LoRA bit-for-bit untouched."""
    check_expand_in_place(make_case(layout, len(sizes), sizes, hidden, dtype), cfg)


def test_expand_chunk_follows_the_rounds_of_programs():
    """The rank-128 expand tile fills an SM, so its programs run in rounds of one per SM: QKV on 4 × 4608
    tokens (144 row blocks, 3 slices of 24 column blocks) takes 7 rounds of 12 blocks rather than 4 of 24;
    one request, or 4 slices, keep whole slices; a batch that fits one round spreads over more SMs. The rank-64
    tile (two per SM) takes whole slices only where they all run at once: one request of 4608 tokens."""
    assert wave_chunk([24] * 3, 144, (24, 12), 1, 132) == 12
    assert wave_chunk([24, 24, 24, 96], 144, (24, 12), 1, 132) == 24
    assert wave_chunk([24] * 3, 36, (24, 12), 1, 132) == 24
    assert wave_chunk([24] * 3, 16, (24, 12), 1, 132) == 12
    assert wave_chunk([24] * 3, 72, (8, 24), 2, 132) == 24
    assert wave_chunk([24, 24, 24, 96], 72, (8, 24), 2, 132) == 8
    assert wave_chunk([24] * 3, 288, (8, 24), 2, 132) == 8
    assert wave_chunk([24, 24, 24, 96], 288, (8, 24), 2, 132) == 8


@SETTINGS
@given(
    layouts(),
    st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=4),
    dtypes,
    st.sampled_from([(16, 1), (16, 3), (32, 2)]),
    st.booleans(),
)
def test_row_stationary_expand_through_tma(layout, sizes, dtype, tiles, s_early):
    """B tiles, and y tiles of row blocks inside one segment, through TMA descriptors (slices of whole
    column blocks, so y's TMA store never crosses a slice; straddling row blocks keep the pointer loop), s
    loaded by segment or (s_early) for every row before the segment metadata: the same result as the
    reference, rows without LoRA bit-for-bit untouched."""
    block_m, chunk = tiles
    c = make_case(layout, len(sizes), sizes, 32, dtype)
    assert tma_ok(c.y, c.b.flatten(0, 1))  # the TMA paths are the ones taken
    cfg = dict(ROWS=1, BLOCK_M=block_m, BLOCK_N=16, CHUNK=chunk, STAGES=2, B_TMA=1, Y_TMA=1, num_warps=4)
    check_expand_in_place(c, {**cfg, "S_EARLY": int(s_early)})


def test_gluon_expand_config_reaches_its_launch_or_falls_back(monkeypatch):
    """A GLUON=1 expand config runs the Gluon kernel with that config and the batch's segment alignment
    where its contract holds (checked here with the contract and the launcher replaced: the kernel needs a
    Hopper GPU), and off Hopper (here) the Triton kernel's tiles, with the reference's result."""
    from ditserve.kernels.lora_expand import gluon_op

    cfg = dict(GLUON=1, BLOCK_M=64, BLOCK_N=16, STAGES=0, LAG=2, num_warps=4)
    c = make_case(([(64, 1), (64, -1), (64, 0)], [16, 32, 0, 8], None), 2, [16, 32], 32, torch.float32)
    check_expand_in_place(c, cfg)  # the fallback
    m = c.meta
    seen = []
    monkeypatch.setattr(gluon_op, "gluon_expand_ok", lambda *a: seen.append(a[4]) or True)
    monkeypatch.setattr(gluon_op, "launch_gluon_lora_expand", lambda *a: seen.append(a[-1]))
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    launch_lora_expand(c.y.clone(), s, c.b, m.token_seg, *seg, c.sizes, config=cfg, seg_align=m.seg_align)
    assert seen == [64, {k: v for k, v in cfg.items() if k != "GLUON"}]


@pytest.mark.parametrize(
    "num_slices,rank,gluon", [(3, 128, True), (3, 100, True), (4, 128, False), (3, 64, False)]
)
def test_default_expand_takes_gluon_where_measured_faster(monkeypatch, num_slices, rank, gluon):
    """Without a config the expand takes the Gluon kernel (its tuned config) at 3 slices rank tile 128 where its
    contract holds (contract and launcher replaced here: the kernel needs a Hopper GPU), elsewhere the Triton
    kernel; and off Hopper (here, the real contract) or with the Gluon kernels turned off the Triton kernel at 3
    slices too."""
    from ditserve.kernels.lora_expand import gluon_op

    sizes = [16] * num_slices
    layout = ([(64, 1), (64, -1), (64, 0)], [rank, rank, 0, 8], None)
    c = make_case(layout, num_slices, sizes, 32, torch.float32, max_rank=128)
    m = c.meta
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    check_expand_in_place(c, None)  # the real contract: the Triton kernel, the reference's result
    seen = []
    monkeypatch.setattr(gluon_op, "gluon_expand_ok", lambda *a: True)
    monkeypatch.setattr(gluon_op, "launch_gluon_lora_expand", lambda *a: seen.append(a[-1]))
    launch_lora_expand(c.y.clone(), s, c.b, m.token_seg, *seg, c.sizes, seg_align=m.seg_align)
    tuned = dict(BLOCK_M=64, BLOCK_N=128, STAGES=0, LAG=0, num_warps=4, WG=2)  # tuned_nvidia_h200.json
    assert seen == ([tuned] if gluon else [])
    seen.clear()  # DITSERVE_GLUON_GEMM=0: the Triton kernel everywhere
    launch_lora_expand(c.y.clone(), s, c.b, m.token_seg, *seg, c.sizes, seg_align=m.seg_align,
                       policy=KernelPolicy(gluon=False))  # fmt: skip
    assert seen == []


@pytest.mark.parametrize("wg", [1, 2])
@pytest.mark.parametrize("bm,bn,rank_tile", [(128, 64, 128), (64, 128, 128), (64, 64, 16), (128, 128, 64)])
def test_gluon_expand_ring_fills_shared_memory_per_partition(wg, bm, bn, rank_tile):
    """The Gluon expand's ring: as many slots as fit beside every compute partition's scaled s, a multiple of
    the partitions (a slot always serves the same one), WG more would not fit (or MAX_STAGES)."""
    from ditserve.kernels._hopper import SMEM_LIMIT
    from ditserve.kernels.lora_expand.gluon_op import MAX_STAGES, expand_smem

    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, STAGES=0, LAG=0, num_warps=4, WG=wg)
    stages, smem = expand_smem(cfg, rank_tile)
    slot = (bm * bn + bn * rank_tile) * 2
    assert stages % wg == 0 and stages >= wg
    assert smem == stages * slot + wg * bm * rank_tile * 2 <= SMEM_LIMIT - 1024
    assert stages + wg > MAX_STAGES or smem + wg * slot > SMEM_LIMIT - 1024
    assert expand_smem({**cfg, "STAGES": 2}, rank_tile)[0] == 2  # a given depth is kept


@SETTINGS
@given(layouts(), st.integers(1, 4), hiddens, dtypes, st.sampled_from([16, 32, 64]), sgmv_shrink_cfgs)
def test_shrink_sgmv_matches_reference(layout, num_slices, hidden, dtype, chunk_size, cfg):
    c = make_case(layout, num_slices, [16] * num_slices, hidden, dtype, chunk_size=chunk_size)
    m = c.meta
    ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank, m.max_rank)
    got = launch_lora_shrink_sgmv(c.x, c.a, *ids, m.chunk_size, config=cfg)
    want = lora_shrink_sgmv_ref(c.x, c.a, *ids)
    torch.testing.assert_close(got, want, **TOL[dtype])


@SETTINGS
@given(layouts(), out_slices(), dtypes, st.sampled_from([16, 32, 64]), sgmv_expand_cfgs)
def test_expand_sgmv_matches_reference(layout, sizes, dtype, chunk_size, cfg):
    c = make_case(layout, len(sizes), sizes, 32, dtype, chunk_size=chunk_size)
    m = c.meta
    s = lora_shrink_ref(c.x, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    args = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    got, want = c.y.clone(), c.y.clone()
    launch_lora_expand_sgmv(got, s, c.b, *args, sizes, m.chunk_size, config=cfg)
    lora_expand_sgmv_ref(want, s, c.b, *args, sizes)
    torch.testing.assert_close(got, want, **TOL[dtype])


# --- public API ------------------------------------------------------------------------------------

SKEWED = (
    [(150, 0), (1, 1), (0, 2), (40, 0), (7, -1), (33, 3)],
    [16, 8, 0, 32],
    [1.0, 0.5, 2.0, 1.0, 1.0, -1.0],
)


@pytest.mark.parametrize("method", ["sgemm", "sgmv"])
@pytest.mark.parametrize("sizes", [[24], [24, 40, 17], [16, 16, 16, 48], [8, 16, 24, 8, 40]])
def test_apply_lora_matches_oracle(method, sizes):
    """Shrink + expand through the public API, including 5 slices (split into launches of ≤ 4)."""
    c = make_case(SKEWED, len(sizes), sizes, hidden=48, dtype=torch.float32)
    y = c.y.clone()
    apply_lora(y, c.x, c.a, c.b, c.meta, sizes, method=method)
    torch.testing.assert_close(y.double(), dense_oracle(c), atol=1e-4, rtol=1e-4)


def test_lora_linear_matches_oracle():
    sizes = [24, 40, 16]
    c = make_case(SKEWED, 3, sizes, hidden=48, dtype=torch.float32)
    w = torch.randn(sum(sizes), 48) / 7
    bias = torch.randn(sum(sizes))
    got = lora_linear(c.x, w, bias, c.a, c.b, c.meta, sizes)
    c.y = torch.nn.functional.linear(c.x, w, bias)
    torch.testing.assert_close(got.double(), dense_oracle(c), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["sgemm", "sgmv"])
def test_no_lora_leaves_output_untouched(method):
    c = make_case(([(20, -1), (5, 1), (0, 0)], [8, 0, 0, 0], None), 2, [16, 16], 32, torch.float32)
    assert not c.meta.has_lora
    y = c.y.clone()
    apply_lora(y, c.x, c.a, c.b, c.meta, [16, 16], method=method)
    assert torch.equal(y, c.y)
    assert lora_shrink(c.x, c.a, c.meta, method).shape == (2, 25, 0)


def test_torch_compile_traces_custom_ops():
    """fullgraph: dynamo sees the ops as opaque custom ops with fake impls (no graph break)."""
    sizes = [16, 24]
    c = make_case(SKEWED, 2, sizes, hidden=32, dtype=torch.float32)

    def layer(x, y, meta):
        y = y.clone()
        apply_lora(y, x, c.a, c.b, meta, sizes)
        apply_lora(y, x, c.a, c.b, meta, sizes, method="sgmv")
        return y

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    want = c.y.clone()
    apply_lora(want, c.x, c.a, c.b, c.meta, sizes)
    apply_lora(want, c.x, c.a, c.b, c.meta, sizes, method="sgmv")
    torch.testing.assert_close(compiled(c.x, c.y, c.meta), want)


def test_custom_op_contracts():
    """torch.library's own checks: schema, fake impl agrees with the real one, mutation declared."""
    c = make_case(SKEWED, 2, [16, 24], hidden=32, dtype=torch.float32)
    m = c.meta
    s = torch.ops.ditserve.lora_shrink(*shrink_args(c))
    torch.library.opcheck(torch.ops.ditserve.lora_shrink.default, shrink_args(c))
    scaled = torch.ops.ditserve.lora_shrink(*shrink_args(c), seg_scale=m.seg_scale)
    assert scaled.dtype == c.x.dtype and scaled.shape[2] == m.max_rank + -m.max_rank % 16
    torch.library.opcheck(torch.ops.ditserve.lora_shrink.default, shrink_args(c), {"seg_scale": m.seg_scale})
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    torch.library.opcheck(torch.ops.ditserve.lora_expand.default, (c.y.clone(), s, c.b, *seg, [16, 24]))
    ids = (
        m.sorted_token_ids,
        m.chunk_slot,
        m.chunk_start,
        m.chunk_len,
        m.slot_rank,
        m.max_rank,
        m.chunk_size,
    )
    torch.library.opcheck(torch.ops.ditserve.lora_shrink_sgmv.default, (c.x, c.a, *ids))
    args = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    torch.library.opcheck(
        torch.ops.ditserve.lora_expand_sgmv.default, (c.y.clone(), s, c.b, *args, [16, 24], m.chunk_size)
    )


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Without CUDA and without TRITON_INTERPRET (at import) the ops run the torch reference."""
    from ditserve.kernels import _dispatch

    sizes = [16, 24]
    c = make_case(SKEWED, 2, sizes, hidden=32, dtype=torch.float32)
    monkeypatch.setattr(_dispatch, "_INTERPRET_AT_IMPORT", False)
    assert not _dispatch.use_triton(c.x)
    y = c.y.clone()
    apply_lora(y, c.x, c.a, c.b, c.meta, sizes)
    torch.testing.assert_close(y.double(), dense_oracle(c), atol=1e-4, rtol=1e-4)


def test_zeroed_scratch_keeps_what_captured_graphs_hold():
    """Kernel scratch (stream-K sums and counts): zero when allocated, the same buffer for requests it holds,
    a new zeroed one for a larger request, and the old one kept alive, since a CUDA graph captured earlier
    still writes to its address on every replay."""
    import gc
    import weakref

    from ditserve.kernels._dispatch import zeroed_scratch

    dev = torch.device("cpu")
    first = zeroed_scratch("test scratch", dev, 100, torch.float32)
    assert first.numel() == 100 and not first.any()
    first[3] = 1.0  # a launch left something (a graph would not; this tells the buffers apart)
    assert zeroed_scratch("test scratch", dev, 60, torch.float32).data_ptr() == first.data_ptr()
    old = weakref.ref(first)
    ptr = first.data_ptr()
    del first
    bigger = zeroed_scratch("test scratch", dev, 1000, torch.float32)
    gc.collect()
    assert bigger.numel() == 1000 and not bigger.any() and bigger.data_ptr() != ptr
    assert old() is not None and old()[3] == 1.0
    assert zeroed_scratch("other scratch", dev, 10, torch.int32, min_numel=64).numel() == 64
