"""What the families' attention processors share: q/k/v heads from a module's projections, attention of the
sharded image (or video) tokens beside the replicated text, and the two streams' output projections.

Tensors are in diffusers' layout (batch, seq, heads, head_dim). Heads are always read as ``-1`` from the
projections' outputs, so TP's local head count (a column-parallel projection's share) just works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb

from ditserve.kernels.qk_norm_rope.op import head_qk_norm_rope

from .attention import attention
from .hooks import ForwardState
from .mesh import ParallelMesh
from .sequence import SequenceLayout
from .sp_attention import sequence_parallel_attention
from .tp import RowParallelLinear, fused_row_parallel

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ParallelAttnProcessor:
    """A family processor's base: the mesh, and the forward state that the plan's hooks keep current."""

    def __init__(self, mesh: ParallelMesh, state: ForwardState) -> None:
        self.mesh = mesh
        self.state = state


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _norm(module: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if module is None else module(x)


def image_qkv(
    attn: nn.Module, hidden_states: torch.Tensor, freqs: torch.Tensor | None = None, norm_q: bool = True
) -> QKV:
    """The image stream's q, k, v: ``to_q/k/v`` split into heads, q and k through the module's per-head
    ``norm_q`` / ``norm_k`` where it has them; with a complex rotary table ``freqs`` (Qwen-Image's, Z-Image's)
    q and k are also turned, each norm and rotation one kernel pass where it runs (``kernels.qk_norm_rope``).
    ``norm_q=False`` (no ``freqs``): q as projected, for an attention kernel that normalises it on load."""
    head_dim = attn.inner_dim // attn.heads
    q, k = _heads(attn.to_q(hidden_states), head_dim), _heads(attn.to_k(hidden_states), head_dim)
    if freqs is None:
        q, k = (_norm(attn.norm_q, q) if norm_q else q), _norm(attn.norm_k, k)
    else:
        q, k = head_qk_norm_rope(q, attn.norm_q, freqs), head_qk_norm_rope(k, attn.norm_k, freqs)
    return q, k, _heads(attn.to_v(hidden_states), head_dim)


def text_qkv(
    attn: nn.Module,
    encoder_hidden_states: torch.Tensor,
    freqs: torch.Tensor | None = None,
    norm_q: bool = True,
) -> QKV:
    """The text stream's q, k, v of a dual-stream block: ``add_q/k/v_proj`` and ``norm_added_q/k`` (the rotary
    table ``freqs`` and ``norm_q`` as in `image_qkv`)."""
    head_dim = attn.inner_dim // attn.heads
    q = _heads(attn.add_q_proj(encoder_hidden_states), head_dim)
    k = _heads(attn.add_k_proj(encoder_hidden_states), head_dim)
    if freqs is None:
        q, k = (_norm(attn.norm_added_q, q) if norm_q else q), _norm(attn.norm_added_k, k)
    else:
        q = head_qk_norm_rope(q, attn.norm_added_q, freqs)
        k = head_qk_norm_rope(k, attn.norm_added_k, freqs)
    return q, k, _heads(attn.add_v_proj(encoder_hidden_states), head_dim)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' real rotary tables (cos, sin), built for these tokens, applied to q and k."""
    if rotary_emb is None:
        return q, k
    return (
        apply_rotary_emb(q, rotary_emb, sequence_dim=1),
        apply_rotary_emb(k, rotary_emb, sequence_dim=1),
    )


def plain_rms_norms(attn: nn.Module) -> bool:
    """q and k normalised by ``torch.nn.RMSNorm``s with weights (Wan's, over the whole hidden): what
    ``kernels.qk_norm_rope`` fuses with the rotary embedding. Not TP's ShardedRMSNorm."""
    return all(type(norm) is nn.RMSNorm and norm.weight is not None for norm in (attn.norm_q, attn.norm_k))


def text_image_attention(
    image: QKV, text: QKV, *, mesh: ParallelMesh, layout: SequenceLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint attention of this rank's image shard and the replicated text (attended once); returns (image
    out, text out), each flattened to (B, S, H·D) in the image queries' dtype."""
    img, out = sequence_parallel_attention(*image, mesh=mesh, layout=layout, text=text)
    assert out is not None
    dtype = image[0].dtype
    return img.flatten(2).to(dtype), out.flatten(2).to(dtype)


def split_text(qkv: QKV, num_text: int) -> tuple[QKV, QKV]:
    """[text; image] q, k, v → (image q, k, v; text q, k, v)."""
    image = tuple(x[:, num_text:] for x in qkv)
    text = tuple(x[:, :num_text] for x in qkv)
    return image, text  # type: ignore[return-value]


def joint_out(attn: nn.Module, img: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two streams' output projections: ``to_out`` (and its dropout, where it has one) for the image and
    ``to_add_out`` for the text; under TP one all-reduce serves both."""
    img, text = img.contiguous(), text.contiguous()
    out, add_out = attn.to_out[0], attn.to_add_out
    if isinstance(out, RowParallelLinear) and isinstance(add_out, RowParallelLinear):
        img, text = fused_row_parallel([out, add_out], [img, text])
    else:
        img, text = out(img), add_out(text)
    return (attn.to_out[1](img) if len(attn.to_out) > 1 else img), text


def stock_attention(
    processor: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, S, H, D) attention as a diffusers processor runs it (its attention backend and parallel config):
    (B, S, H·D) in q's dtype. For the families' one-rank processors, subclasses of diffusers' own."""
    out = dispatch_attention_fn(
        q,
        k,
        v,
        attn_mask=mask,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    return out.flatten(2, 3).to(q.dtype)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) attention with every key on this rank (a replicated context, or a single rank)."""
    out, _ = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), need_lse=False)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class RowGroup:
    """The rows of a batch whose text has one valid length."""

    length: int
    index: torch.Tensor | None  # None: every row of the batch

    @property
    def rows(self) -> torch.Tensor | slice:
        """An indexer of the group's rows, for writing its results back (``out[group.rows, :n] = ...``)."""
        return slice(None) if self.index is None else self.index

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is None else x.index_select(0, self.index)


def rows_by_length(lengths: list[int], device: torch.device) -> list[RowGroup]:
    """The rows grouped by valid text length, shortest first. Every rank holds the same lengths, so every
    rank makes one sequence-parallel call per group in the same order (the same collectives)."""
    groups = []
    for length in sorted(set(lengths)):
        rows = [i for i, n in enumerate(lengths) if n == length]
        index = None if len(rows) == len(lengths) else torch.tensor(rows, device=device)
        groups.append(RowGroup(length, index))
    return groups
