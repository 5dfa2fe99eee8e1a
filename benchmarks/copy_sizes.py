"""What plain torch reaches at the byte counts of the LoRA kernels (GPU): a clone (read + write), an in-place
add (read and write the same bytes, as the in-place expand does) and a read-only sum, graph-timed with the same L2 flush as benchmarks/lora_kernels.py, against the 2 GiB clone that
sets the kernel tables' HBM floor. Small transfers do not reach the large-copy bandwidth; this says by how much.

    PYTHONPATH=<dir holding ditserve/> python3 benchmarks/copy_sizes.py --out DIR   # writes DIR/copy_sizes.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth  # noqa: E402

# bytes moved by: the shrink's x (1 and 4 requests of 4608 tokens, hidden 3072), the 3-slice expand's y read +
# write (1 and 4 requests), the 4-slice one (4 requests)
SIZES = {
    "shrink 1x4608": 4608 * 3072 * 2,
    "shrink 4x4608": 4 * 4608 * 3072 * 2,
    "expand 1x4608, 3 slices": 2 * 4608 * 9216 * 2,
    "expand 4x4608, 3 slices": 2 * 4 * 4608 * 9216 * 2,
    "expand 4x4608, 4 slices": 2 * 4 * 4608 * 21504 * 2,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 2 GiB clone {bw / 1e9:.0f} GB/s",
        "",
        "| bytes of | MB | clone (read + write) | % of 2 GiB clone | in-place add | % | read-only sum | % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, nbytes in SIZES.items():
        half = torch.ones(nbytes // 4, dtype=torch.int16, device="cuda")  # clone moves nbytes
        whole = torch.ones(nbytes // 8, dtype=torch.int64, device="cuda")  # sum reads nbytes
        clone_ms = min(lk.quick_graph_ms(lambda h=half: h.clone()) for _ in range(3))
        add_ms = min(lk.quick_graph_ms(lambda h=half: h.add_(1)) for _ in range(3))
        sum_ms = min(lk.quick_graph_ms(lambda w=whole: w.sum()) for _ in range(3))
        floor_ms = nbytes / bw * 1e3
        lines.append(
            f"| {name} | {nbytes / 1e6:.0f} | {clone_ms * 1e3:.1f} µs | {100 * floor_ms / clone_ms:.0f}% | "
            f"{add_ms * 1e3:.1f} µs | {100 * floor_ms / add_ms:.0f}% | {sum_ms * 1e3:.1f} µs | {100 * floor_ms / sum_ms:.0f}% |"
        )
        print(lines[-1], flush=True)
        del half, whole
    with open(os.path.join(args.out, "copy_sizes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
