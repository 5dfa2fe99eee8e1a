"""GB/s of the segmented shrink vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_shrink.bench   (GPU)
"""

from ditserve.kernels._bench import LoRAProblem, gbps_report
from ditserve.kernels.lora_shrink.op import launch_lora_shrink
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref


def calls(p: LoRAProblem):
    m = p.meta
    seg = (m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    return (
        lambda: lora_shrink_ref(p.x, p.a, *seg),
        lambda: launch_lora_shrink(p.x, p.a, m.token_seg, *seg),
    )


if __name__ == "__main__":
    gbps_report("lora_shrink rank 64, 3 slices, hidden 3072", LoRAProblem.shrink_bytes, calls)
