"""Ulysses: one all-to-all turns (local sequence, all local heads) into (full block, a slice of heads).

Tensors here use diffusers' layout (batch, seq, heads, head_dim). With U ranks, head slice u goes to
ulysses rank u, and rank u's sequence chunk lands at position u of the gathered block, so the gathered
block is contiguous in the global sequence (see mesh.py for why shards are numbered that way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def scatter_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(N, B, S_local, H, D) → (N, B, U·S_local, H/U, D); N packs q/k/v into one collective."""
    world = dist.get_world_size(group)
    n, b, s, h, d = x.shape
    assert h % world == 0, f"{h} heads not divisible by ulysses degree {world}"
    # chunk j of dim 0 goes to rank j: (U, N, B, S, H/U, D)
    send = x.reshape(n, b, s, world, h // world, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] = rank i's sequence chunk for our heads; put chunks in sequence order
    return recv.permute(1, 2, 0, 3, 4, 5).reshape(n, b, world * s, h // world, d)


def gather_heads(
    x: torch.Tensor, group: dist.ProcessGroup, replicated: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of `scatter_heads` for one tensor: (B, U·S_local, H/U, D) → (B, S_local, H, D).

    `replicated` (B, T, H/U, D) is a result every rank needs for all heads (Flux text tokens): it rides
    along in the same all-to-all, appended to every chunk, instead of a second all-gather.
    """
    world = dist.get_world_size(group)
    b, s_full, hu, d = x.shape
    s = s_full // world
    send = x.reshape(b, world, s, hu, d).transpose(0, 1)  # (U, B, S, H/U, D)
    t = 0
    if replicated is not None:
        t = replicated.shape[1]
        send = torch.cat([send, replicated.unsqueeze(0).expand(world, -1, -1, -1, -1)], dim=2)
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] = head slice i of our sequence chunk (+ text)
    full = recv.permute(1, 2, 0, 3, 4).reshape(b, s + t, world * hu, d)
    if replicated is None:
        return full, None
    return full[:, :s], full[:, s:]
