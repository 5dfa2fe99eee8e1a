"""Launcher, torch custom op and the entry point of the joint attention kernel (see kernel.py). Where the
kernel cannot run (off CUDA, a head_dim that is not a power of two, rows TMA cannot address) the entry point
runs diffusers' arithmetic (reference.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ditserve.kernels._configs import tables
from ditserve.kernels._dispatch import next_pow2, use_triton
from ditserve.kernels.joint_attention.reference import QNorm, joint_attention_ref

Config = tuple[int, ...]  # BLOCK_M, BLOCK_N, num_warps, num_stages[, warp-specialised loop (0 / 1)]
# A GPU or head_dim without a row of its own: the H100's fastest at head_dim 64 (0.910 ms for SD3.5 large's
# joint attention with CFG rows, against 0.955 ms for cuDNN's SDPA alone and 1.298 ms for diffusers' cat +
# SDPA + split; benchmarks/results/families_h100_80gb_hbm3_202612_0394064.md's run).
DEFAULT: Config = (64, 64, 4, 3)


def tuned_config(device: torch.device, head_dim: int) -> Config:
    """The tile for head_dim from this GPU's ``tuned_<gpu>.json`` (written by
    ``benchmarks/probes/step_floor.py --only sd3 --tuned``: the fastest of a sweep at SD3.5's shapes)."""
    try:
        table = tables(Path(__file__).parent, device)
    except FileNotFoundError:  # no GPU's table yet
        table = {}
    row = table.get("configs", {}).get(str(head_dim))
    if row is None:
        return DEFAULT
    return row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"], int(row.get("WS", 0))


# Off CUDA the entry point runs the kernel under Triton's interpreter only where this is set (the kernel's own
# tests): a model's CPU run would spend minutes interpreting what the reference computes alike.
interpret_on_cpu = False


def _tma_rows(t: torch.Tensor) -> bool:
    """[batch, tokens, hidden] with unit column stride, 16-byte aligned base and strides (a TMA
    descriptor's needs)."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
        and (t.stride(1) * size) % 16 == 0
    )


def kernel_runs(tensors: tuple[torch.Tensor, ...], head_dim: int) -> bool:
    """Whether `launch_joint_attention` takes these: bf16/fp16 (fp32 under the interpreter), a power-of-two
    head_dim of 16-256, rows TMA can address, the same batch and hidden everywhere, tokens in both streams."""
    x = tensors[0]
    dtypes = (torch.bfloat16, torch.float16) if x.is_cuda else (torch.float32, torch.float16)
    return (
        (x.is_cuda or (interpret_on_cpu and use_triton(x)))
        and x.dtype in dtypes
        and 16 <= head_dim <= 256
        and head_dim == next_pow2(head_dim)
        and all(t.dim() == 3 and t.dtype == x.dtype and t.device == x.device for t in tensors)
        and all(t.shape[0] == x.shape[0] and t.shape[2] == x.shape[2] and t.shape[1] > 0 for t in tensors)
        and x.shape[2] % head_dim == 0
        and all(_tma_rows(t) for t in tensors)
    )


def launch_joint_attention(
    img: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    txt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    head_dim: int,
    config: Config | None = None,
    q_norms: tuple[QNorm, QNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditserve.kernels.joint_attention.kernel import _joint_attention_kernel

    batch, n_img, hidden = img[0].shape
    n_txt = txt[0].shape[1]
    heads = hidden // head_dim
    block_m, block_n, warps, stages, *ws = config or tuned_config(img[0].device, head_dim)
    o_img = img[0].new_empty(batch, n_img, hidden)
    o_txt = txt[0].new_empty(batch, n_txt, hidden)
    if o_img.numel() + o_txt.numel() == 0:
        return o_img, o_txt

    def desc(t: torch.Tensor, rows: int):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), t.stride(1), 1], [1, rows, head_dim])

    def stream(qkv, out):
        q, k, v = qkv
        return desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(out, block_m)

    if q_norms is None:  # unused pointers: the outputs (never read)
        (w_img, eps_img), (w_txt, eps_txt) = (o_img, 0.0), (o_txt, 0.0)
    else:
        (w_img, eps_img), (w_txt, eps_txt) = ((w.contiguous(), float(e)) for w, e in q_norms)
    grid = (math.ceil(n_img / block_m) + math.ceil(n_txt / block_m), batch * heads)
    _joint_attention_kernel[grid](
        *stream(img, o_img), *stream(txt, o_txt), n_img, n_txt, heads,
        head_dim**-0.5 * 1.4426950408889634, w_img, w_txt, eps_img, eps_txt,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NORM_Q=q_norms is not None,
        WS=bool(ws and ws[0]), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o_img, o_txt


@torch.library.custom_op("ditserve::joint_attention", mutates_args=())
def joint_attention_op(
    q_img: torch.Tensor,
    k_img: torch.Tensor,
    v_img: torch.Tensor,
    q_txt: torch.Tensor,
    k_txt: torch.Tensor,
    v_txt: torch.Tensor,
    head_dim: int,
    wq_img: torch.Tensor | None = None,
    wq_txt: torch.Tensor | None = None,
    eps_img: float = 0.0,
    eps_txt: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    img, txt = (q_img, k_img, v_img), (q_txt, k_txt, v_txt)
    q_norms = None if wq_img is None or wq_txt is None else ((wq_img, eps_img), (wq_txt, eps_txt))
    weights_fit = q_norms is None or all(
        w.shape == (head_dim,) and w.dtype == q_img.dtype and w.device == q_img.device for w, _ in q_norms
    )
    if weights_fit and kernel_runs((*img, *txt), head_dim):
        return launch_joint_attention(img, txt, head_dim, q_norms=q_norms)
    o_img, o_txt = joint_attention_ref(img, txt, head_dim, q_norms)
    return o_img.clone(memory_format=torch.contiguous_format), o_txt.clone(
        memory_format=torch.contiguous_format
    )


@joint_attention_op.register_fake
def _(q_img, k_img, v_img, q_txt, k_txt, v_txt, head_dim, wq_img=None, wq_txt=None, eps_img=0.0, eps_txt=0.0):
    return q_img.new_empty(q_img.shape), q_txt.new_empty(q_txt.shape)


def joint_attention(
    img: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    txt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    head_dim: int,
    q_norms: tuple[QNorm, QNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax([q_img; q_txt] · [k_img; k_txt]ᵀ / √head_dim) · [v_img; v_txt], split back into the two
    streams: img, txt are (q, k, v), each [batch, tokens, heads · head_dim] → (image out, text out),
    contiguous. ``q_norms``: each stream's per-head q RMSNorm (weight [head_dim], eps), applied to the queries
    as they load. On CUDA (or under the interpreter) one custom op, opaque to torch.compile, which runs the
    kernel where `kernel_runs` (strides and alignment are read there, on real tensors) and diffusers'
    arithmetic otherwise; elsewhere diffusers' arithmetic."""
    x = img[0]
    if not (x.is_cuda or (interpret_on_cpu and use_triton(x))):
        return joint_attention_ref(img, txt, head_dim, q_norms)
    if q_norms is None:
        return joint_attention_op(*img, *txt, head_dim)
    (w_img, eps_img), (w_txt, eps_txt) = q_norms
    return joint_attention_op(*img, *txt, head_dim, w_img, w_txt, float(eps_img), float(eps_txt))
