"""demo-scenes-video's WanTransformer3DModel can tell its latent frames apart, and its trainer spends the time
budget it is given.

Wan's rotary position encoding splits each attention head into a time, a height and a width part
(``WanRotaryPosEmbed``: height and width 2·(head_dim // 6) dims each, time the rest) with frequencies
10000^(-2i/dims). The model has no other positional signal, so which frame a key is in, relative to the
query's, is all it has to make the shape's path continuous and to move it the way the caption says."""

from __future__ import annotations

import json

import torch

from ditserve.replica.models.train_demo_video import (
    TRANSFORMER_CONFIG,
    StepBudget,
    build_video_pipeline_untrained,
)


def _frame_similarity(rope, frames: int) -> torch.Tensor:
    """(frames, frames): the mean over the time part's rotary pairs of cos(ω·(i - j)), the dot product of two
    isotropic query and key vectors rotated to frames i and j (1 on the diagonal)."""
    t = rope.t_dim
    cos, sin = rope.freqs_cos[:frames, :t].float(), rope.freqs_sin[:frames, :t].float()
    return (cos @ cos.T + sin @ sin.T) / t


def test_the_time_rotary_part_ranks_adjacent_frames_nearest() -> None:
    """With 16-dim heads time got 8 dims, four frequencies 1, 0.1, 0.01, 0.001 rad/frame: the last two hardly
    turn over a clip, the first wraps after 2π frames, so frame i + 6 looked more like frame i (similarity
    0.95) than frame i + 1 did (0.88), and a query could barely prefer its own or the next frame over one
    six frames away."""
    transformer = build_video_pipeline_untrained(0).transformer
    assert transformer.config.attention_head_dim == TRANSFORMER_CONFIG["attention_head_dim"]
    rope = transformer.rope
    frames = 17  # the longest clips trained on
    sim = _frame_similarity(rope, frames)
    assert torch.allclose(sim.diagonal(), torch.ones(frames), atol=1e-5)
    for i in range(frames):
        others = sim[i].clone()
        others[i] = -2.0
        nearest = int(others.argmax())
        assert abs(nearest - i) == 1, (i, nearest, sim[i].tolist())
        # the adjacent frame is clearly nearer than any farther one
        far = torch.cat([others[: max(0, i - 1)], others[i + 2 :]])
        assert others[nearest] - far.max() > 0.03, (i, others.tolist())
    # and time keeps enough of the head: at least two frequencies that turn between 0.2 and 1 rad a frame
    freqs = rope.freqs_sin[1, : rope.t_dim : 2].double().asin()
    assert int(((freqs >= 0.2) & (freqs <= 1.0)).sum()) >= 2, freqs.tolist()


def test_step_budget_measures_the_pace_after_warm_up(monkeypatch) -> None:
    """The first steps pay for kernel autotuning: a pace measured from the start cut the VAE to 531 steps of
    a 140 s budget that then took 24 s. Here 20 one-second warm-up steps, then 0.1 s a step, 100 s budget."""
    import ditserve.replica.models.train_demo_video as module

    clock = {"now": 0.0}
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock["now"])
    logged: list[str] = []
    budget = StepBudget(100_000, 100.0, logged.append, "transformer")
    total, step = 100_000, 0
    while step < total:
        clock["now"] += 1.0 if step < StepBudget.WARMUP else 0.1
        step += 1
        total = budget(step)
    assert 95.0 <= clock["now"] <= 100.0 + 1e-6, clock["now"]
    assert total == step and total >= 790, total
    assert logged and "steps fit 100 s" in logged[0]
    # never more than asked, and no budget means no cut
    assert StepBudget(300, 100.0, logged.append, "vae")(200) == 300
    assert StepBudget(300, 0.0, logged.append, "vae")(200) == 300


def test_recipe_options_patch_frame_shares_and_shape_loss_weights() -> None:
    """The trainer's recipe switches: a token per latent pixel, the steps' frame counts, and the flow-matching
    loss weighted on the shape's latents (background latents 1, the shape's 1 + weight)."""
    import argparse

    import pytest

    from ditserve.replica.models.train_demo_video import (
        FRAME_COUNTS,
        LATENT_SHAPE_THRESHOLD,
        frame_shares,
        shape_weights,
    )

    transformer = build_video_pipeline_untrained(0, (1, 1, 1)).transformer
    assert tuple(transformer.config.patch_size) == (1, 1, 1)
    x = torch.zeros(1, 4, 8, 8, 8)  # (N, C, F, h, w): one 8-frame latent clip, 8×8 latents
    assert (
        transformer(x, torch.tensor([500.0]), torch.zeros(1, 32, 32), return_dict=False)[0].shape == x.shape
    )

    assert frame_shares(argparse.Namespace(frame_shares="5:0.6,9:0.4")) == {5: 0.6, 9: 0.4}
    assert frame_shares(argparse.Namespace(frame_shares=None)) == {f: s for f, (s, _) in FRAME_COUNTS.items()}
    for bad in ("7:1", "5:-1", "5:0"):
        with pytest.raises(ValueError, match="--frame-shares"):
            frame_shares(argparse.Namespace(frame_shares=bad))

    latents = torch.full((2, 4, 5, 8, 8), -0.8)
    latents[0, 2, :, 3:5, 2:6] = 0.9  # clip 0: a shape in channel 2
    weights = shape_weights(latents, 4.0, LATENT_SHAPE_THRESHOLD)
    assert weights.shape == (2, 1, 5, 8, 8)
    assert int((weights == 5.0).sum()) == 5 * 2 * 4 and bool((weights[1] == 1.0).all())


def test_direction_contrast_adds_the_margin_an_untrained_model_misses() -> None:
    """--direction-contrast W: a clip's loss under its caption should be DIRECTION_MARGIN below its loss under
    the caption with the direction reversed. An untrained model reads neither word, so its first step pays
    about W × DIRECTION_MARGIN on top of the flow-matching loss of the same step without the option."""
    import argparse

    from ditserve.replica.models.scenes import all_moving_scenes
    from ditserve.replica.models.train_demo_video import DIRECTION_MARGIN, train_transformer

    gen = torch.Generator().manual_seed(0)
    means = torch.randn(8, 4, 5, 8, 8, generator=gen)
    pools = {5: (means, torch.full_like(means, 0.1), torch.arange(8) * (len(all_moving_scenes()) // 8))}

    def first_loss(weight: float) -> float:
        pipe = build_video_pipeline_untrained(0)
        args = argparse.Namespace(
            steps=1, time_budget_s=0, lr=1e-4, batch_size=4, caption_dropout=0.0, long_text_fraction=0.0,
            shape_loss_weight=0.0, seed=0, frame_shares=None, sigma_shift=6.0, direction_contrast=weight,
        )  # fmt: skip
        return train_transformer(pipe, pools, args, lambda message: None)[0]

    extra = first_loss(2.0) - first_loss(0.0)
    assert 1.5 * DIRECTION_MARGIN < extra < 2.5 * DIRECTION_MARGIN


def test_init_from_continues_a_saved_model_keeping_its_vae_and_shape(tmp_path) -> None:
    """--init-from: the saved folder's transformer (its block count, though the default differs) trains on, its
    VAE, latent statistics and frozen text encoder are kept as they are, and the model card carries the earlier
    run's lines."""
    from safetensors.torch import load_file

    from ditserve.replica.models.train_demo_video import main

    earlier = tmp_path / "earlier"
    pipe = build_video_pipeline_untrained(5, num_layers=2)  # another seed than the run's (0)
    pipe.vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 0.6, 0.7, 0.8])
    pipe.to(torch.float16).save_pretrained(earlier)
    (earlier / "README.md").write_text("# demo\n\n## Training\n- command: `the earlier run`\n\n## Held-out\n")

    out = tmp_path / "out"
    main(
        [
            "--out",
            str(out),
            "--init-from",
            str(earlier),
            "--device",
            "cpu",
            "--steps",
            "2",
            "--batch-size",
            "2",
        ]
        + ["--pool-scale", "0.002", "--frame-shares", "5:1", "--travel", "0.95", "1", "--eval-scenes", "0"]
    )

    def weights(folder, name):
        return load_file(str(next((folder / name).glob("*.safetensors"))))

    assert json.loads((out / "transformer" / "config.json").read_text())["num_layers"] == 2
    for kept in ("vae", "text_encoder"):  # the text encoder's random weights would otherwise follow --seed
        old, new = weights(earlier, kept), weights(out, kept)
        assert all(torch.equal(old[k], new[k]) for k in old), kept
    config = json.loads((out / "vae" / "config.json").read_text())
    assert config["latents_mean"] == [0.1, -0.2, 0.3, 0.0] and config["latents_std"] == [0.5, 0.6, 0.7, 0.8]
    before, after = weights(earlier, "transformer"), weights(out, "transformer")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    card = (out / "README.md").read_text()
    assert "continued from an earlier run of this command" in card and "`the earlier run`" in card
    # Served from its folder, a request without a size gets the size trained on, not Wan's 832×480.
    from ditserve.replica.models.registry import resolve_model

    assert resolve_model(str(out)).default_size == (64, 64)
    # The tokenizer reads a prompt as the captions are written, also in diffusers' WanPipeline.
    from diffusers import WanPipeline

    index = json.loads((out / "model_index.json").read_text())
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    tokenizer = WanPipeline.from_pretrained(out, dtype=torch.float32).tokenizer
    caption = tokenizer("a red circle moving left on a blue background").input_ids
    assert tokenizer("A Red Circle moving to the left on a Blue background.").input_ids == caption
    assert tokenizer("on a blue background, a small red circle moving left, 4k").input_ids == caption
    # ... as the shipped demo-scenes-video reads it: a retrained folder ships the same normalizer.
    from ditserve.replica.models.scenes import scenes_video_model_path

    shipped = json.loads((scenes_video_model_path() / "tokenizer" / "tokenizer.json").read_text())[
        "normalizer"
    ]
    assert json.loads((out / "tokenizer" / "tokenizer.json").read_text())["normalizer"] == shipped
    assert "--init-from" in card and "--travel 0.95 1.0" in card
