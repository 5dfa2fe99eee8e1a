"""Encoding outputs: PNG for images, H.264 MP4 (PyAV, FFmpeg inside its wheel) for videos."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode_png(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] → PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def encode_mp4(frames: np.ndarray, fps: int = 16) -> bytes:
    """uint8 [F, H, W, 3] → MP4 bytes (H.264, yuv420p: what common players open)."""
    import av

    num_frames, height, width, _ = frames.shape
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        # yuv420p needs even sides; pad by repeating the last row/column when a side is odd.
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for frame in frames:
            if width % 2 or height % 2:
                frame = np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            ):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes → uint8 [F, H, W, 3] (used by tests and clients)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
