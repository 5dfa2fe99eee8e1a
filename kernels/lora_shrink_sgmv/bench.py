"""GB/s of the chunked SGMV shrink vs the torch loop and a copy of the same bytes (4 requests, 4 adapters).

python -m ditserve.kernels.lora_shrink_sgmv.bench   (GPU)
"""

from ditserve.kernels._bench import LoRAProblem, gbps_report
from ditserve.kernels.lora_shrink_sgmv.op import launch_lora_shrink_sgmv
from ditserve.kernels.lora_shrink_sgmv.reference import lora_shrink_sgmv_ref


def calls(p: LoRAProblem):
    m = p.meta
    ids = (m.sorted_token_ids, m.chunk_slot, m.chunk_start, m.chunk_len, m.slot_rank, m.max_rank)
    return (
        lambda: lora_shrink_sgmv_ref(p.x, p.a, *ids),
        lambda: launch_lora_shrink_sgmv(p.x, p.a, *ids, m.chunk_size),
    )


if __name__ == "__main__":
    gbps_report("lora_shrink_sgmv rank 64, 3 slices, hidden 3072", LoRAProblem.shrink_bytes, calls)
