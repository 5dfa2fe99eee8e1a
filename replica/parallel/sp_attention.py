"""Sequence-parallel attention: Ulysses around ring / K/V-gather / local, with optional joint text.

Input is a rank's image (or video) tokens (B, S_local, H_local, D) in diffusers' layout and, for joint
attention (Flux), the text tokens (B, T, H_local, D) which every rank holds in full. Steps:

1. Ulysses all-to-all: sequence shards → one contiguous ring block, heads / U (text: take our heads).
2. Attention of [text; block] queries to [text; all blocks] keys: ring (P2P, LSE merge), K/V-gather
   (one all-gather) or local. Text keys are attended once; padding keys are sliced away.
3. Ulysses all-to-all back; the text result rides along so every rank gets all heads of it.
"""

from __future__ import annotations

import torch

from .attention import attention
from .kv_gather import kv_gather_attention
from .mesh import ParallelMesh
from .ring import ring_attention
from .sequence import SequenceLayout
from .ulysses import gather_heads, scatter_heads


def sequence_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: ParallelMesh,
    layout: SequenceLayout,
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (image out (B, S_local, H_local, D), text out (B, T, H_local, D) or None)."""
    ulysses = mesh.get_group("ulysses")
    if ulysses is not None:
        q, k, v = scatter_heads(torch.stack([q, k, v]), ulysses)
        if text is not None:
            u, hu = mesh.ulysses_rank, q.shape[2]
            text = tuple(t[:, :, u * hu : (u + 1) * hu] for t in text)  # type: ignore[assignment]

    # (B, S, H, D) → (B, H, S, D) for the kernels
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    num_text = 0
    prefix = None
    if text is not None:
        tq, tk, tv = (t.transpose(1, 2) for t in text)
        num_text = tq.shape[2]
        q = torch.cat([tq, q], dim=2)
        prefix = (tk, tv)

    ring = mesh.get_group("ring")
    gather = mesh.get_group("kv_gather")
    if ring is not None:
        valid = layout.block_valid(mesh.ring_size)
        out = ring_attention(q, k, v, group=ring, block_valid=valid, prefix_kv=prefix)
    elif gather is not None:
        out = kv_gather_attention(q, k, v, group=gather, num_valid=layout.num_tokens, prefix_kv=prefix)
    else:
        n = layout.block_valid(1)[0]
        kf, vf = k[:, :, :n], v[:, :, :n]
        if prefix is not None:
            kf, vf = torch.cat([prefix[0], kf], dim=2), torch.cat([prefix[1], vf], dim=2)
        out, _ = attention(q, kf, vf, need_lse=False)

    out = out.transpose(1, 2)  # (B, T + S, H, D)
    text_out = out[:, :num_text] if text is not None else None
    img_out = out[:, num_text:]
    if ulysses is not None:
        img_out, text_out = gather_heads(img_out, ulysses, replicated=text_out)
    return img_out, text_out
