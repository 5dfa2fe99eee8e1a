"""Encoding outputs: PNG for images, H.264 MP4 (PyAV, FFmpeg inside its wheel) for videos; checking
uploaded images."""

from __future__ import annotations

import ctypes
import functools
import io
import os
import platform
import tempfile

import numpy as np
from PIL import Image, ImageOps

# What an upload may be (the formats OpenAI's image edits take). Pillow names a JPEG that holds further
# pictures after the first (a multi-picture camera file, a phone's HDR photo with its gain map) "MPO": it is a
# JPEG all the same, read as its first picture.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP")
# EXIF orientations that turn the picture a quarter (the stored width is the shown height).
_QUARTER_TURNS = (5, 6, 7, 8)


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as the picture is shown: its EXIF orientation applied (what :func:`to_rgb` gives)."""
    width, height = image.size
    return (
        (height, width)
        if image.getexif().get(ImageOps.ExifTags.Base.Orientation) in _QUARTER_TURNS
        else (width, height)
    )


def to_rgb(image: Image.Image) -> Image.Image:
    """An upload as the models take it: EXIF orientation applied, 8-bit RGB (diffusers' ``load_image``).
    16-bit greyscale (PNG mode ``I;16`` / ``I``) is scaled to 8 bits first: Pillow's own conversion clips
    it, turning all but the darkest pixels white."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I"):
        levels = np.asarray(image).astype(np.float64) / 257
        image = Image.fromarray(levels.round().clip(0, 255).astype(np.uint8))
    return image.convert("RGB")


def check_image(data: bytes, field: str, *, max_bytes: int, max_pixels: int) -> tuple[int, int]:
    """An uploaded image's upright (width, height) once it is known to decode; ``ValueError`` naming ``field``
    otherwise (too many bytes, too many pixels, not a PNG / JPEG / WebP, truncated or corrupt). The pixel
    count is read from the header before anything is decoded."""
    if not data:
        raise ValueError(f"{field}: the file is empty (0 bytes); send a PNG, JPEG or WebP image")
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
            # after the pixels: a PNG's EXIF chunk may follow them
            return upright_size(image)
        except Exception as exc:  # truncated or corrupt data after a valid header
            raise ValueError(f"{unreadable} ({type(exc).__name__})") from None


# The longest side of a video's first frame over its shortest. Wan 2.1 I2V's CLIP processor scales the
# shortest side to 224 keeping the aspect before it crops: a 1x4000 PNG of a few hundred bytes took 10 s and
# 2.4 GB there, and longer ones, within max_image_pixels, took more memory than the replica had.
MAX_FIRST_FRAME_ASPECT = 8


def first_frame_refusal(width: int, height: int) -> str | None:
    """Why a first frame of ``width`` x ``height`` is not taken (a message naming input_reference), or None."""
    if max(width, height) > MAX_FIRST_FRAME_ASPECT * min(width, height):
        return (
            f"input_reference: {width}x{height} is longer than {MAX_FIRST_FRAME_ASPECT}:1, the most a first "
            "frame may be; crop it nearer the video's shape"
        )
    return None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header (an upload already checked), its EXIF orientation applied."""
    with Image.open(io.BytesIO(data)) as image:
        return upright_size(image)


def encode_png(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] → PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# x264.h: the CPU flag of its AVX-512 code (x86).
X264_CPU_AVX512 = 1 << 16


@functools.cache
def _x264_without_avx512() -> dict[str, str]:
    """Encoder options that keep x264 off its AVX-512 code. There its macroblock-tree rate control (on in
    every preset) reads memory it never wrote, so the quantisers, and so the bytes and the decoded frames,
    depended on what earlier work left on the heap: one request encoded twice in a replica gave two videos
    (decoded 36-58 dB apart). ``asm=`` takes x264's own CPU detection less that flag (naming flags instead
    would hand x264 ones the CPU may lack); its AVX2 code gives the bytes an AVX2 machine gives. Where the
    x264 PyAV loaded is not found on an x86 machine, mbtree is turned off instead (the bytes then depend on
    the frames alone too, at a higher bitrate)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return {}
    import av  # noqa: F401  (loads libavcodec and the libx264 it links)

    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "/libx264" in line)
        detect = ctypes.CDLL(path).x264_cpu_detect
    except (OSError, StopIteration, AttributeError):
        return {"x264-params": "mbtree=0"}
    detect.restype = ctypes.c_uint32
    cpu = detect()
    return {"x264-params": f"asm={cpu & ~X264_CPU_AVX512}"} if cpu & X264_CPU_AVX512 else {}


# H.264's code for BT.709 (its matrix, primaries and transfer alike; libavutil's AVCOL_*_BT709)
BT709 = 1


def encode_mp4(frames: np.ndarray, fps: int = 16) -> bytes:
    """uint8 [F, H, W, 3] → MP4 bytes (H.264, yuv420p: what common players open). The RGB (sRGB, whose
    primaries are BT.709's) becomes limited-range YUV by the BT.709 matrix, and the stream says so: an
    untagged stream leaves the matrix to the player, and browsers read BT.709 where FFmpeg's default had
    written BT.601 (saturated colours off by up to 39 levels of 255). The index (``moov``) comes before the
    frames (FFmpeg's faststart), so a player starts while the rest downloads; the muxer moves it by reading
    the written file back, hence a file rather than memory."""
    import av
    from av.video.reformatter import ColorRange, Colorspace

    num_frames, height, width, _ = frames.shape
    with tempfile.TemporaryDirectory(prefix="ditserve-mp4-") as folder:
        path = os.path.join(folder, "video.mp4")
        with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=fps)
            # yuv420p needs even sides; pad by repeating the last row/column when a side is odd.
            stream.width, stream.height = width + width % 2, height + height % 2
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18", "preset": "veryfast", **_x264_without_avx512()}
            tags = stream.codec_context  # written into the stream's VUI
            tags.colorspace = tags.color_primaries = tags.color_trc = BT709
            tags.color_range = ColorRange.MPEG
            for frame in frames:
                if width % 2 or height % 2:
                    frame = np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
                rgb = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                yuv = rgb.reformat(
                    format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG
                )
                for packet in stream.encode(yuv):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        with open(path, "rb") as file:
            return file.read()


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes → uint8 [F, H, W, 3] (used by tests and clients), by the matrix the stream names."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
