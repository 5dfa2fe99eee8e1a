"""Name what a scene image or clip shows, to check that a model drew what it was asked.

Images: the background is the palette colour nearest to the median of the border pixels. The shape colour
is the palette colour most pixels vote for among those that clearly differ from the background; if no pixel
does, the "shape colour" is the background colour, which never matches a caption. The shape is the ideal
circle, square or triangle (apex up, as drawn) that best overlaps those pixels inside their bounding box.

Clips: background and shape colour from the first and last frames together, and the direction of motion
from where the shape's pixels lie in the last frame against the first.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from .scenes import COLOURS, PALETTE, SHAPES, MovingScene, Scene

_PALETTE = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32)  # (12, 3)
# A pixel belongs to the shape when it is this far (RGB distance) from the background; palette colours
# are at least ~92 apart, and generated edges blur halfway.
_MIN_SHAPE_DISTANCE = 50.0
# A clip whose shape moved less than this many pixels between its first and last frames did not move.
_MIN_TRAVEL_PX = 2.0


def _nearest(rgb: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour for each row of ``rgb`` (N, 3)."""
    return np.argmin(((rgb[:, None, :] - _PALETTE[None]) ** 2).sum(-1), axis=1)


def _pixels(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float32)


def _background(pixels: np.ndarray) -> np.ndarray:
    """Median RGB of the border (a frame of 1/32 of the side)."""
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
    return np.median(border, axis=0)


def _shape_mask(pixels: np.ndarray, background_rgb: np.ndarray) -> np.ndarray:
    distance = np.linalg.norm(pixels - background_rgb, axis=-1)
    return distance > max(_MIN_SHAPE_DISTANCE, 0.5 * float(distance.max()))


def _analyse(image) -> tuple[str, str, np.ndarray]:
    pixels = _pixels(image)
    background_rgb = _background(pixels)
    background = COLOURS[int(_nearest(background_rgb[None])[0])]
    mask = _shape_mask(pixels, background_rgb)
    if not mask.any():
        return background, background, mask
    votes = np.bincount(_nearest(pixels[mask]), minlength=len(COLOURS))
    return background, COLOURS[int(votes.argmax())], mask


def score_scene(image) -> tuple[str, str]:
    """``(background colour, shape colour)`` of a scene image (PIL or (H, W, 3) array), as palette names."""
    background, colour, _ = _analyse(image)
    return background, colour


def _ideal(shape: str, h: int, w: int) -> np.ndarray:
    canvas = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    if shape == "circle":
        draw.ellipse((0, 0, w - 1, h - 1), fill=1)
    elif shape == "square":
        draw.rectangle((0, 0, w - 1, h - 1), fill=1)
    else:
        draw.polygon([((w - 1) / 2, 0), (0, h - 1), (w - 1, h - 1)], fill=1)
    return np.asarray(canvas, dtype=bool)


def _classify_mask(mask: np.ndarray) -> str:
    if mask.sum() < 4:
        return "none"
    # Bounding box of the rows and columns that hold a real share of the shape (a stray pixel does not).
    rows, cols = mask.sum(1), mask.sum(0)
    keep_rows = np.nonzero(rows >= max(1, 0.1 * rows.max()))[0]
    keep_cols = np.nonzero(cols >= max(1, 0.1 * cols.max()))[0]
    r0, r1, c0, c1 = keep_rows[0], keep_rows[-1] + 1, keep_cols[0], keep_cols[-1] + 1
    if r1 - r0 < 3 or c1 - c0 < 3:
        return "none"
    box = mask[r0:r1, c0:c1]

    def overlap(shape: str) -> float:
        ideal = _ideal(shape, r1 - r0, c1 - c0)
        return (box & ideal).sum() / (box | ideal).sum()

    return max(SHAPES, key=overlap)


def classify_shape(image) -> str:
    """ "circle", "square" or "triangle": the ideal shape that best overlaps the shape's pixels in their
    bounding box; "none" if no shape stands out."""
    _, _, mask = _analyse(image)
    return _classify_mask(mask)


def scene_matches(image, scene: Scene) -> bool:
    """True when background and shape colour are the ones ``scene`` asks for."""
    return score_scene(image) == (scene.background, scene.colour)


def score_clip(frames: np.ndarray) -> tuple[str, str, str]:
    """``(background colour, shape colour, direction)`` of a clip ((F, H, W, 3) uint8), from its first and
    last frames. The direction is "left", "right", "up" or "down" (the larger of the horizontal and vertical
    moves of the shape's centre), or "none" when no shape stands out or it moved under 2 px."""
    first, last = _pixels(frames[0]), _pixels(frames[-1])
    background_rgb = np.median(np.stack([_background(first), _background(last)]), axis=0)
    background = COLOURS[int(_nearest(background_rgb[None])[0])]
    masks = [_shape_mask(f, background_rgb) for f in (first, last)]
    if not all(m.any() for m in masks):
        return background, background, "none"
    shape_pixels = np.concatenate([first[masks[0]], last[masks[1]]])
    colour = COLOURS[int(np.bincount(_nearest(shape_pixels), minlength=len(COLOURS)).argmax())]
    (y0, x0), (y1, x1) = (np.argwhere(m).mean(0) for m in masks)
    dx, dy = x1 - x0, y1 - y0
    if max(abs(dx), abs(dy)) < _MIN_TRAVEL_PX:
        return background, colour, "none"
    if abs(dx) >= abs(dy):
        return background, colour, "right" if dx > 0 else "left"
    return background, colour, "down" if dy > 0 else "up"


def clip_shape(frames: np.ndarray) -> str:
    """The shape in a clip's first frame (as :func:`classify_shape`)."""
    return classify_shape(frames[0])


def clip_matches(frames: np.ndarray, scene: MovingScene) -> bool:
    """True when background, shape colour and direction are the ones ``scene`` asks for."""
    return score_clip(frames) == (scene.background, scene.colour, scene.direction)
