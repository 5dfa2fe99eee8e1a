"""MP4 encoding gives the same bytes for the same frames, whatever a long-running process left on its heap
before (a replica encodes request after request): on a CPU with AVX-512, x264's macroblock-tree rate
control read memory it never wrote in its AVX-512 code, and the same video came out different from one
request to the next."""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Iterator

import numpy as np
import pytest

from ditserve.replica.media import decode_mp4, encode_mp4

M_PERTURB = -6  # glibc's mallopt parameter (malloc.h)


@contextlib.contextmanager
def heap_left_with(byte: int) -> Iterator[None]:
    """glibc fills every block malloc hands out meanwhile with ``byte ^ 0xff`` and every freed one with
    ``byte``: memory read before it is written holds those values, not whatever happened to be there."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if platform.system() != "Linux" or mallopt is None or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt(M_PERTURB) is glibc's")
    assert mallopt(M_PERTURB, byte) == 1
    try:
        yield
    finally:
        mallopt(M_PERTURB, 0)


def clip(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """Colour ramps moving a few pixels a frame, plus noise (what a tiny random model draws)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    return (
        np.stack(
            [
                np.stack([(x * 4 + 9 * t) % 256, (y * 4 + 3 * t) % 256, (x + y) % 256], -1)
                + rng.integers(0, 32, (height, width, 3))
                for t in range(frames)
            ]
        )
        .clip(0, 255)
        .astype(np.uint8)
    )


# Small clips, and the models' own 832×480 (where mbtree read other bytes on most encodes).
CLIPS = [clip(seed, n, 64, 64) for seed in range(3) for n in (5, 17)] + [clip(0, 9, 480, 832)]


def test_the_same_frames_encode_to_the_same_bytes_whatever_the_heap_held():
    encoded = {}
    for byte in (0x55, 0xAA, 0x0F):
        with heap_left_with(byte):
            encoded[byte] = [encode_mp4(frames, fps=8) for frames in CLIPS]
    for byte in (0xAA, 0x0F):
        for i, (got, want) in enumerate(zip(encoded[byte], encoded[0x55], strict=True)):
            assert got == want, f"clip {i} ({CLIPS[i].shape}): other bytes after a heap left with {byte:#x}"
    for data, frames in zip(encoded[0x55], CLIPS, strict=True):
        assert decode_mp4(data).shape == frames.shape
