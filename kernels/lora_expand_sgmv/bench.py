"""GB/s of the chunked SGMV expand vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_expand_sgmv.bench   (GPU)
"""

import torch

from ditserve.kernels._bench import LoRAProblem, gbps_report
from ditserve.kernels.lora_expand_sgmv.op import launch_lora_expand_sgmv
from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref


def calls(p: LoRAProblem):
    m = p.meta
    s = torch.randn(len(p.sizes), m.num_tokens, m.max_rank, device="cuda")
    ids = (m.sorted_token_ids, m.token_scale, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank)
    return (
        lambda: lora_expand_sgmv_ref(p.y, s, p.b, *ids, p.sizes),
        lambda: launch_lora_expand_sgmv(p.y, s, p.b, *ids, p.sizes, m.chunk_size),
    )


if __name__ == "__main__":
    gbps_report("lora_expand_sgmv rank 64, QKV 3x3072, hidden 3072", LoRAProblem.expand_bytes, calls)
