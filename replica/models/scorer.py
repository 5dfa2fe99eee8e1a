"""Name the colours (and shape) of a scene image, to check that a model drew what it was asked.

The background is the palette colour nearest to the median of the border pixels. The shape colour is the
palette colour most pixels vote for among those that clearly differ from the background; if no pixel does,
the "shape colour" is the background colour, which never matches a caption.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from .scenes import COLOURS, PALETTE, Scene

_PALETTE = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32)  # (8, 3)
# A pixel belongs to the shape when it is this far (RGB distance) from the background; palette colours
# are at least ~115 apart, and generated edges blur halfway.
_MIN_SHAPE_DISTANCE = 60.0


def _nearest(rgb: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour for each row of ``rgb`` (N, 3)."""
    return np.argmin(((rgb[:, None, :] - _PALETTE[None]) ** 2).sum(-1), axis=1)


def _analyse(image: Image.Image) -> tuple[str, str, np.ndarray]:
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    h, w, _ = pixels.shape
    frame = max(1, min(h, w) // 32)
    border = np.concatenate(
        [
            pixels[:frame].reshape(-1, 3),
            pixels[-frame:].reshape(-1, 3),
            pixels[:, :frame].reshape(-1, 3),
            pixels[:, -frame:].reshape(-1, 3),
        ]
    )
    background_rgb = np.median(border, axis=0)
    background = COLOURS[int(_nearest(background_rgb[None])[0])]
    distance = np.linalg.norm(pixels - background_rgb, axis=-1)
    mask = distance > max(_MIN_SHAPE_DISTANCE, 0.5 * float(distance.max()))
    if not mask.any():
        return background, background, mask
    votes = np.bincount(_nearest(pixels[mask]), minlength=len(COLOURS))
    return background, COLOURS[int(votes.argmax())], mask


def score_scene(image: Image.Image) -> tuple[str, str]:
    """``(background colour, shape colour)`` of a scene image, as palette colour names."""
    background, colour, _ = _analyse(image)
    return background, colour


def classify_shape(image: Image.Image) -> str:
    """ "circle", "square" or "triangle" from how much of its bounding box the shape fills
    (1 for a square, π/4 ≈ 0.79 for a circle, ½ for a triangle); "none" if no shape stands out."""
    _, _, mask = _analyse(image)
    if mask.sum() < 4:
        return "none"
    rows, cols = np.nonzero(mask)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    fill = mask.sum() / box
    if fill > 0.9:
        return "square"
    if fill > 0.64:
        return "circle"
    return "triangle"


def scene_matches(image: Image.Image, scene: Scene) -> bool:
    """True when background and shape colour are the ones ``scene`` asks for."""
    return score_scene(image) == (scene.background, scene.colour)
