"""bf16 on a real GPU, Flux-sized: hidden 3072, QKV (3 × 3072) and single-block (3 × 3072 + 12288) outputs."""

from __future__ import annotations

import pytest
import torch

from ditserve.kernels.lora import LoRABatchMeta, apply_lora, lora_linear, lora_shrink
from ditserve.kernels.lora_expand import configs as expand_configs
from ditserve.kernels.lora_expand.op import launch_lora_expand
from ditserve.kernels.lora_expand.reference import lora_expand_ref
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref

pytestmark = pytest.mark.gpu

HIDDEN = 3072
# odd lengths, an empty and a 1-token request, no-LoRA, shared adapter, ranks 16..128 mixed
REQUESTS = [(1000, 0), (1, 1), (0, 2), (517, 3), (300, -1), (2000, 1), (129, 0)]
RANKS = [16, 64, 128, 32, 0]
SIZES = {3: [3072] * 3, 4: [3072, 3072, 3072, 12288]}


def problem(num_slices: int, seed: int = 0):
    meta = LoRABatchMeta.build(REQUESTS, RANKS, [0.5, 1.0, 2.0, 0.25, 1.0, 1.0, -1.0], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes = SIZES[num_slices]

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    x = rnd(meta.num_tokens, HIDDEN)
    a = rnd(num_slices, len(RANKS), 128, HIDDEN, std=HIDDEN**-0.5)
    b = rnd(len(RANKS), sum(sizes), 128, std=128**-0.5)
    y = rnd(meta.num_tokens, sum(sizes))
    return meta, x, a, b, y, sizes


def reference(meta, x, a, b, y, sizes):
    seg = (meta.seg_start, meta.seg_len, meta.seg_slot)
    s = lora_shrink_ref(x, a, *seg, meta.slot_rank, meta.max_rank)
    out = y.clone()
    lora_expand_ref(out, s, b, *seg, meta.seg_scale, meta.slot_rank, sizes)
    return s, out


@pytest.mark.parametrize("method", ["sgemm", "sgmv"])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_matches_reference(num_slices, method):
    meta, x, a, b, y, sizes = problem(num_slices)
    s_ref, y_ref = reference(meta, x, a, b, y, sizes)
    s = lora_shrink(x, a, meta, method)
    torch.testing.assert_close(s, s_ref, atol=2e-2, rtol=2e-2)
    got = y.clone()
    apply_lora(got, x, a, b, meta, sizes, method=method)
    # bf16 output: one rounding of y + delta, plus s·scale rounded to bf16 before the expand's dot
    torch.testing.assert_close(got.float(), y_ref.float(), atol=3e-2, rtol=2e-2)
    no_lora = slice(1518, 1818)  # the (300, -1) request
    assert torch.equal(got[no_lora], y[no_lora])


@pytest.mark.parametrize("name", ["rows 64x128 c8 s3 w4 B tma", "rows 128x128 c12 s3 w8 B tma"])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_sgmv_expand_rows_candidates(num_slices, name):
    """The SGMV expand's row-stationary candidates over gathered rows (a sweep candidate, not the default) on
    the mixed batch, chunk after chunk of one slot: equal to the reference, the request without LoRA left
    bit-for-bit untouched."""
    from ditserve.kernels.lora_expand_sgmv.op import SGMV_ROWS_SWEEP, launch_lora_expand_sgmv
    from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref

    meta, x, a, b, y, sizes = problem(num_slices)
    s, _ = reference(meta, x, a, b, y, sizes)
    ids = (meta.sorted_token_ids, meta.token_scale, meta.chunk_slot, meta.chunk_start, meta.chunk_len)
    got, want = y.clone(), y.clone()
    launch_lora_expand_sgmv(
        got, s, b, *ids, meta.slot_rank, sizes, meta.chunk_size, config=SGMV_ROWS_SWEEP[name]
    )
    lora_expand_sgmv_ref(want, s, b, *ids, meta.slot_rank, sizes)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    no_lora = slice(1518, 1818)  # the (300, -1) request
    assert torch.equal(got[no_lora], y[no_lora])


@pytest.mark.parametrize("name", ["split 64/64/4/4", "split 128/64/8/4"])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_sgmv_shrink_split_candidates(num_slices, name):
    """The SGMV shrink's program per (chunk, slice) (a sweep candidate, not the default) on the mixed batch:
    equal to the segmented reference, zeros for the request without LoRA."""
    from ditserve.kernels.lora_shrink_sgmv.op import SGMV_SHRINK_SWEEP, launch_lora_shrink_sgmv

    meta, x, a, b, y, sizes = problem(num_slices)
    s_ref, _ = reference(meta, x, a, b, y, sizes)
    ids = (meta.sorted_token_ids, meta.chunk_slot, meta.chunk_start, meta.chunk_len, meta.slot_rank)
    got = launch_lora_shrink_sgmv(x, a, *ids, meta.max_rank, meta.chunk_size, config=SGMV_SHRINK_SWEEP[name])
    torch.testing.assert_close(got, s_ref, atol=2e-2, rtol=2e-2)
    assert not got[:, 1518:1818].any()  # the (300, -1) request


@pytest.mark.parametrize("rank", [16, 32, 64, 128])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_expand_tiles_of_every_rank(num_slices, rank):
    """The in-place expand's default tiles for each rank tile (B and y through TMA; row blocks at request
    boundaries through pointers): odd request lengths, a request without LoRA left bit-for-bit untouched."""
    ranks = [rank, max(rank // 2, 1), rank, 0, rank]
    meta = LoRABatchMeta.build(REQUESTS, ranks, [0.5, 1.0, 2.0, 0.25, 1.0, 1.0, -1.0], device="cuda")
    sizes = SIZES[num_slices]
    g = torch.Generator(device="cuda").manual_seed(1)
    s = torch.randn(num_slices, meta.num_tokens, meta.max_rank, generator=g, device="cuda")
    b = (torch.randn(len(ranks), sum(sizes), rank, generator=g, device="cuda") * rank**-0.5).to(
        torch.bfloat16
    )
    y = torch.randn(meta.num_tokens, sum(sizes), generator=g, device="cuda").to(torch.bfloat16)
    seg = (meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale, meta.slot_rank)
    got, want = y.clone(), y.clone()
    launch_lora_expand(got, s, b, meta.token_seg, *seg, sizes)
    lora_expand_ref(want, s, b, *seg, sizes)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    no_lora = slice(1518, 1818)  # the (300, -1) request
    assert torch.equal(got[no_lora], y[no_lora])


def test_bf16_lora_linear_matches_reference():
    meta, x, a, b, _, sizes = problem(3)
    w = (torch.randn(sum(sizes), HIDDEN, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    bias = torch.randn(sum(sizes), device="cuda").to(torch.bfloat16)
    base = torch.nn.functional.linear(x, w, bias)
    _, want = reference(meta, x, a, b, base, sizes)
    got = lora_linear(x, w, bias, a, b, meta, sizes)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=3e-2)


def test_inductor_compiles_around_custom_ops():
    meta, x, a, b, y, sizes = problem(3)
    w = (torch.randn(sum(sizes), HIDDEN, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)

    def layer(x, meta):
        out = torch.nn.functional.linear(x * 2, w)
        apply_lora(out, x * 2, a, b, meta, sizes)
        return out.relu()

    got = torch.compile(layer, fullgraph=True)(x, meta)
    torch.testing.assert_close(got.float(), layer(x, meta).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("128x64 lag2", dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=2, num_warps=8)),
        ("128x64 lag1", dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=1, num_warps=8)),
        ("128x128 lag1", dict(GLUON=1, BLOCK_M=128, BLOCK_N=128, STAGES=0, LAG=1, num_warps=8)),
        ("64x128 lag2", dict(GLUON=1, BLOCK_M=64, BLOCK_N=128, STAGES=0, LAG=2, num_warps=4)),
        ("w2 128x64 lag0", dict(GLUON=1, BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=0, num_warps=4, WG=2)),
        ("w2 64x64 lag1", dict(GLUON=1, BLOCK_M=64, BLOCK_N=64, STAGES=0, LAG=1, num_warps=4, WG=2)),
    ],
)
@pytest.mark.parametrize("num_slices", [3, 4])
@pytest.mark.parametrize(
    "requests,ranks",
    [
        # 144 row blocks of 128 × 144 (or 336) column blocks of 64, in equal spans over the SMs
        ([(4608, 0), (4608, 1), (4608, 2), (4608, 3)], [128, 128, 128, 128]),
        # a request without an adapter (left bit-for-bit untouched), ranks 8 / 32 / 16 under a 32-wide tile
        # (s filled past each rank), a last row block past the final row
        ([(1024, 0), (512, -1), (1536, 1), (128, 2), (300, 0)], [8, 32, 16]),
        # one request at rank 16
        ([(4608, 0)], [16]),
    ],
)
def test_bf16_gluon_expand(requests, ranks, num_slices, name, cfg):
    """The Gluon in-place expand (Hopper, a sweep candidate) against the reference, launch after launch, on
    batches whose segments lie on its row blocks; it must take them (a test of the fallback it is not)."""
    from ditserve.kernels._hopper import gluon_available
    from ditserve.kernels.lora_expand import gluon_op

    if not gluon_available(torch.cuda.current_device()):
        pytest.skip("the Gluon kernels need a Hopper GPU (sm_90) and a Triton they were tested with")
    # the scales of the other tests (at 3.5, scale · s rounded to bf16 before the MMA put one element of 4 × 4608
    # × 21504 past the tolerance)
    scales = [0.5, 1.0, 2.0, 0.25, -1.0][: len(requests)]
    meta = LoRABatchMeta.build(requests, ranks, scales, device="cuda")
    sizes = SIZES[num_slices]
    g = torch.Generator(device="cuda").manual_seed(2)
    s = torch.randn(num_slices, meta.num_tokens, meta.max_rank, generator=g, device="cuda")
    b = (torch.randn(len(ranks), sum(sizes), 128, generator=g, device="cuda") * 128**-0.5).to(torch.bfloat16)
    y = torch.randn(meta.num_tokens, sum(sizes), generator=g, device="cuda").to(torch.bfloat16)
    seg = (meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale, meta.slot_rank)
    assert gluon_op.gluon_expand_ok(y, s, b, sizes, meta.seg_align, cfg)
    want = y.clone()
    lora_expand_ref(want, s, b, *seg, sizes)
    for _ in range(2):
        got = y.clone()
        launch_lora_expand(got, s, b, meta.token_seg, *seg, sizes, config=cfg, seg_align=meta.seg_align)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        for start, n, slot in zip(
            meta.seg_start.tolist(), meta.seg_len.tolist(), meta.seg_slot.tolist(), strict=True
        ):
            if slot < 0:
                assert torch.equal(got[start : start + n], y[start : start + n])


def test_bf16_default_expand_aligned_qkv_rank128_takes_gluon():
    """QKV at rank 128 on requests of 4608 tokens (Flux 1024²) and one without an adapter: `apply_lora`'s
    default expand is the Gluon kernel here (its contract holds) and equals the reference."""
    from ditserve.kernels._hopper import gluon_available
    from ditserve.kernels.lora_expand import gluon_op

    if not gluon_available(torch.cuda.current_device()):
        pytest.skip("the Gluon kernels need a Hopper GPU (sm_90) and a Triton they were tested with")
    requests = [(4608, 0), (4608, -1), (4608, 1), (4608, 2)]
    meta = LoRABatchMeta.build(requests, [128, 96, 128], [0.5, 1.0, 2.0, 0.25], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    sizes = SIZES[3]
    x = (torch.randn(meta.num_tokens, HIDDEN, generator=g, device="cuda")).to(torch.bfloat16)
    a = (torch.randn(3, 3, 128, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    b = (torch.randn(3, sum(sizes), 128, generator=g, device="cuda") * 128**-0.5).to(torch.bfloat16)
    y = torch.randn(meta.num_tokens, sum(sizes), generator=g, device="cuda").to(torch.bfloat16)
    s = lora_shrink(x, a, meta)
    cfg = expand_configs.choose(expand_configs.ExpandProblem(3, 128), y.device)
    assert cfg.pop("GLUON") == 1
    assert cfg is not None and gluon_op.gluon_expand_ok(y, s, b, sizes, meta.seg_align, cfg)
    seg = (meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale, meta.slot_rank)
    want = y.clone()
    lora_expand_ref(want, s, b, *seg, sizes)
    got = y.clone()
    apply_lora(got, x, a, b, meta, sizes)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(got[4608:9216], y[4608:9216])


@pytest.mark.parametrize("rank", [16, 32, 64])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_default_shrink_off_row_blocks_takes_gluon(num_slices, rank):
    """Requests of 4600 tokens (segments off every 64-row block), one without an adapter: the default shrink is
    the Gluon kernel's 64-row form here (pieces that end at segment ends) and equals the reference, fp32 s and
    bf16 scale · s, launch after launch."""
    from ditserve.kernels._hopper import gluon_available
    from ditserve.kernels.lora_shrink.configs import ShrinkProblem, gluon_choice
    from ditserve.kernels.lora_shrink.op import launch_lora_shrink
    from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref

    if not gluon_available(torch.cuda.current_device()):
        pytest.skip("the Gluon kernels need a Hopper GPU (sm_90) and a Triton they were tested with")
    requests = [(4600, 0), (4600, -1), (4600, 1), (4600, 2)]
    meta = LoRABatchMeta.build(requests, [rank, rank // 2, rank], [0.5, 1.0, 2.0, 0.25], device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gluon_choice(ShrinkProblem(num_slices, rank, meta.num_tokens, meta.seg_align), sms) is not None
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(meta.num_tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    a = (torch.randn(num_slices, 3, rank, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(
        torch.bfloat16
    )
    seg = (meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot)
    want32 = lora_shrink_ref(x, a, *seg[1:], meta.slot_rank, meta.max_rank)
    want = lora_shrink_scaled_ref(x, a, *seg, meta.seg_scale, meta.slot_rank, meta.max_rank)
    for _ in range(2):
        got32 = launch_lora_shrink(x, a, *seg, meta.slot_rank, meta.max_rank, seg_align=meta.seg_align)
        torch.testing.assert_close(got32, want32, atol=2e-2, rtol=2e-2)
        got = launch_lora_shrink(
            x, a, *seg, meta.slot_rank, meta.max_rank, seg_scale=meta.seg_scale, seg_align=meta.seg_align
        )
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert not got32[:, 4600:9200].any()  # the request without an adapter
