"""demo-scenes-video's AutoencoderKLWan works frame by frame: what the trainer computes with 2-D convolutions
is what WanPipeline's chunked encode/decode compute, and training keeps it frame-wise."""

from __future__ import annotations

import argparse

import torch

from ditserve.replica.models.train_demo import _Log
from ditserve.replica.models.train_demo_video import (
    _decode,
    _frames,
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
