"""Encoding outputs: PNG for images, H.264 MP4 (PyAV, FFmpeg inside its wheel) for videos; checking
uploaded images."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# What an upload may be (the formats OpenAI's image edits take).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def check_image(data: bytes, field: str, *, max_bytes: int, max_pixels: int) -> tuple[int, int]:
    """An uploaded image's (width, height) once it is known to decode; ``ValueError`` naming ``field``
    otherwise (too many bytes, too many pixels, not a PNG / JPEG / WebP, truncated or corrupt). The pixel
    count is read from the header before anything is decoded."""
    if len(data) > max_bytes:
        raise ValueError(f"{field}: {len(data)} bytes is above the maximum {max_bytes} (max_image_bytes)")
    unreadable = f"{field}: not a readable PNG, JPEG or WebP image"
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ValueError(
            f"{field}: too many pixels (above the maximum {max_pixels}, max_image_pixels)"
        ) from None
    except Exception as exc:  # PIL raises many kinds for bytes that are not an image
        raise ValueError(f"{unreadable} ({type(exc).__name__})") from None
    with image:
        width, height = image.size
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"{field}: {image.format} images are not taken; send PNG, JPEG or WebP")
        if width * height > max_pixels:
            raise ValueError(
                f"{field}: {width}x{height} is {width * height} pixels, above the maximum {max_pixels} "
                "(max_image_pixels)"
            )
        try:
            image.load()
        except Exception as exc:  # truncated or corrupt data after a valid header
            raise ValueError(f"{unreadable} ({type(exc).__name__})") from None
    return width, height


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header (an upload already checked)."""
    with Image.open(io.BytesIO(data)) as image:
        return image.size


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
