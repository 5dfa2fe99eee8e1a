"""Tuned tables as data: each op folder holds `tuned_<gpu>.json` (tiles and variants measured on that GPU),
read through the op's `configs.choose`. A GPU without a file of its own takes the H200's, where every table
was measured."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

MEASURED_ON = "nvidia_h200"


@functools.cache
def gpu_name(device_index: int) -> str:
    """The tables' name for a GPU: "NVIDIA H200" → "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device_index).lower()).strip("_")


@functools.cache
def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def tables(op_dir: Path, device: torch.device) -> dict:
    """The op's tuned tables for this device (the H200's where it has none of its own, and off CUDA)."""
    if device.type == "cuda":
        own = op_dir / f"tuned_{gpu_name(device.index or 0)}.json"
        if own.is_file():
            return _read(own)
    return _read(op_dir / f"tuned_{MEASURED_ON}.json")


def key(num_slices: int, rank_tile: int) -> str:
    """A table key for (slices, rank tile)."""
    return f"{num_slices}x{rank_tile}"
