"""q/k preparation in fewer passes (``--fused-epilogues`` on one rank): Wan's RMSNorm + rotary kernel
(kernels/qk_norm_rope) against its reference, and the swapped attention processors of Wan, Qwen-Image and
Z-Image (their plans' one_rank_processor, swapped in by --fused-epilogues) against diffusers' own pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from ditserve.kernels.qk_norm_rope.op import head_qk_norm_rope, launch_qk_norm_rope, qk_norm_rope
from ditserve.kernels.qk_norm_rope.reference import qk_norm_rope_ref
from ditserve.replica.parallel.plan import fuse_one_rank_processors


@pytest.fixture(autouse=True, scope="module")
def _kernel_through_the_interpreter():
    """The entry points run the kernel here too (off CUDA they run it only when asked)."""
    import ditserve.kernels.qk_norm_rope.op as op

    op.interpret_on_cpu = True
    yield
    op.interpret_on_cpu = False


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def wan_tables(tokens: int, head_dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's layout: (1, tokens, 1, head_dim) fp32, each pair's angle repeated."""
    angles = torch.rand(tokens, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = angles.sin().repeat_interleave(2, dim=-1)
    return cos[None, :, None], sin[None, :, None]


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 9),
    st.sampled_from([(1, 8), (3, 8), (4, 16), (5, 16), (2, 4)]),
    st.sampled_from([torch.float32, torch.float16]),
    st.sampled_from([1e-6, 1e-5]),
    st.sampled_from(["wan", "per head", "per head, per batch row table"]),
)
def test_kernel_matches_reference(batch, tokens, heads_dim, dtype, eps, kind):
    """Every batch row turned by its token's angles (one table for the batch, or one per row), the norm over
    the row or over each head, hiddens that are not a power of two (masked heads), rows far from unit
    scale."""
    heads, head_dim = heads_dim
    g = torch.Generator().manual_seed(batch * 31 + tokens)
    x = (torch.randn(batch, tokens, heads * head_dim, generator=g) * 7).to(dtype)
    per_head = kind != "wan"
    weight = (torch.rand(head_dim if per_head else heads * head_dim, generator=g) + 0.5).to(dtype)
    rows = batch if kind.endswith("table") else 1
    cos, sin = (t.reshape(1, tokens, head_dim).repeat(rows, 1, 1) for t in wan_tables(tokens, head_dim))
    if kind.endswith("table"):
        cos, sin = cos * torch.linspace(0.5, 1, rows)[:, None, None], sin.flip(0)
    args = (x, weight, eps, cos, sin, per_head, per_head)
    got = launch_qk_norm_rope(*args).unflatten(-1, (heads, head_dim))
    torch.testing.assert_close(got, qk_norm_rope_ref(*args), **TOL[dtype])
    # rows read in place from a wider tensor (FLUX.2's fused projection output: q, k, v, then the MLP's)
    wide = torch.cat([torch.randn(batch, tokens, 5, generator=g).to(dtype), x, x], dim=-1)[
        ..., 5 : 5 + x.shape[-1]
    ]
    torch.testing.assert_close(launch_qk_norm_rope(wide, *args[1:]), got.flatten(-2), atol=0, rtol=0)


def test_equals_diffusers_wan_norm_and_rotary():
    """What diffusers' Wan processor computes for q: ``norm_q`` then its strided-store rotary."""
    torch.manual_seed(0)
    heads, head_dim, tokens = 3, 8, 10
    norm = nn.RMSNorm(heads * head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, tokens, heads * head_dim) * 3
    cos, sin = wan_tables(tokens, head_dim)
    with torch.no_grad():
        q = norm(x).unflatten(2, (heads, -1))
        want = torch.empty_like(q)
        x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[..., 0::2], sin[..., 1::2]
        want[..., 0::2] = x1 * c - x2 * s
        want[..., 1::2] = x1 * s + x2 * c
        got = qk_norm_rope(x, norm, cos, sin)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("table_rows", [0, 1, 2])
def test_equals_diffusers_per_head_norm_and_complex_rotary(dtype, table_rows):
    """What diffusers' Qwen-Image / Z-Image processors compute for q: the per-head ``RMSNorm`` (its
    roundings in half precision included), then the complex product with ``freqs_cis`` ([tokens, D/2], or
    [rows, tokens, D/2])."""
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    heads, head_dim, tokens = 3, 8, 10
    norm = RMSNorm(head_dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(2, tokens, heads, head_dim) * 3).to(dtype)
    shape = (tokens, head_dim // 2) if table_rows == 0 else (table_rows, tokens, head_dim // 2)
    freqs = torch.polar(torch.ones(shape), torch.rand(shape) * 6.3)
    with torch.no_grad():
        q = norm(x)
        f = freqs.unsqueeze(-2)  # over the heads
        want = torch.view_as_real(torch.view_as_complex(q.float().unflatten(-1, (-1, 2))) * f)
        got = head_qk_norm_rope(x, norm, freqs)
    torch.testing.assert_close(got, want.flatten(-2).to(dtype), **TOL[dtype])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def fuse_attention_prologues(transformer) -> int:
    """What apply_speed_switches does with --fused-epilogues, for the family's plan."""
    from ditserve.replica.families import get_family

    names = {
        "WanTransformer3DModel": "wan",
        "QwenImageTransformer2DModel": "qwenimage",
        "Flux2Transformer2DModel": "flux2",
    }
    plan = get_family(names.get(type(transformer).__name__, "zimage")).load("plan")
    return fuse_one_rank_processors(transformer, plan)


def _swapped_equals_diffusers(pipe, transformers, expected_swaps: int, **call) -> None:
    def run():
        out = pipe(generator=torch.Generator("cpu").manual_seed(0), output_type="np", **call)
        return out.frames[0] if hasattr(out, "frames") else out.images[0]

    want = run()
    swapped = sum(fuse_attention_prologues(t) for t in transformers)
    assert swapped == expected_swaps
    assert sum(fuse_attention_prologues(t) for t in transformers) == 0  # applying again changes nothing
    got = run()
    assert _psnr(got, want) >= 60, _psnr(got, want)


def test_wan22_swapped_processors_draw_what_diffusers_draws():
    """Both experts' self-attention processors swapped (cross-attention goes to diffusers' path inside);
    the frames equal diffusers' own, through the Triton kernel (the interpreter here)."""
    from tests.families.wan22 import build_tiny

    pipe = build_tiny("a14b")
    pipe.set_progress_bar_config(disable=True)
    experts = [pipe.transformer, pipe.transformer_2]
    attns = sum(2 * len(t.blocks) for t in experts)
    _swapped_equals_diffusers(
        pipe, experts, attns, prompt="a fox", num_frames=5, height=32, width=32, num_inference_steps=3
    )


def test_flux2_swapped_processors_draw_what_diffusers_draws():
    """FLUX.2's double-stream and single-stream processors (q/k read in place from the fused projection),
    through the Triton kernel (the interpreter here): the same image as diffusers' own processors."""
    from tests.families.flux2 import build_pipeline

    pipe = build_pipeline()
    t = pipe.transformer
    expected = len(t.transformer_blocks) + len(t.single_transformer_blocks)
    _swapped_equals_diffusers(
        pipe, [t], expected, prompt="a red fox", height=64, width=64, num_inference_steps=2
    )


@pytest.mark.parametrize("family", ["qwenimage", "zimage"])
def test_real_rotary_processors_draw_what_diffusers_draws(family):
    """Qwen-Image's joint and Z-Image's single-stream processors with the rotary product in real
    arithmetic: the same image as diffusers' complex products."""
    import importlib

    module = importlib.import_module(f"tests.families.{family}")
    pipe = module.build_pipeline()
    t = pipe.transformer
    if family == "qwenimage":
        expected = len(t.transformer_blocks)
        call = dict(negative_prompt="blurry", true_cfg_scale=2.0)
    else:
        expected = len(t.noise_refiner) + len(t.context_refiner) + len(t.layers)
        call = dict(guidance_scale=2.0, negative_prompt="blurry")
    _swapped_equals_diffusers(
        pipe, [t], expected, prompt="a red fox", height=64, width=64, num_inference_steps=2, **call
    )


def test_compiled_zimage_attention_has_no_complex_kernels():
    """The reason for the swap: compiled, diffusers' complex rotary leaves eager complex kernels in the
    graph's code; the swapped processor's norm and rotary are one kernel (here, the interpreter's)."""
    from torch._inductor.utils import run_and_get_code

    from tests.families.zimage import build_pipeline

    t = build_pipeline().transformer
    attn = t.layers[0].attention
    x = torch.randn(1, 12, t.config.dim)
    freqs = torch.polar(torch.ones(1, 12, t.config.dim // t.config.n_heads // 2), torch.randn(1, 12, 4))

    def code_of() -> str:
        torch._dynamo.reset()
        fn = torch.compile(lambda h, f: attn(h, freqs_cis=f))
        with torch.no_grad():
            _, code = run_and_get_code(fn, x, freqs)
        return "\n".join(code)

    assert "aten.view_as_complex" in code_of()  # q and k, out of inductor's kernels
    fuse_attention_prologues(t)
    assert "view_as_complex" not in code_of()
    torch._dynamo.reset()
