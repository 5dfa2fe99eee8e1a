"""The scene scorer names the colours and shape of drawn scenes, also blurred and noisy as a model draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

from ditserve.replica.media import decode_mp4, encode_mp4
from ditserve.replica.models.scenes import (
    PALETTE,
    MovingScene,
    Scene,
    all_moving_scenes,
    all_scenes,
    draw_clip,
    draw_scene,
)
from ditserve.replica.models.scorer import (
    classify_shape,
    clip_matches,
    clip_shape,
    scene_matches,
    score_clip,
    score_scene,
)


@pytest.mark.parametrize("seed", [0, 1])
def test_scorer_names_every_drawn_scene(seed: int) -> None:
    rng = random.Random(seed)
    for scene in all_scenes():
        image = draw_scene(scene, rng)
        assert score_scene(image) == (scene.background, scene.colour), scene.caption
        assert classify_shape(image) == scene.shape, scene.caption
        assert scene_matches(image, scene)


def test_scorer_survives_blur_and_noise() -> None:
    rng = random.Random(2)
    noise = np.random.default_rng(2)
    for scene in all_scenes()[::3]:
        image = draw_scene(scene, rng).filter(ImageFilter.GaussianBlur(1.0))
        pixels = np.asarray(image, dtype=np.float32) + noise.normal(0, 12, (64, 64, 3))
        noisy = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
        assert score_scene(noisy) == (scene.background, scene.colour), scene.caption
        assert classify_shape(noisy) == scene.shape, scene.caption


def test_scorer_rejects_wrong_colours_and_empty_images() -> None:
    image = draw_scene(Scene("circle", "red", "blue"), random.Random(0))
    assert not scene_matches(image, Scene("circle", "blue", "red"))
    assert not scene_matches(image, Scene("circle", "purple", "blue"))
    blank = Image.new("RGB", (64, 64), PALETTE["green"])
    # No shape stands out: the "shape colour" is the background's, which no caption asks for.
    assert score_scene(blank) == ("green", "green")
    assert classify_shape(blank) == "none"


def test_clip_scorer_through_mp4() -> None:
    """Every 7th moving scene, drawn, blurred by H.264 (yuv420) and decoded: colours, direction, shape."""
    rng = random.Random(3)
    for scene in all_moving_scenes()[::7]:
        frames = decode_mp4(encode_mp4(draw_clip(scene, rng, 5), fps=8))
        assert score_clip(frames) == (scene.background, scene.colour, scene.direction), scene.caption
        assert clip_shape(frames) == scene.shape and clip_matches(frames, scene)


def test_clip_scorer_rejects_still_and_empty_clips() -> None:
    still = np.stack([np.asarray(draw_scene(Scene("circle", "red", "blue"), random.Random(0)))] * 5)
    assert score_clip(still) == ("blue", "red", "none")
    assert not clip_matches(still, MovingScene("circle", "red", "blue", "left"))
    blank = np.full((5, 64, 64, 3), PALETTE["pink"], dtype=np.uint8)
    assert score_clip(blank) == ("pink", "pink", "none") and clip_shape(blank) == "none"
