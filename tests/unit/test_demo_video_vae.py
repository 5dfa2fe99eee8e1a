"""demo-scenes-video's AutoencoderKLWan works frame by frame: what the trainer computes with 2-D convolutions
is what WanPipeline's chunked encode/decode compute, and training keeps it frame-wise. Its analytic starting
point already reconstructs held-out clips so that the clip scorer reads them right."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from ditserve.replica.models.scenes import draw_clip, held_out_moving_scenes
from ditserve.replica.models.scorer import score_clip
from ditserve.replica.models.train_demo import _Log
from ditserve.replica.models.train_demo_video import (
    _decode,
    _frames,
    analytic_init,
    build_video_pipeline_untrained,
    encode_clips,
    framewise,
    train_vae,
)


def _clips(num: int, frames: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (num, 3, frames, 64, 64), generator=gen, dtype=torch.uint8)


def _past_taps(vae) -> float:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return max(
        m.weight[:, :, :-1].abs().max().item()
        for m in vae.modules()
        if isinstance(m, WanCausalConv3d) and m.kernel_size[0] > 1
    )


@torch.no_grad()
def test_framewise_vae_equals_the_pipelines_chunked_encode_and_decode() -> None:
    vae = build_video_pipeline_untrained(0).vae.eval()
    clips = _clips(2, 5)
    mean, _ = encode_clips(vae, clips)
    x = clips.float() / 127.5 - 1.0
    chunked = vae.encode(x).latent_dist.mean  # AutoencoderKLWan: frame 1, then chunks of 4 with a cache
    assert torch.allclose(mean, chunked, atol=1e-5)
    with framewise(vae):
        frames = _decode(vae, _frames(mean)).clamp(-1, 1)
    frames = frames.reshape(2, 5, 3, 64, 64).transpose(1, 2)
    assert torch.allclose(frames, vae.decode(mean).sample, atol=1e-5)
    # A frame's latent and picture do not depend on the frames before it.
    changed = clips.clone()
    changed[:, :, :2] = 255 - changed[:, :, :2]
    again, _ = encode_clips(vae, changed)
    assert torch.equal(again[:, :, 2:], mean[:, :, 2:])
    assert not torch.allclose(again[:, :, :2], mean[:, :, :2])


def test_training_keeps_the_vae_framewise() -> None:
    vae = build_video_pipeline_untrained(0).vae
    assert _past_taps(vae) == 0.0
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    args = argparse.Namespace(
        seed=0, vae_lr=1e-3, vae_steps=2, vae_batch_size=2, vae_shape_weight=2.0, vae_time_budget_s=0
    )
    train_vae(vae, _frames(_clips(2, 3))[:, :, 0], args, _Log())
    assert _past_taps(vae) == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in vae.state_dict().items())


@torch.no_grad()
def test_analytic_vae_reconstructs_held_out_clips_the_scorer_reads_right() -> None:
    vae = build_video_pipeline_untrained(0).vae.eval()
    analytic_init(vae)
    assert _past_taps(vae) == 0.0
    # One clip per direction and shape, every held-out colour pair different, drawn as the trainer draws.
    scenes = held_out_moving_scenes()[:6]
    rng = random.Random(11)
    clips = torch.from_numpy(np.stack([draw_clip(s, rng, 9) for s in scenes])).permute(0, 4, 1, 2, 3)
    x = clips.float() / 127.5 - 1.0
    latents = vae.encode(x).latent_dist.mean  # the pipeline's chunked encode and decode, as shipped (fp16)
    recon = vae.decode(latents).sample.clamp(-1, 1)
    pixels = ((recon + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
    for scene, clip in zip(scenes, pixels, strict=True):
        assert score_clip(clip) == (scene.background, scene.colour, scene.direction), scene
    # Each 8×8 block comes back in one colour of the clip, not a blend of shape and background.
    blocks = x[..., 4::8, 4::8].repeat_interleave(8, dim=-2).repeat_interleave(8, dim=-1)
    assert (recon - blocks).abs().max() < 2e-3
    assert (recon - x).abs().mean() > 0.01  # not the identity: edges are blocky
    # The frame-wise computation the trainer uses is still the chunked one.
    mean, _ = encode_clips(vae, clips)
    assert torch.allclose(mean, latents, atol=1e-5)
    with framewise(vae):
        frames = _decode(vae, _frames(mean)).clamp(-1, 1)
    assert torch.allclose(frames.reshape(6, 9, 3, 64, 64).transpose(1, 2), recon, atol=1e-5)
