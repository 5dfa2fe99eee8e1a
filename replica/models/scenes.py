"""Synthetic scenes for the demo models: one coloured shape on a plain background, still or moving.

A scene is (shape, shape colour, background colour): 3 shapes × 12 colours × 11 other background colours =
396 captions such as "a red circle on a blue background" (``demo-scenes``). A moving scene adds a direction,
"a red circle moving left on a blue background" (``demo-scenes-video``, 1584 captions). Shapes are drawn
with Pillow at a random size and position, so a model has to learn what the caption says, not where things
are. A fixed set of caption combinations is held out of training; tests and benchmarks ask for those.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
# Every colour word of the demo tokenizers ("grey" aside: one name per colour), far apart in RGB: the
# closest pair (orange, yellow) is ~92 apart, every other pair over 100. Each name is a single token of the
# demo tokenizers.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (250, 135, 20),
    "yellow": (235, 225, 30),
    "green": (30, 160, 50),
    "cyan": (30, 210, 220),
    "blue": (30, 60, 210),
    "purple": (140, 40, 180),
    "pink": (250, 150, 200),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
    "brown": (120, 65, 20),
}
COLOURS = tuple(PALETTE)
HELD_OUT_SEED = 20240601
# Held-out (shape colour, background) pairs: two cyclic shifts of a fixed shuffle of the colours, so the first
# len(COLOURS) held-out scenes have every colour once as shape and once as background, and so do the next.
HELD_OUT_SHIFTS = (5, 2)
NUM_HELD_OUT = len(COLOURS) * len(HELD_OUT_SHIFTS)


def _held_out_pairs() -> list[tuple[str, str]]:
    order = list(COLOURS)
    random.Random(HELD_OUT_SEED).shuffle(order)
    n = len(order)
    return [(order[i], order[(i + shift) % n]) for shift in HELD_OUT_SHIFTS for i in range(n)]


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background"


def all_scenes() -> list[Scene]:
    """The 396 scenes in a fixed order (shape, then colour, then background)."""
    return [
        Scene(shape, colour, background)
        for shape in SHAPES
        for colour in COLOURS
        for background in COLOURS
        if background != colour
    ]


def held_out_scenes() -> list[Scene]:
    """The scenes never shown in training, in a fixed order.

    Each held-out (colour, background) pair is held out with one shape (cycling), so every held-out scene
    still has its colour pair (with the two other shapes) and its shape (with other colours) in training:
    the model has to combine what it saw, not remember captions. The first 12 (and the next 12) name every
    colour once as the shape's and once as the background's.
    """
    return [Scene(SHAPES[i % len(SHAPES)], c, b) for i, (c, b) in enumerate(_held_out_pairs())]


def train_scenes() -> list[Scene]:
    """All scenes but the held-out ones (372)."""
    held = set(held_out_scenes())
    return [s for s in all_scenes() if s not in held]


def parse_caption(caption: str) -> Scene:
    """Inverse of ``Scene.caption``; ``ValueError`` for anything else."""
    words = caption.strip().lower().split()
    if len(words) != 7 or words[0] != "a" or words[3:5] != ["on", "a"] or words[6] != "background":
        raise ValueError(
            f"not a scene caption: {caption!r} (expected 'a <colour> <shape> on a <colour> background')"
        )
    scene = Scene(words[2], words[1], words[5])
    if scene.shape not in SHAPES or scene.colour not in PALETTE or scene.background not in PALETTE:
        raise ValueError(f"unknown shape or colour in {caption!r}; shapes {SHAPES}, colours {COLOURS}")
    return scene


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x0: float, y0: float, extent: int, fill) -> None:
    x1, y1 = x0 + extent - 1, y0 + extent - 1
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)


def draw_scene(scene: Scene, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """Draw ``scene`` with a random size (30–70 % of the image) and position, 3 px clear of the border."""
    image = Image.new("RGB", (size, size), PALETTE[scene.background])
    margin = max(2, size * 3 // 64)
    extent = rng.randint(int(size * 0.3), int(size * 0.7))
    x0 = rng.randint(margin, size - margin - extent)
    y0 = rng.randint(margin, size - margin - extent)
    _draw_shape(ImageDraw.Draw(image), scene.shape, x0, y0, extent, PALETTE[scene.colour])
    return image


def draw_batch(scenes: list[Scene], rng: random.Random, size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw many scenes into one uint8 array of shape (N, size, size, 3)."""
    out = np.empty((len(scenes), size, size, 3), dtype=np.uint8)
    for i, scene in enumerate(scenes):
        out[i] = np.asarray(draw_scene(scene, rng, size))
    return out


def scenes_model_path() -> Path:
    """Folder of the trained ``demo-scenes`` pipeline shipped with the package (diffusers format, fp16)."""
    return Path(__file__).resolve().parent / "demo_scenes"


# -- moving scenes (demo-scenes-video) ------------------------------------------------------------------


@dataclass(frozen=True)
class MovingScene:
    shape: str
    colour: str
    background: str
    direction: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction} on a {self.background} background"


def all_moving_scenes() -> list[MovingScene]:
    """The 1584 moving scenes in a fixed order (shape, colour, background, direction)."""
    return [MovingScene(s.shape, s.colour, s.background, d) for s in all_scenes() for d in DIRECTIONS]


def held_out_moving_scenes() -> list[MovingScene]:
    """Moving scenes never shown in training: the held-out colour pairs of :func:`held_out_scenes` with the
    shape and the direction cycling (the first 12 name every colour once as shape and once as background,
    and every direction three times)."""
    return [
        MovingScene(SHAPES[i % len(SHAPES)], c, b, DIRECTIONS[i % len(DIRECTIONS)])
        for i, (c, b) in enumerate(_held_out_pairs())
    ]


def train_moving_scenes() -> list[MovingScene]:
    """All moving scenes but the held-out ones (1560)."""
    held = set(held_out_moving_scenes())
    return [s for s in all_moving_scenes() if s not in held]


def parse_moving_caption(caption: str) -> MovingScene:
    """Inverse of ``MovingScene.caption``; ``ValueError`` for anything else."""
    words = caption.strip().lower().split()
    if (
        len(words) != 9
        or words[0] != "a"
        or words[3] != "moving"
        or words[5:7] != ["on", "a"]
        or words[8] != "background"
    ):
        raise ValueError(
            f"not a moving scene caption: {caption!r} "
            "(expected 'a <colour> <shape> moving <direction> on a <colour> background')"
        )
    scene = MovingScene(words[2], words[1], words[7], words[4])
    if (
        scene.shape not in SHAPES
        or scene.colour not in PALETTE
        or scene.background not in PALETTE
        or scene.direction not in DIRECTIONS
    ):
        raise ValueError(
            f"unknown shape, colour or direction in {caption!r}; shapes {SHAPES}, colours {COLOURS}, "
            f"directions {DIRECTIONS}"
        )
    return scene


def draw_clip(
    scene: MovingScene,
    rng: random.Random,
    num_frames: int,
    size: int = IMAGE_SIZE,
    travel: tuple[float, float] = (0.6, 1.0),
) -> np.ndarray:
    """``num_frames`` frames (uint8, (F, size, size, 3)) of the shape crossing the picture.

    The shape (25–45 % of the picture) moves at constant speed in ``scene.direction``, from near one side
    (first frame) to near the other (last frame): it travels a share of the free room along that axis drawn
    from ``travel`` (60–100 % by default; (1, 1): from one side to the other), so the first and last frames
    tell the direction whatever the number of frames. The other coordinate is random and fixed; the shape
    stays 3 px clear of the border.
    """
    if not 0.0 < travel[0] <= travel[1] <= 1.0:
        raise ValueError(f"travel: a share range within (0, 1], got {travel}")
    margin = max(2, size * 3 // 64)
    extent = rng.randint(int(size * 0.25), int(size * 0.45))
    room = size - 2 * margin - extent
    distance = rng.uniform(*travel) * room
    start = margin + rng.uniform(0.0, room - distance)
    across = rng.randint(margin, size - margin - extent)
    sign = 1.0 if scene.direction in ("right", "down") else -1.0
    if sign < 0:
        start += distance
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    fill = PALETTE[scene.colour]
    for k in range(num_frames):
        along = start + sign * distance * k / max(1, num_frames - 1)
        x0, y0 = (along, across) if scene.direction in ("left", "right") else (across, along)
        image = Image.new("RGB", (size, size), PALETTE[scene.background])
        _draw_shape(ImageDraw.Draw(image), scene.shape, round(x0), round(y0), extent, fill)
        frames[k] = np.asarray(image)
    return frames


def scenes_video_model_path() -> Path:
    """Folder of the trained ``demo-scenes-video`` WanPipeline shipped with the package (diffusers, fp16)."""
    return Path(__file__).resolve().parent / "demo_scenes_video"
