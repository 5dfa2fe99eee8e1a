"""bf16 on a real GPU at the real models' sizes: Wan 14B's q (40 × 128, norm over the row) and Qwen-Image's
(24 × 128, per-head norm, complex table), against the fp32 reference of the same bf16 inputs, and inside the
swapped processors against diffusers' own under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ditserve.kernels.qk_norm_rope.op import head_qk_norm_rope, launch_qk_norm_rope, qk_norm_rope
from ditserve.kernels.qk_norm_rope.reference import qk_norm_rope_ref

pytestmark = pytest.mark.gpu


def tables(tokens: int, head_dim: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, tokens, head_dim // 2, device="cuda") * 6.3
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


@pytest.mark.parametrize(
    "heads, per_head, rows", [(40, False, 1), (24, True, 1), (30, True, 2), (12, False, 1)]
)
def test_bf16_equals_the_reference_with_the_same_roundings(heads, per_head, rows):
    """bf16 (which the CPU interpreter does not round as the GPU does): equal to the torch reference that
    rounds where the kernel rounds, but for rare one-step flips, and within the rounding error of the exact
    fp32 result."""
    torch.manual_seed(0)
    tokens, head_dim = 1031, 128
    x = (torch.randn(rows, tokens, heads * head_dim, device="cuda") * 3).bfloat16()
    weight = (torch.rand(head_dim if per_head else heads * head_dim, device="cuda") + 0.5).bfloat16()
    cos, sin = tables(tokens, head_dim, rows)
    args = (weight, 1e-6, cos, sin, per_head, per_head)
    got = launch_qk_norm_rope(x, *args).float()
    same = qk_norm_rope_ref(x, *args).flatten(-2).float()
    exact = qk_norm_rope_ref(x.float(), weight.float(), 1e-6, cos, sin, per_head).flatten(-2)
    pair = exact.unflatten(-1, (-1, 2)).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 2).flatten(-2)
    # Equal but for a rare flip of a rounding (the kernel sums the squares in another order): one bf16 step
    # of the norm's output, which the rotation carries at the pair's magnitude (measured: 2e-5 of elements)
    diff = (got - same).abs()
    assert (diff <= torch.finfo(torch.bfloat16).eps * (same.abs() + pair)).all()
    assert (diff > 0).float().mean() < 1e-3
    # up to three roundings to 8 significant bits, mixed by the rotation of a pair's two channels
    assert ((got - exact).abs() <= 4 * 2**-8 * pair + 1e-6).all()


def test_swapped_wan_and_qwen_queries_equal_the_modules_compiled():
    """Wan's and Qwen-Image's q through the kernel equal the same modules and rotations compiled by inductor
    (which keeps the norm's output in fp32) to within a bf16 rounding."""
    torch.manual_seed(1)
    wan_norm = nn.RMSNorm(5120, eps=1e-6).cuda().bfloat16()
    x = (torch.randn(1, 2048, 5120, device="cuda") * 2).bfloat16()
    cos, sin = (t[:, :, None] for t in tables(2048, 128))
    from ditserve.kernels.qk_norm_rope.reference import rotate_complex, rotate_pairs

    with torch.no_grad():
        want = torch.compile(lambda x: rotate_pairs(wan_norm(x).unflatten(-1, (-1, 128)), cos, sin))(x)
        got = qk_norm_rope(x, wan_norm, cos, sin)
        torch.testing.assert_close(got, want, atol=0.07, rtol=0.02)

        from diffusers.models.normalization import RMSNorm

        norm = RMSNorm(128, eps=1e-6).cuda().bfloat16()
        q = (torch.randn(1, 4096, 24, 128, device="cuda") * 2).bfloat16()
        freqs = torch.polar(torch.ones(4096, 64, device="cuda"), torch.rand(4096, 64, device="cuda") * 6.3)
        want = torch.compile(lambda q: rotate_complex(norm(q), freqs))(q)
        torch.testing.assert_close(head_qk_norm_rope(q, norm, freqs), want, atol=0.07, rtol=0.02)
