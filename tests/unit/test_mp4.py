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


# Kr, Kb of the YUV matrices H.264 names by number (ITU-T H.273 MatrixCoefficients): BT.709, BT.601.
MATRICES = {1: (0.2126, 0.0722), 5: (0.299, 0.114), 6: (0.299, 0.114)}


def test_a_player_reading_the_streams_colour_tags_shows_the_frames_colours():
    """Saturated blocks, encoded: the stream names its matrix and range, and the YUV planes read by them (as a
    browser reads them) give the colours back. The stream named none, and a browser read FFmpeg's BT.601 YUV
    as BT.709: red, green, blue and their mixes were off by up to 39 levels of 255."""
    import io

    import av

    colours = [
        [255, 0, 0],
        [0, 255, 0],
        [0, 0, 255],
        [255, 255, 0],
        [0, 255, 255],
        [255, 0, 255],
        [255] * 3,
        [20] * 3,
    ]
    block = 32
    picture = np.repeat(np.repeat(np.array(colours, np.uint8).reshape(2, 4, 3), block, 0), block, 1)
    data = encode_mp4(np.stack([picture] * 3), fps=8)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0].codec_context
        assert stream.colorspace in MATRICES, f"matrix {stream.colorspace} (2: unspecified)"
        assert int(stream.color_range) == 1  # limited ("tv") range, what H.264 players expect
        frame = next(container.decode(video=0))
        planes = frame.to_ndarray()  # yuv420p: Y rows, then U and V at half size
    height, width = picture.shape[:2]
    y = planes[:height].astype(float)
    u, v = (
        planes[height + i * height // 4 : height + (i + 1) * height // 4]
        .reshape(height // 2, width // 2)
        .repeat(2, 0)
        .repeat(2, 1)
        .astype(float)
        for i in range(2)
    )
    kr, kb = MATRICES[stream.colorspace]
    luma, pb, pr = (y - 16) / 219, (u - 128) / 224, (v - 128) / 224
    red, blue = luma + 2 * (1 - kr) * pr, luma + 2 * (1 - kb) * pb
    green = (luma - kr * red - kb * blue) / (1 - kr - kb)
    shown = (np.stack([red, green, blue], -1) * 255).clip(0, 255)
    inner = np.zeros((height, width), bool)  # each block less its edges (chroma is shared across them)
    for row in range(2):
        for col in range(4):
            inner[row * block + 6 : (row + 1) * block - 6, col * block + 6 : (col + 1) * block - 6] = True
    assert np.abs(shown - picture)[inner].max() <= 4
    # PyAV reads the tags too: what the server decodes (thumbnails, spritesheets) has the same colours
    assert np.abs(decode_mp4(data)[0].astype(int) - picture)[inner].max() <= 4


def top_level_boxes(data: bytes) -> list[str]:
    """The MP4's top-level box types in file order (ISO BMFF: a 32-bit size, then 4 letters)."""
    boxes, offset = [], 0
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset : offset + 4], "big")
        boxes.append(data[offset + 4 : offset + 8].decode("latin-1"))
        if size == 1:  # a 64-bit size follows the type
            size = int.from_bytes(data[offset + 8 : offset + 16], "big")
        assert size >= 8, boxes
        offset += size
    assert offset == len(data), boxes
    return boxes


def test_the_index_comes_before_the_frames():
    """A player streaming the MP4 needs its index (moov) before the frames (mdat) to start; it came last,
    so playback waited for the whole file (or a second request for its end)."""
    boxes = top_level_boxes(encode_mp4(CLIPS[0], fps=8))
    assert "moov" in boxes and "mdat" in boxes
    assert boxes.index("moov") < boxes.index("mdat"), boxes
