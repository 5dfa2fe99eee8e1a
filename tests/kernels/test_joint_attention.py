"""SD3's joint attention without the concatenation (kernels/joint_attention): the kernel against diffusers'
cat + SDPA on the streams as the projections leave them, and SD3's one-rank processor (swapped in by
--fused-epilogues) drawing what diffusers' own processors draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ditserve.kernels.joint_attention.op import joint_attention, kernel_runs
from ditserve.kernels.joint_attention.reference import joint_attention_ref, rms_norm_heads
from ditserve.replica.parallel.plan import fuse_one_rank_processors, unfuse_one_rank_processors


@pytest.fixture(autouse=True, scope="module")
def _kernel_through_the_interpreter():
    """The entry point runs the kernel here too (off CUDA it runs it only when asked)."""
    import ditserve.kernels.joint_attention.op as op

    op.interpret_on_cpu = True
    yield
    op.interpret_on_cpu = False


TOL = {torch.float32: dict(atol=3e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _streams(batch, tokens, heads, head_dim, dtype, fused, seed):
    """q, k, v of one stream: three tensors, or (fused) column slices of one [batch, tokens, 3 · hidden]
    output as a fused projection leaves them."""
    g = torch.Generator().manual_seed(seed)
    hidden = heads * head_dim
    if fused:
        return torch.randn(batch, tokens, 3 * hidden, generator=g).mul(2).to(dtype).split(hidden, dim=-1)
    return tuple(torch.randn(batch, tokens, hidden, generator=g).mul(2).to(dtype) for _ in range(3))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 32, 64]),
    n_img=st.integers(1, 150),
    n_txt=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    fused=st.booleans(),
    q_norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
# fp16 with the q norms: against fp32 queries (not rounded as the kernel and diffusers round them) one element
# was off by 3.8e-3
@example(
    batch=1, heads=3, head_dim=16, n_img=9, n_txt=53, dtype=torch.float16, fused=True, q_norm=True, seed=65536
)
def test_joint_attention_equals_concatenated_sdpa(
    batch, heads, head_dim, n_img, n_txt, dtype, fused, q_norm, seed
):
    """Any split of tokens between the streams (tiles straddling a stream's end, streams shorter than a
    tile), strided rows, with or without each stream's q RMSNorm on load: both outputs equal SDPA over the
    concatenation (of the normalised queries), split back."""
    img = _streams(batch, n_img, heads, head_dim, dtype, fused, seed)
    txt = _streams(batch, n_txt, heads, head_dim, dtype, fused, seed + 1)
    assert kernel_runs((*img, *txt), head_dim)
    g = torch.Generator().manual_seed(seed + 2)
    norms = (
        tuple((torch.rand(head_dim, generator=g).add(0.5).to(dtype), eps) for eps in (1e-6, 1e-5))
        if q_norm
        else None
    )
    got_img, got_txt = joint_attention(img, txt, head_dim, norms)
    if (
        norms is not None
    ):  # the queries normalised in their dtype, as diffusers' norms (and the kernel) round them
        img = (rms_norm_heads(img[0], norms[0], head_dim), *img[1:])
        txt = (rms_norm_heads(txt[0], norms[1], head_dim), *txt[1:])
    want_img, want_txt = joint_attention_ref(
        tuple(t.float() for t in img), tuple(t.float() for t in txt), head_dim
    )
    assert got_img.is_contiguous() and got_txt.is_contiguous()
    torch.testing.assert_close(got_img.float(), want_img, **TOL[dtype])
    torch.testing.assert_close(got_txt.float(), want_txt, **TOL[dtype])


def test_what_the_kernel_cannot_take_runs_diffusers_arithmetic():
    """A head_dim that is not a power of two, or rows TMA cannot address (an odd row stride), run the
    reference: the same numbers, no error."""
    img = _streams(1, 9, 2, 24, torch.float32, False, 0)
    txt = _streams(1, 5, 2, 24, torch.float32, False, 1)
    assert not kernel_runs((*img, *txt), 24)
    got = joint_attention(img, txt, 24)
    want = joint_attention_ref(img, txt, 24)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    wide = torch.randn(1, 9, 2 * 16 + 1)
    odd = (wide[..., :32], wide[..., :32], wide[..., :32])  # rows 33 floats apart: not 16-byte aligned
    txt16 = _streams(1, 5, 2, 16, torch.float32, False, 2)
    assert not kernel_runs((*odd, *txt16), 16)
    for a, b in zip(joint_attention(odd, txt16, 16), joint_attention_ref(odd, txt16, 16), strict=True):
        torch.testing.assert_close(a, b)
    empty = _streams(1, 0, 2, 16, torch.float32, False, 3)  # a stream without tokens
    img16 = _streams(1, 9, 2, 16, torch.float32, False, 4)
    assert not kernel_runs((*img16, *empty), 16)
    got_img, got_txt = joint_attention(img16, empty, 16)
    torch.testing.assert_close(got_img, joint_attention_ref(img16, empty, 16)[0])
    assert got_txt.shape == (1, 0, 32)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def test_sd3_swapped_processors_draw_what_diffusers_draws():
    """SD3.5's joint-attention processors swapped for the one-rank fused one (the image-only ``attn2`` of
    a dual-attention block and the last, context_pre_only block included), head_dim 16 so the kernel runs
    (the interpreter here): the same image as diffusers' own processors, with CFG."""
    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    from ditserve.replica.families import get_family
    from tests.families.sd3 import TINY_TRANSFORMER, build_pipeline

    pipe = build_pipeline()
    torch.manual_seed(3)
    pipe.transformer = SD3Transformer2DModel(
        **{**TINY_TRANSFORMER, "attention_head_dim": 16, "num_attention_heads": 4}
    )
    t = pipe.transformer
    plan = get_family("sd3").load("plan")

    def run():
        out = pipe(
            prompt="a red fox", negative_prompt="blurry", guidance_scale=3.0, height=64, width=64,
            num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0), output_type="np",
        )  # fmt: skip
        return out.images[0]

    want = run()
    joint = [m for m in t.modules() if type(getattr(m, "processor", None)) is JointAttnProcessor2_0]
    assert len(joint) == len(t.transformer_blocks) + 1  # every block's attn, block 0's attn2
    assert fuse_one_rank_processors(t, plan) == len(joint)
    assert fuse_one_rank_processors(t, plan) == 0  # applying again changes nothing
    calls = []
    import ditserve.kernels.joint_attention.op as op

    launch = op.launch_joint_attention
    op.launch_joint_attention = lambda *a, **k: calls.append(1) or launch(*a, **k)
    try:
        got = run()
    finally:
        op.launch_joint_attention = launch
    assert len(calls) == 2 * len(t.transformer_blocks)  # each block's joint attn, 2 steps (CFG one batch)
    assert _psnr(got, want) >= 60, _psnr(got, want)
    # the benchmarks' rows with diffusers' processors put them back, each of them
    assert unfuse_one_rank_processors(t, plan) == len(joint)
    assert [type(m.processor) for m in joint] == [JointAttnProcessor2_0] * len(joint)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch, heads, head_dim, n_img, n_txt, fused",
    [(2, 4, 64, 1000, 77, True), (1, 3, 64, 130, 333, False), (2, 2, 128, 300, 20, True)],
)
def test_on_the_gpu_the_kernel_equals_fp32_attention(batch, heads, head_dim, n_img, n_txt, fused, dtype):
    """The compiled kernel (TMA descriptors, the tuned tile) in bf16 / fp16 against fp32 attention over the
    concatenation of the same rounded inputs."""
    img = tuple(t.cuda() for t in _streams(batch, n_img, heads, head_dim, dtype, fused, 0))
    txt = tuple(t.cuda() for t in _streams(batch, n_txt, heads, head_dim, dtype, fused, 1))
    assert kernel_runs((*img, *txt), head_dim)
    got = joint_attention(img, txt, head_dim)
    want = joint_attention_ref(tuple(t.float() for t in img), tuple(t.float() for t in txt), head_dim)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=2e-2)


def test_compiled_callers_trace_it_whole():
    """Under torch.compile the kernel is one opaque op: its stride and alignment checks read real tensors
    inside it, so a compiled block around it needs no graph break (fullgraph) and still runs the kernel."""
    import ditserve.kernels.joint_attention.op as op

    img = _streams(1, 20, 2, 16, torch.float32, True, 0)
    txt = _streams(1, 7, 2, 16, torch.float32, False, 1)
    norms = ((torch.rand(16) + 0.5, 1e-6), (torch.rand(16) + 0.5, 1e-5))
    calls = []
    launch = op.launch_joint_attention
    op.launch_joint_attention = lambda *a, **k: calls.append(1) or launch(*a, **k)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda i, t: joint_attention(i, t, 16, norms), fullgraph=True)
        got = compiled(img, txt)
    finally:
        op.launch_joint_attention = launch
        torch._dynamo.reset()
    assert calls == [1]
    for g, w in zip(got, joint_attention_ref(img, txt, 16, norms), strict=True):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
