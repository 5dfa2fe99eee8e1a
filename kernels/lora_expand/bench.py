"""GB/s of the segmented expand vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_expand.bench   (GPU)
"""

import torch

from ditserve.kernels._bench import LoRAProblem, gbps_report
from ditserve.kernels.lora_expand.op import launch_lora_expand
from ditserve.kernels.lora_expand.reference import lora_expand_ref


def calls(p: LoRAProblem):
    m = p.meta
    s = torch.randn(len(p.sizes), m.num_tokens, m.max_rank, device="cuda")
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    return (
        lambda: lora_expand_ref(p.y, s, p.b, *seg, p.sizes),
        lambda: launch_lora_expand(p.y, s, p.b, m.token_seg, *seg, p.sizes),
    )


if __name__ == "__main__":
    gbps_report("lora_expand rank 64, QKV 3x3072, hidden 3072", LoRAProblem.expand_bytes, calls)
