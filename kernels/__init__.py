"""Triton kernels, one folder per op (kernel.py, op.py, reference.py, bench.py).

The multi-LoRA entry points live in `ditserve.kernels.lora` (not re-exported here: `lora_shrink` and
`lora_expand` are also the names of the op folders)."""
