"""Synthetic scenes for the ``demo-scenes`` model: one coloured shape on a plain background.

A scene is (shape, shape colour, background colour): 3 shapes × 8 colours × 7 other background colours =
168 captions such as "a red circle on a blue background". Images are drawn with Pillow at a random size and
position, so the model has to learn what the caption says, not where things are. A fixed set of caption
combinations is held out of training; tests and benchmarks ask the model for those.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
SHAPES = ("circle", "square", "triangle")
# Eight colours far apart in RGB (the closest pair, blue and purple, is ~115 apart), every name a single
# token of the demo tokenizers.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "yellow": (235, 215, 30),
    "green": (30, 160, 50),
    "cyan": (30, 210, 220),
    "blue": (30, 60, 210),
    "purple": (140, 40, 180),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
COLOURS = tuple(PALETTE)
HELD_OUT_SEED = 20240601
NUM_HELD_OUT = 28  # one combination for half of the 56 (colour, background) pairs


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background"


def all_scenes() -> list[Scene]:
    """The 168 scenes in a fixed order (shape, then colour, then background)."""
    return [
        Scene(shape, colour, background)
        for shape in SHAPES
        for colour in COLOURS
        for background in COLOURS
        if background != colour
    ]


def held_out_scenes() -> list[Scene]:
    """The scenes never shown in training, in a fixed order.

    Half of the (colour, background) pairs are held out once each, with the shape cycling, so every held-out
    scene still has its colour pair (with the two other shapes) and its shape (with other colours) in training:
    the model has to combine what it saw, not remember captions.
    """
    pairs = [(c, b) for c in COLOURS for b in COLOURS if b != c]
    random.Random(HELD_OUT_SEED).shuffle(pairs)
    return [Scene(SHAPES[i % len(SHAPES)], c, b) for i, (c, b) in enumerate(pairs[:NUM_HELD_OUT])]


def train_scenes() -> list[Scene]:
    """All scenes but the held-out ones (140)."""
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


def draw_scene(scene: Scene, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """Draw ``scene`` with a random size (30–70 % of the image) and position, 3 px clear of the border."""
    image = Image.new("RGB", (size, size), PALETTE[scene.background])
    draw = ImageDraw.Draw(image)
    margin = max(2, size * 3 // 64)
    extent = rng.randint(int(size * 0.3), int(size * 0.7))
    x0 = rng.randint(margin, size - margin - extent)
    y0 = rng.randint(margin, size - margin - extent)
    x1, y1 = x0 + extent - 1, y0 + extent - 1
    fill = PALETTE[scene.colour]
    if scene.shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif scene.shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
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
