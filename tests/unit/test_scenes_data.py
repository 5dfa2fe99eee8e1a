"""The scene captions, their held-out split and the drawing are fixed and consistent."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ditserve.replica.models.scenes import (
    COLOURS,
    PALETTE,
    SHAPES,
    Scene,
    all_scenes,
    draw_scene,
    held_out_scenes,
    parse_caption,
    train_scenes,
)
from ditserve.replica.models.tokenizers import DEMO_WORDS


def test_caption_set_and_split() -> None:
    scenes = all_scenes()
    assert len(scenes) == len(set(scenes)) == 8 * 7 * 3
    held, train = held_out_scenes(), train_scenes()
    assert len(held) == 28 and not set(held) & set(train) and len(held) + len(train) == len(scenes)
    assert held == held_out_scenes()  # fixed, not drawn anew per call
    train_pairs = {(s.colour, s.background) for s in train}
    train_shapes = {s.shape for s in train}
    for scene in held:
        # Every part of a held-out caption was seen in training, only not together.
        assert (scene.colour, scene.background) in train_pairs and scene.shape in train_shapes


def test_captions_use_whole_word_tokens() -> None:
    for word in (*SHAPES, *COLOURS, "a", "on", "background"):
        assert word in DEMO_WORDS


def test_parse_caption_round_trip_and_errors() -> None:
    for scene in all_scenes():
        assert parse_caption(scene.caption) == scene
    with pytest.raises(ValueError, match="not a scene caption"):
        parse_caption("a fox in the snow")
    with pytest.raises(ValueError, match="unknown shape or colour"):
        parse_caption("a mauve circle on a red background")


def test_drawing_is_seeded_and_varied() -> None:
    scene = Scene("triangle", "yellow", "black")
    a = np.asarray(draw_scene(scene, random.Random(5)))
    b = np.asarray(draw_scene(scene, random.Random(5)))
    assert a.shape == (64, 64, 3) and (a == b).all()
    rng = random.Random(6)
    masks = {np.asarray(draw_scene(scene, rng)).tobytes() for _ in range(10)}
    assert len(masks) == 10  # random size and position
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    assert (border == PALETTE["black"]).all()  # the shape never touches the border
