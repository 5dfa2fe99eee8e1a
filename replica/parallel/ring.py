"""Ring attention: K/V blocks travel around a P2P ring while each rank attends its queries to them.

Each step sends the current K/V block to the next rank and receives the following one into a second
buffer (`batch_isend_irecv`), so the transfer overlaps this step's attention; partial outputs are merged
with their log-sum-exp in fp32 (`merge_partial`). Layout: (batch, heads, seq, head_dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .attention import attention, merge_partial


class _Staged:
    """A P2P exchange through host memory: gloo's P2P takes no CUDA tensors (the shared-GPU test mode)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, *, send_to: int, recv_from: int, group):
        self.recv, self.host_recv = recv, torch.empty(recv.shape, dtype=recv.dtype, device="cpu")
        self.host_send = send.to("cpu")
        self.requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, self.host_send, peer=send_to, group=group),
                dist.P2POp(dist.irecv, self.host_recv, peer=recv_from, group=group),
            ]
        )

    def wait(self) -> None:
        for req in self.requests:
            req.wait()
        self.recv.copy_(self.host_recv)


def exchange(send: torch.Tensor, recv: torch.Tensor, *, send_to: int, recv_from: int, group) -> list:
    """Send ``send`` to the next rank and receive the previous rank's block into ``recv``; returns handles
    to ``wait()`` on (the transfer overlaps the caller's attention)."""
    if send.is_cuda and dist.get_backend(group) == "gloo":
        return [_Staged(send, recv, send_to=send_to, recv_from=recv_from, group=group)]
    ops = [
        dist.P2POp(dist.isend, send, peer=send_to, group=group),
        dist.P2POp(dist.irecv, recv, peer=recv_from, group=group),
    ]
    return dist.batch_isend_irecv(ops)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    block_valid: Sequence[int],
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend q to the union of every ring rank's K/V block (plus `prefix_kv` once).

    block_valid[j]: how many leading keys of ring rank j's block are real; the rest is sequence padding
    and gets no weight (it is sliced off, so it costs nothing either). `prefix_kv` (Flux text K/V, the
    same on every rank) is attended in the first step only, so it is counted once, not ring-times.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)

    buffers = [torch.stack([k, v]).contiguous(), None]
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(world):
        current = buffers[step % 2]
        assert current is not None
        requests = []
        if step < world - 1:
            nxt = buffers[(step + 1) % 2]
            if nxt is None:
                nxt = buffers[(step + 1) % 2] = torch.empty_like(current)
            requests = exchange(current, nxt, send_to=send_to, recv_from=recv_from, group=group)
        source = (rank - step) % world  # whose block we hold at this step
        n = block_valid[source]
        kb, vb = current[0, :, :, :n], current[1, :, :, :n]
        if step == 0 and prefix_kv is not None:
            kb = torch.cat([prefix_kv[0], kb], dim=2)
            vb = torch.cat([prefix_kv[1], vb], dim=2)
        if kb.shape[2] > 0:  # a block made only of padding adds nothing
            part_out, part_lse = attention(q, kb, vb, need_lse=True)
            assert part_lse is not None
            out, lse = merge_partial(out, lse, part_out, part_lse)
        for req in requests:
            req.wait()
    assert out is not None, "every key was padding"
    return out.to(q.dtype)
