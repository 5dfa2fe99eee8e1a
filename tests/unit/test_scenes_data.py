"""The scene captions, their held-out split and the drawing are fixed and consistent."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ditserve.replica.models.scenes import (
    COLOURS,
    DIRECTIONS,
    PALETTE,
    SHAPES,
    MovingScene,
    Scene,
    all_moving_scenes,
    all_scenes,
    draw_clip,
    draw_scene,
    held_out_moving_scenes,
    held_out_scenes,
    parse_caption,
    parse_moving_caption,
    scenes_model_path,
    scenes_video_model_path,
    train_moving_scenes,
    train_scenes,
)
from ditserve.replica.models.scorer import score_clip
from ditserve.replica.models.tokenizers import DEMO_WORDS, build_clip_tokenizer, build_t5_tokenizer


def test_caption_set_and_split() -> None:
    scenes = all_scenes()
    assert len(scenes) == len(set(scenes)) == 12 * 11 * 3
    held, train = held_out_scenes(), train_scenes()
    assert len(held) == 24 and not set(held) & set(train) and len(held) + len(train) == len(scenes)
    assert held == held_out_scenes()  # fixed, not drawn anew per call
    train_pairs = {(s.colour, s.background) for s in train}
    train_shapes = {s.shape for s in train}
    for scene in held:
        # Every part of a held-out caption was seen in training, only not together.
        assert (scene.colour, scene.background) in train_pairs and scene.shape in train_shapes
    # The first 12 held-out scenes (and the next 12) name every colour once as shape and once as background.
    for block in (held[:12], held[12:]):
        assert sorted(s.colour for s in block) == sorted(s.background for s in block) == sorted(COLOURS)


def test_every_colour_far_from_every_other() -> None:
    rgb = np.array(list(PALETTE.values()), dtype=float)
    distance = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(len(rgb)) * 1e9
    assert distance.min() > 90


def test_moving_caption_set_and_split() -> None:
    scenes = all_moving_scenes()
    assert len(scenes) == len(set(scenes)) == 12 * 11 * 3 * 4
    held, train = held_out_moving_scenes(), train_moving_scenes()
    assert len(held) == 24 and not set(held) & set(train) and len(held) + len(train) == len(scenes)
    assert sorted(s.colour for s in held[:12]) == sorted(s.background for s in held[:12]) == sorted(COLOURS)
    assert {s.direction for s in held[:16]} == set(DIRECTIONS) and {s.shape for s in held[:16]} == set(SHAPES)
    train_set = set(train)
    for scene in held:  # the same colours and shape moving another way were trained
        assert any(
            MovingScene(scene.shape, scene.colour, scene.background, d) in train_set for d in DIRECTIONS
        )
    for scene in scenes[::97]:
        assert parse_moving_caption(scene.caption) == scene
    with pytest.raises(ValueError, match="unknown shape, colour or direction"):
        parse_moving_caption("a red circle moving sideways on a blue background")
    with pytest.raises(ValueError, match="not a moving scene caption"):
        parse_moving_caption("a red circle on a blue background")


@pytest.mark.parametrize("frames", [2, 5, 17])
def test_clip_crosses_the_picture_in_its_direction(frames: int) -> None:
    rng = random.Random(frames)
    for direction in DIRECTIONS:
        scene = MovingScene("square", "orange", "gray", direction)
        clip = draw_clip(scene, rng, frames)
        assert clip.shape == (frames, 64, 64, 3)
        border = np.concatenate([clip[:, 0], clip[:, -1], clip[:, :, 0], clip[:, :, -1]], axis=1)
        assert (border == PALETTE["gray"]).all()  # the shape stays clear of the border
        assert score_clip(clip) == ("gray", "orange", direction)
    assert (draw_clip(scene, random.Random(1), 5) == draw_clip(scene, random.Random(1), 5)).all()


def test_captions_use_whole_word_tokens() -> None:
    for word in (*SHAPES, *COLOURS, *DIRECTIONS, "a", "on", "background", "moving"):
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


def test_travel_sets_how_far_the_shape_crosses() -> None:
    """travel=(1, 1): the shape goes from the margin on one side to the margin on the other, whatever its
    size; the default (60-100 % of the room) starts some clips further in; a bad range is refused."""
    margin = 3

    def columns(frame: np.ndarray) -> np.ndarray:
        return np.flatnonzero((frame != PALETTE["gray"]).any(axis=(0, 2)))

    rng = random.Random(3)
    for _ in range(8):
        clip = draw_clip(MovingScene("square", "orange", "gray", "left"), rng, 5, travel=(1.0, 1.0))
        first, last = columns(clip[0]), columns(clip[-1])
        assert first.max() == 63 - margin and last.min() == margin  # right edge to left edge
    starts = {
        int(columns(draw_clip(MovingScene("square", "orange", "gray", "right"), rng, 5)[0]).min())
        for _ in range(16)
    }
    assert max(starts) > margin  # the default travel leaves room to start further in
    for bad in ((0.0, 1.0), (0.9, 0.8), (0.5, 1.5)):
        with pytest.raises(ValueError, match="travel"):
            draw_clip(MovingScene("square", "orange", "gray", "left"), rng, 5, travel=bad)


# How users write the captions, and the caption each one must read as.
USER_PHRASINGS = {
    "A Red Circle On A Blue Background.": "a red circle on a blue background",
    "  a  red circle on a blue background ": "a red circle on a blue background",
    "An orange square on a grey background!": "a orange square on a gray background",
    "a red circle on blue background": "a red circle on a blue background",
    "a red circle against the blue background": "a red circle on a blue background",
    "a red circle on a blue": "a red circle on a blue background",
    "A RED CIRCLE MOVING LEFT ON A BLUE BACKGROUND": "a red circle moving left on a blue background",
    "a red circle moving to the left on a blue background": "a red circle moving left on a blue background",
    "a red circle moving leftwards on a blue background": "a red circle moving left on a blue background",
    "a red circle going right on a blue background": "a red circle moving right on a blue background",
    "a red circle moves from left to right on a blue background": "a red circle moving right on a blue background",
    "a red circle heading upward on a blue background": "a red circle moving up on a blue background",
    "a red circle drifting towards the bottom on a blue background": "a red circle moving down on a blue background",
}


def _shipped_tokenizers():
    """The shipped scene models' tokenizers, loaded as diffusers loads them (the class model_index.json names)."""
    import json

    import transformers

    for folder in (scenes_model_path(), scenes_video_model_path()):
        index = json.loads((folder / "model_index.json").read_text())
        for name in ("tokenizer", "tokenizer_2"):
            if name in index:
                yield (
                    f"{folder.name}/{name}",
                    getattr(transformers, index[name][1]).from_pretrained(folder / name),
                )


def test_shipped_tokenizers_read_user_phrasings_as_the_caption() -> None:
    for where, tokenizer in _shipped_tokenizers():
        for prompt, caption in USER_PHRASINGS.items():
            assert tokenizer(prompt).input_ids == tokenizer(caption).input_ids, (where, prompt)
        # A prompt that names nothing of a scene reads as the empty prompt (the unconditional scene).
        assert tokenizer("a magenta star").input_ids == tokenizer("").input_ids, where


def test_shipped_tokenizers_give_the_trained_ids_for_every_caption() -> None:
    """Each model's captions as trained on (and the empty prompt of its caption dropout) tokenize as the plain
    demo tokenizers tokenize them (no caption changes)."""
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    for where, tokenizer in _shipped_tokenizers():
        scenes = all_moving_scenes() if where.startswith("demo_scenes_video/") else all_scenes()
        captions = [s.caption for s in scenes] + [""]
        plain = clip if where == "demo_scenes/tokenizer" else t5
        assert tokenizer(captions).input_ids == plain(captions).input_ids, where


# Prompts with other words, in another order, or naming part of a scene, and the caption each model reads.
SCENE_READINGS = {
    "demo_scenes": {
        "a red circle on a blue background, high quality, 4k": "a red circle on a blue background",
        "Cinematic shot of a small red circle on a blue background, high quality, 4k": "a red circle on a blue background",
        "on a blue background, a red circle": "a red circle on a blue background",
        "Blue background with a red circle in the middle": "a red circle on a blue background",
        "a red circle moving left on a blue background": "a red circle on a blue background",
        "two red dots against a blue backdrop": "a red circle on a blue background",
        "a red circle, background of blue": "a red circle on a blue background",
        "a red circle, blue": "a red circle on a blue background",
        "a red and blue circle": "a blue circle on a red background",
        "a red circle on a blue background on a green background": "a red circle on a blue background",
        "a red circle on a red background": "a red circle on a black background",
        "a red circle": "a red circle on a black background",
        "a black triangle": "a black triangle on a white background",
        "a square on a white background": "a black square on a white background",
        "a red fox": "a red circle on a black background",
        "a magenta star": "",
        "moving left": "",
        "": "",
    },
    "demo_scenes_video": {
        "a red circle moving left on a blue background, high quality, 4k": "a red circle moving left on a blue background",
        "Cinematic shot of a small red circle, high quality, 4k, moving left on a blue background": "a red circle moving left on a blue background",
        "on a blue background, a red circle moving left": "a red circle moving left on a blue background",
        "a red circle on a blue background moving left": "a red circle moving left on a blue background",
        "moving left: a red circle on a blue background": "a red circle moving left on a blue background",
        "close-up of a red circle sliding left on a blue background": "a red circle moving left on a blue background",
        "a red circle at the top left, going right, on blue": "a red circle moving right on a blue background",
        "a red square falling on a blue background": "a red square moving down on a blue background",
        "a red circle on a blue background": "a red circle moving right on a blue background",
        "a triangle moving up": "a white triangle moving up on a black background",
        "a magenta star": "",
        "": "",
    },
}


def test_shipped_tokenizers_read_the_scene_a_prompt_names() -> None:
    """Extra words, another word order, a scene named in part: each model reads the caption of the scene named
    (what is missing filled in; nothing named: the empty prompt), with the caption's ids."""
    for where, tokenizer in _shipped_tokenizers():
        for prompt, caption in SCENE_READINGS[where.split("/")[0]].items():
            assert tokenizer.backend_tokenizer.normalizer.normalize_str(prompt) == caption, (where, prompt)
            assert tokenizer(prompt).input_ids == tokenizer(caption).input_ids, (where, prompt)
