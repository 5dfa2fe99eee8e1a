"""Train ``demo-scenes-video``: a tiny Wan-architecture pipeline that films the moving scene its caption names.

"a red circle moving left on a blue background": one circle, square or triangle in one of 12 colours crossing
a background of another colour in one of four directions (``scenes.draw_clip``). Steps, all seeded:

1. draw pools of training clips with Pillow (random size and position, the shape crossing from near one side
   to near the other: ``TRAVEL``; held-out captions never drawn), of 5 frames (and 9 and 17 where
   ``--frame-shares`` asks for them);
2. train a 2.4 M-parameter AutoencoderKLWan (8× spatial, no temporal compression, 4 latent channels),
   starting from :func:`analytic_init` (``--vae-init analytic``: weights set by hand so that, untrained, it
   codes each 8×8 block of a frame as one colour), on single frames: its causal convolutions' taps on
   earlier frames are zero and stay zero, so it encodes and decodes each frame on its own (exactly, through
   WanPipeline's chunked encode/decode too) and trains as a 2-D network on batches of frames from many
   clips; the reconstruction loss weighs the shape's pixels more. Then measure each latent channel's mean
   and std and write them into its config (``latents_mean`` / ``latents_std``, as real Wan VAEs carry them);
3. encode every caption once with the frozen random-weight tiny UMT5 (random features still tell the 1584
   captions apart), at lengths 32 (the tokenizer's ``model_max_length``, what ``ditserve`` uses) and 512
   (WanPipeline's default), plus the empty prompt;
4. train a WanTransformer3DModel with flow matching exactly as WanPipeline samples with its
   FlowMatchEulerDiscreteScheduler: timestep = 1000·sigma, x_t = (1 - sigma)·x0 + sigma·noise, target
   noise - x0, sigma logit-normal then shifted (``--sigma-shift``, more than the sampler's), 10 % empty captions so
   classifier-free guidance (``guidance_scale`` > 1, the negative prompt "") works; heads of 32 so that the
   rotary encoding's time part tells frames apart (``TRANSFORMER_CONFIG``); afterwards the log compares the
   loss with each clip's caption against the caption with its direction reversed (:func:`caption_use`): a
   model that ignores the direction word pays nothing for it;
5. save in diffusers format (fp16 weights), reload in fp32, score held-out prompts; write a model card.

Run: ``ditserve train-demo-video --out DIR --compile`` (minutes on one GPU; ``benchmarks/probes/train_demos.sh``
has the budgets), then, to carry it to 9 and 17 frames, ``ditserve train-demo-video --out DIR2 --init-from DIR
--compile --frame-shares 5:0.5,9:0.35,17:0.15 --lr 0.0003 --seed 1`` (the shipped model: 492 s on one H100, then
284 s on one H200; its model card has both commands). After the VAE's steps the log says how many reconstructions of held-out clips the clip
scorer reads right, the ceiling for the transformer's samples. Why frame by frame: trained on whole 9-frame
clips in 3-D (every 3×3×3 kernel over all frames), the VAE managed ~700 steps of 24 clips in 110 s on an
H200 and the scorer read 13/48 of its held-out reconstructions right; per frame, a step costs a third of
the convolution work, runs as 2-D convolutions, and its batch holds frames of as many different clips.
Why the analytic start: from random weights this VAE learns colours slowly (on CPU, 100 steps of 16 frames
at 1e-3 leave reconstruction MSE 0.26 and 0/48 held-out clips read right); :func:`analytic_init` is read
right on 48/48 before any step (MSE 0.034, shape 24/48: blocky edges), and training sharpens it (steps of
16 frames at 3e-3: 300 steps MSE 0.011, 48/48, shape 33/48; 1000 steps MSE 0.004, 48/48, shape 43/48).
Should training still scramble it, the run keeps the start when training reads clearly fewer
training-scene clips right. On CPU the conventions were checked against WanPipeline: the one-pass
encode/decode equal AutoencoderKLWan's chunked ones (1e-6), the caption embeddings equal ``encode_prompt``'s
at lengths 32 and 512, timesteps are the scheduler's 1000·sigma with its shift.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .demo import _tiny_t5
from .scenes import (
    COLOURS,
    IMAGE_SIZE,
    MovingScene,
    all_moving_scenes,
    draw_clip,
    held_out_moving_scenes,
    train_moving_scenes,
)
from .scorer import clip_shape, score_clip
from .tokenizers import (
    build_t5_tokenizer,
    name_tokenizers_generic,
    prompts_card_section,
    with_caption_normalizer,
)
from .train_demo import (
    _cosine_lr,
    _earlier_run,
    _Log,
    _machine,
    _round_to_fp16,
    _to_unit,
    _update,
    load_weights,
)

T5_MAX_LENGTH = 32
LONG_T5_LENGTH = 512  # WanPipeline's default max_sequence_length
SHIFT = 2.0  # the scheduler's flow shift (64×64 clips have few tokens: a small shift)
# Training sigmas are shifted further (--sigma-shift): more steps at high noise, where a clip's trajectory, and so
# the direction word, is decided (at the sampler's shift the model learned colours but no direction).
TRAIN_SIGMA_SHIFT = 6.0
# The share of the free room the shape crosses in a training clip (--travel): from near one side to near the
# other, so that where the shape sits in the first and last frames tells the direction. The transformer's only
# positional signal is relative (Wan's rotary encoding) and the shape moves a fraction of a token per frame; with
# a random start (60-100 % of the room) the direction was left at chance, with this it is learned in minutes.
TRAVEL = (0.95, 1.0)
LATENT_CHANNELS = 4
# Frame counts trained on, with their share of transformer steps and pool sizes (clips). From scratch, 5-frame
# clips: their steps are the cheapest and the direction is learned on them first (a run with 9- and 17-frame
# clips from the start learned none in its budget); the 9- and 17-frame pools are for a continuation
# (--init-from ... --frame-shares 5:0.5,9:0.35,17:0.15), and the 9-frame one gives the latent statistics.
FRAME_COUNTS = {5: (1.0, 12288), 9: (0.0, 18432), 17: (0.0, 6144)}
# --shape-loss-weight: a latent is the shape's where some channel of the normalised latent is this far from
# its frame's top-left (background) latent. Palette colours differ by >= 0.3 of the pixel range in some
# channel, about 0.5 of a latent channel's std.
LATENT_SHAPE_THRESHOLD = 0.25
# The transformer. Its only positional signal is Wan's rotary encoding, relative in time: with nothing else a
# token cannot tell the first frame from the last, where the caption's direction puts the shape on opposite
# sides; it has to follow the shape from frame to frame, and find the clip's ends, through attention that
# picks out the neighbouring frames. The rotary encoding gives time head_dim - 4·(head_dim // 6) of each
# head's dims, frequencies 10000^(-2i/dims) rad per frame. Heads of 16 left time 8 dims: 1, 0.1, 0.01 and
# 0.001 rad a frame, of which only the first turns much over a clip and it wraps after 2π frames, so frame
# i + 6 looked more like frame i than frame i + 1 did. So trained, the model drew the colours but ignored the
# direction word (its loss the same with the opposite direction in the caption) and the shape jumped about
# between frames. Heads of 32 (same width; 4 heads: sequence-parallel degrees 2 and 4) give time 12 dims,
# 1, 0.22, 0.046, ... rad a frame: adjacent frames are the nearest, and twice the margin a head can give its
# own frame over any other.
TRANSFORMER_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": LATENT_CHANNELS,
    "out_channels": LATENT_CHANNELS,
    "text_dim": 32,
    "freq_dim": 64,
    "ffn_dim": 384,
    "num_layers": 8,  # 6 learned the direction too, 8 carried it better to 9 and 17 frames
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
}
# --direction-contrast: the loss with the direction reversed should exceed the caption's by this much (the
# flow-matching loss of a clip is 0.2-0.6 at the sigmas where its trajectory is decided).
DIRECTION_MARGIN = 0.05
# What ditserve and the tests sample with (ditserve's Wan default guidance is 5).
SAMPLING = {"num_frames": 9, "num_inference_steps": 20, "guidance_scale": 5.0, "max_sequence_length": 32}


def build_video_pipeline_untrained(
    seed: int = 0, patch_size: tuple[int, int, int] | None = None, num_layers: int | None = None
):
    """The ``demo-scenes-video`` WanPipeline with random weights: 8 blocks of 4 heads × 32 (see
    ``TRANSFORMER_CONFIG``; ``patch_size`` and ``num_layers`` replace its patch and block count), an
    AutoencoderKLWan (16/32/64/64, 4 latent channels, 8× spatial, 1× temporal, frame by frame: see
    :func:`make_framewise`), the tiny UMT5.

    Every weight is rounded to fp16 precision, so the fp16 files that ship hold exactly the frozen text
    encoder the transformer was trained against.
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    config = dict(TRANSFORMER_CONFIG)
    if patch_size is not None:
        config["patch_size"] = tuple(patch_size)
    if num_layers is not None:
        config["num_layers"] = num_layers
    transformer = WanTransformer3DModel(**config)
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, False, False],
        latents_mean=[0.0] * LATENT_CHANNELS,  # measured after VAE training
        latents_std=[1.0] * LATENT_CHANNELS,
        scale_factor_temporal=1,
        scale_factor_spatial=8,
    )
    make_framewise(vae)
    # Prompts are rewritten into the caption they name (any order, other words dropped): tokenizers.py.
    tokenizer = with_caption_normalizer(build_t5_tokenizer(model_max_length=T5_MAX_LENGTH), moving=True)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_tiny_t5(tokenizer, "UMT5EncoderModel"),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        transformer=transformer,
    )
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        _round_to_fp16(module)
    return pipe


class StepBudget:
    """Cuts a phase's step count to fit a wall-clock budget from its measured pace.

    The pace is measured from step ``WARMUP`` on, not from the start: the first steps of a phase pay for
    cuDNN's and cuBLAS's algorithm search (tens of seconds for the VAE's first convolutions on an H200), and a
    pace that counts them overestimates the cost of every later step (a fit at step 100 from the start ran the
    VAE for 24 s of its 140 s and the transformer for 186 s of its 260 s). The fit is made at step
    ``REFITS[0]`` and made again at the later ones (a longer measure; the other demo trainer running on the
    same GPU makes the pace drift), only ever cutting below the steps asked for, and logged each time it
    changes the count."""

    WARMUP = 20
    REFITS = (200, 1000, 3000)

    def __init__(self, total: int, budget_s: float, log, what: str) -> None:
        self.total, self.budget_s, self.log, self.what = total, budget_s, log, what
        self.asked = total
        self.start = time.perf_counter()
        self.warm: float | None = None

    def __call__(self, done: int) -> int:
        """The step count after ``done`` steps."""
        if self.budget_s <= 0:
            return self.total
        if done == self.WARMUP:
            self.warm = time.perf_counter()
        elif done in self.REFITS and self.warm is not None and done < self.total:
            now = time.perf_counter()
            pace = (now - self.warm) / (done - self.WARMUP)
            left = self.budget_s - (now - self.start)
            fitted = min(self.asked, max(done + 1, done + int(left / pace)))
            if fitted != self.total:
                self.log(
                    f"{self.what}: {pace * 1000:.1f} ms/step after {done} steps; {fitted} steps fit "
                    f"{self.budget_s:.0f} s (was {self.total})"
                )
                self.total = fitted
        return self.total


def _causal_convs(vae) -> list:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return [m for m in vae.modules() if isinstance(m, WanCausalConv3d)]


def make_framewise(vae) -> None:
    """Zero every causal convolution's taps on earlier frames, keeping the current frame's (the last tap;
    the 2-D kernel scaled by √(taps), so it starts at the 2-D fan-in's scale). Without temporal down- or
    upsampling the rest of AutoencoderKLWan is per frame already (RMS norms over channels, attention within
    a frame), so each frame is then encoded and decoded on its own, and :func:`framewise` computes it as
    2-D convolutions. The zero taps get zero gradients there, so they stay zero through training."""
    with torch.no_grad():
        for conv in _causal_convs(vae):
            taps = conv.kernel_size[0]
            if taps > 1:
                conv.weight[:, :, -1] *= taps**0.5
                conv.weight[:, :, :-1].zero_()


# The analytic starting point (see :func:`analytic_init`).
_BIG = 2048.0  # the constant channel that makes each head's RMS norm a division by a (nearly) fixed number
_TRUNK = 8.0  # the colours' scale between the convolutions in and out
_LOGVAR = -8.0  # encoder's log-variance: posterior std e^-4 ≈ 0.018 (2.3/255 of a pixel)
# Which of its three rows and columns each stride-2 downsampling convolution keeps (output i of level l
# reads input rows 2i..2i+2): together they pick pixel 8k + 0 + 2·0 + 4·1 = 8k + 4 of each 8×8 block.
_DOWN_TAPS = (0, 0, 1)


def _set_eye(weight: torch.Tensor, scale: float = 1.0, tap: tuple[int, ...] | None = None) -> None:
    """Zero ``weight`` (out, in, *kernel) and put ``scale`` on its channel diagonal at ``tap`` (default: the
    kernel's centre in space, its last tap, the current frame, in time)."""
    weight.zero_()
    if tap is None:
        kernel = weight.shape[2:]
        tap = (
            tuple(k // 2 for k in kernel)
            if len(kernel) == 2
            else (kernel[0] - 1, kernel[1] // 2, kernel[2] // 2)
        )
    n = min(weight.shape[0], weight.shape[1])
    idx = torch.arange(n)
    weight[(idx, idx, *(torch.full_like(idx, t) for t in tap))] = scale


def _current_tap(conv) -> torch.Tensor:
    """The current frame's spatial kernel (out, in, kh, kw) of a WanCausalConv3d, its other taps zeroed."""
    conv.weight.zero_()
    return conv.weight[:, :, -1]


@torch.no_grad()
def analytic_init(vae) -> None:
    """Set a :func:`build_video_pipeline_untrained` AutoencoderKLWan's weights by hand so that, untrained, it
    codes each frame as the colours of a grid of 8×8 blocks: latent channels 0-2 are the RGB (in [-1, 1])
    of pixel (8i + 4, 8j + 4), channel 3 their mean (a luminance the decoder ignores at first); the decoder
    paints each block in its latent's colour (nearest upsampling). A point sample, not the block's mean: a
    mean blends shape and background where the shape's edge crosses a block, and those blends (the scorer
    counts the pixels far from the background) often sit nearer a third palette colour than the shape's,
    outvoting a small shape's few whole blocks; a point sample is always exactly one of the two colours.

    How, module by module (classes and config untouched, every earlier causal tap zero):
    - each residual block's last convolution zero, so the block passes its input on (a 1×1 shortcut where
      the width changes embeds the channels); attention's output projection zero: the same;
    - the trunk carries +RGB in channels 0-2 and -RGB in 3-5, ``_TRUNK`` times larger than in the picture:
      Adam's first steps move every weight of a residual branch's zero last convolution by about the
      learning rate in step, so the branch soon adds O(0.1-1) to the trunk, which scrambled colours carried
      at their own scale (100 steps of 16 frames at 3e-3: MSE 0.034 -> 0.26), not colours 8× larger (MSE
      0.034 -> 0.022);
    - the stride-2 downsampling convolutions each keep one tap (``_DOWN_TAPS``), the upsampling ones are the
      identity after their nearest ×2;
    - each head (RMS norm over channels → SiLU → convolution) is the only nonlinear step: the residual block
      before it adds a constant ``_BIG`` channel (its last convolution's bias), so the norm divides by
      ≈ ``_BIG``/√C whatever the colour (relative error |rest|²/(2·``_BIG``²) < 5e-5), the norm's gamma
      ``_BIG``/(√C·``_TRUNK``) undoes that and the trunk's scale, and the head's convolution takes
      SiLU(+c) - SiLU(-c), which is exactly c;
    - encoder log-variance a constant ``_LOGVAR``; quant convolutions the identity.

    All values but the luminance's thirds are exact in fp16. Training then starts from a VAE whose colours
    are right (the residual branches' first convolutions keep their random weights, so they learn once
    their last ones move)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanResidualBlock,
    )

    enc, dec = vae.encoder, vae.decoder
    for conv in _causal_convs(vae):  # every earlier-frame tap zero, whatever is set below
        conv.weight[:, :, :-1].zero_()
    for module in vae.modules():
        if isinstance(module, WanResidualBlock):
            module.conv2.weight.zero_()
            module.conv2.bias.zero_()
            if isinstance(module.conv_shortcut, WanCausalConv3d):
                _set_eye(module.conv_shortcut.weight)
                module.conv_shortcut.bias.zero_()
        elif isinstance(module, WanAttentionBlock):
            module.proj.weight.zero_()
            module.proj.bias.zero_()
    downs = [m for m in enc.down_blocks if isinstance(m, WanResample)]
    assert [m.mode for m in downs] == ["downsample2d"] * len(_DOWN_TAPS), [m.mode for m in downs]
    for resample, tap in zip(downs, _DOWN_TAPS, strict=True):
        conv = resample.resample[1]
        _set_eye(conv.weight, tap=(tap, tap))
        conv.bias.zero_()
    for block in dec.up_blocks:
        if block.upsamplers is not None:
            conv = block.upsamplers[0].resample[1]
            assert block.upsamplers[0].mode == "upsample2d", block.upsamplers[0].mode
            _set_eye(conv.weight)
            conv.bias.zero_()

    # Encoder: RGB -> (+RGB, -RGB) ... -> head -> (RGB, luminance, log-variances).
    w = _current_tap(enc.conv_in)
    enc.conv_in.bias.zero_()
    for c in range(3):
        w[c, c, 1, 1], w[3 + c, c, 1, 1] = _TRUNK, -_TRUNK
    _head(enc, enc.mid_block.resnets[-1])
    w = _current_tap(enc.conv_out)
    enc.conv_out.bias.zero_()
    for c in range(3):
        w[c, c, 1, 1], w[c, 3 + c, 1, 1] = 1.0, -1.0
        w[3, c, 1, 1], w[3, 3 + c, 1, 1] = 1.0 / 3.0, -1.0 / 3.0
    enc.conv_out.bias[vae.config.z_dim :] = _LOGVAR
    _set_eye(vae.quant_conv.weight)
    vae.quant_conv.bias.zero_()
    _set_eye(vae.post_quant_conv.weight)
    vae.post_quant_conv.bias.zero_()

    # Decoder: (RGB, luminance) -> (+RGB, -RGB, luminance) ... -> head -> RGB.
    w = _current_tap(dec.conv_in)
    dec.conv_in.bias.zero_()
    for c in range(3):
        w[c, c, 1, 1], w[3 + c, c, 1, 1] = _TRUNK, -_TRUNK
    w[6, 3, 1, 1] = _TRUNK
    _head(dec, dec.up_blocks[-1].resnets[-1])
    w = _current_tap(dec.conv_out)
    dec.conv_out.bias.zero_()
    for c in range(3):
        w[c, c, 1, 1], w[c, 3 + c, 1, 1] = 1.0, -1.0
    _round_to_fp16(vae)


def _head(coder, last_block) -> None:
    """The constant channel (the last) added by the block before ``coder``'s head, and the head's norm
    scaled back: x / ‖x‖ · √C · gamma ≈ x for the other channels, ≈ 1 for the constant one."""
    width = coder.norm_out.gamma.shape[0]
    last_block.conv2.bias[width - 1] = _BIG
    coder.norm_out.gamma.fill_(_BIG / width**0.5 / _TRUNK)
    coder.norm_out.gamma[width - 1] = 1.0 / width**0.5


def _conv2d_forward(conv, x: torch.Tensor, cache_x=None) -> torch.Tensor:
    """A frame-wise WanCausalConv3d as a 2-D convolution with its current-frame tap."""
    b, c, t, h, w = x.shape
    frames = x.squeeze(2) if t == 1 else x.transpose(1, 2).reshape(b * t, c, h, w)
    pad = (conv._padding[2], conv._padding[0])  # (height, width); the time padding only met zero taps
    y = F.conv2d(frames, conv.weight[:, :, -1], conv.bias, conv.stride[1:], pad)
    return y.unsqueeze(2) if t == 1 else y.reshape(b, t, *y.shape[1:]).transpose(1, 2)


@contextlib.contextmanager
def framewise(vae):
    """Within this block the VAE's causal convolutions run as 2-D convolutions of each frame (the same
    result once :func:`make_framewise` has zeroed their earlier taps, a third of the work of 3×3×3 kernels;
    pass frames as clips of one frame, (N, C, 1, H, W))."""
    convs = _causal_convs(vae)
    for conv in convs:
        conv.forward = types.MethodType(_conv2d_forward, conv)
    try:
        yield
    finally:
        for conv in convs:
            del conv.forward


def _frames(clips: torch.Tensor) -> torch.Tensor:
    """(N, C, F, H, W) -> (N·F, C, 1, H, W), frame by frame."""
    n, c, f, h, w = clips.shape
    return clips.transpose(1, 2).reshape(n * f, c, 1, h, w)


def _clips(frames: torch.Tensor, num_frames: int) -> torch.Tensor:
    """The inverse of :func:`_frames`."""
    nf, c, _, h, w = frames.shape
    return frames.reshape(nf // num_frames, num_frames, c, h, w).transpose(1, 2)


def draw_clip_pool(
    num_clips: int, num_frames: int, seed: int, travel: tuple[float, float] = TRAVEL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clips uint8 (N, 3, F, H, W), index into ``all_moving_scenes()`` (N,)), training scenes cycled evenly
    (every colour, background, shape and direction equally often) in a seeded shuffled order; ``travel``:
    the share of the free room the shape crosses (``scenes.draw_clip``)."""
    index = {s: i for i, s in enumerate(all_moving_scenes())}
    train = train_moving_scenes()
    rng = random.Random(seed)
    order = list(range(len(train)))
    scenes = []
    while len(scenes) < num_clips:
        rng.shuffle(order)
        scenes += [train[i] for i in order]
    scenes = scenes[:num_clips]
    clips = np.stack([draw_clip(s, rng, num_frames, travel=travel) for s in scenes])  # (N, F, H, W, 3)
    return (
        torch.from_numpy(clips).permute(0, 4, 1, 2, 3).contiguous(),
        torch.tensor([index[s] for s in scenes]),
    )


def _posterior(vae, x: torch.Tensor):
    """The VAE's latent distribution of whole clips in one pass. AutoencoderKLWan.encode runs the encoder
    chunk by chunk (1 frame, then 4) with a cache of the causal convolutions' last frames; without temporal
    downsampling one pass over all frames computes the same (causal padding = the empty cache) and is
    far faster to train through."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(vae.quant_conv(vae.encoder(x)))


def _decode(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan.decode in one pass (the same as its frame-by-frame decode here), unclamped."""
    return vae.decoder(vae.post_quant_conv(z))


def shape_weights(x: torch.Tensor, shape_weight: float, threshold: float = 0.05) -> torch.Tensor:
    """Per-pixel loss weights of frames ``x`` (N, C, F, H, W): 1 + ``shape_weight`` where a pixel differs
    (by more than ``threshold`` in some channel) from its frame's top-left pixel (always background: shapes
    stay clear of the border). Pixels in [-1, 1] for the VAE; normalised latents for the transformer. The
    shape is 6-20 % of a frame, and its colour and position are what the scorer reads."""
    differs = (x - x[..., :1, :1]).abs().amax(dim=1, keepdim=True) > threshold
    return 1.0 + shape_weight * differs.float()


def train_vae(vae, frames: torch.Tensor, args, log: _Log) -> None:
    """Pixel MSE weighted on the shape (``--vae-shape-weight``) plus a tiny KL term on batches of single
    frames (uint8 (N, 3, H, W), every frame of every pool clip), AdamW with a cosine schedule, the VAE
    computed frame-wise in 2-D."""
    gen = torch.Generator(device=frames.device).manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    vae.train()
    budget = StepBudget(args.vae_steps, args.vae_time_budget_s, log, "vae")
    total, step = args.vae_steps, 0
    with framewise(vae):
        while step < total:
            for group in opt.param_groups:
                group["lr"] = args.vae_lr * _cosine_lr(step, total, warmup=50)
            idx = torch.randint(len(frames), (args.vae_batch_size,), device=frames.device, generator=gen)
            x = _to_unit(frames[idx]).unsqueeze(2)  # (B, 3, 1, H, W)
            posterior = _posterior(vae, x)
            noise = torch.randn(posterior.mean.shape, device=x.device, generator=gen)
            recon = _decode(vae, posterior.mean + posterior.std * noise)
            err = (recon - x).square()
            weights = shape_weights(x, args.vae_shape_weight)
            loss = (err * weights).mean() / weights.mean() + 1e-6 * posterior.kl().mean()
            _update(opt, loss, vae.parameters())
            if step % 250 == 0 or step == total - 1:
                log(f"vae step {step}/{total} mse {err.mean().item():.5f}")
            step += 1
            total = budget(step)
    args.vae_steps = total
    vae.eval()
    _round_to_fp16(vae)


@torch.no_grad()
def vae_report(vae, num: int = 48, num_frames: int = 9, seed: int = 7) -> str:
    """How many VAE reconstructions of fresh held-out clips the clip scorer reads right: the ceiling of
    what the transformer's samples can score. Computed as shipped, 3-D over whole clips."""
    held = held_out_moving_scenes()
    scenes = [held[i % len(held)] for i in range(num)]
    rng = random.Random(seed)
    clips = torch.from_numpy(np.stack([draw_clip(s, rng, num_frames) for s in scenes]))
    device = next(vae.parameters()).device
    x = _to_unit(clips.permute(0, 4, 1, 2, 3).to(device))
    recon = _decode(vae, _posterior(vae, x).mean)
    right, shapes = _scored_right(recon, scenes)
    return f"VAE reconstructions of {num} held-out clips: all three {right}/{num}, shape {shapes}/{num}"


def _scored_right(recon: torch.Tensor, scenes: list[MovingScene]) -> tuple[int, int]:
    """How many reconstructed clips (N, 3, F, H, W) in [-1, 1] the scorer reads right (all three; shape)."""
    pixels = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()
    right = sum(
        score_clip(c) == (s.background, s.colour, s.direction) for s, c in zip(scenes, pixels, strict=True)
    )
    shapes = sum(clip_shape(c) == s.shape for s, c in zip(scenes, pixels, strict=True))
    return right, shapes


@torch.no_grad()
def training_scenes_right(vae, num: int = 96, num_frames: int = 9, seed: int = 8) -> int:
    """How many reconstructions of fresh clips of training scenes the scorer reads right: what decides
    whether VAE training improved on its start, without looking at held-out scenes. Only the first and last
    frames, all the scorer reads, are coded (frame by frame, in 2-D)."""
    rng = random.Random(seed)
    scenes = rng.sample(train_moving_scenes(), num)
    ends = np.stack([draw_clip(s, rng, num_frames)[[0, -1]] for s in scenes])  # (N, 2, H, W, 3)
    x = _frames(_to_unit(torch.from_numpy(ends).permute(0, 4, 1, 2, 3).to(next(vae.parameters()).device)))
    with framewise(vae):
        recon = _decode(vae, _posterior(vae, x).mean)
    return _scored_right(_clips(recon, 2), scenes)[0]


@torch.no_grad()
def encode_clips(vae, clips: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every clip, (N, C, F, h, w) each (frame-wise, as trained)."""
    means, stds = [], []
    num_frames = clips.shape[2]
    with framewise(vae):
        for i in range(0, len(clips), chunk):
            posterior = _posterior(vae, _frames(_to_unit(clips[i : i + chunk])))
            means.append(_clips(posterior.mean, num_frames))
            stds.append(_clips(posterior.std, num_frames))
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def encode_captions(pipe, captions: list[str], max_sequence_length: int, device) -> torch.Tensor:
    """UMT5 embeddings (N, L, 32) as WanPipeline makes them (zeros past each caption's tokens); the
    captions need no cleaning, so the pipeline's ftfy-based prompt cleaning is skipped."""
    out = []
    for i in range(0, len(captions), 512):
        tokens = pipe.tokenizer(
            captions[i : i + 512],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = pipe.text_encoder(ids, mask).last_hidden_state.float()
        out.append(hidden * mask[..., None])
    return torch.cat(out)


def sample_sigmas(batch: int, device, gen: torch.Generator, shift: float = SHIFT) -> torch.Tensor:
    """Logit-normal sigmas, shifted as FlowMatchEulerDiscreteScheduler(shift) shifts its schedule."""
    u = torch.sigmoid(torch.randn(batch, device=device, generator=gen))
    return shift * u / (1.0 + (shift - 1.0) * u)


_OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def swapped_scenes(kind: str) -> torch.Tensor:
    """For each scene of ``all_moving_scenes()``, the index of the same scene with the opposite direction
    (``kind`` "direction") or the next palette colour that is neither its shape's nor its background's
    (``kind`` "colour")."""
    scenes = all_moving_scenes()
    index = {s: i for i, s in enumerate(scenes)}
    out = []
    for s in scenes:
        if kind == "direction":
            other = MovingScene(s.shape, s.colour, s.background, _OPPOSITE[s.direction])
        else:
            k = COLOURS.index(s.colour)
            colour = next(
                COLOURS[(k + j) % len(COLOURS)]
                for j in range(1, len(COLOURS))
                if COLOURS[(k + j) % len(COLOURS)] != s.background
            )
            other = MovingScene(s.shape, colour, s.background, s.direction)
        out.append(index[other])
    return torch.tensor(out)


@torch.no_grad()
def caption_use(
    transformer,
    x0: torch.Tensor,
    scene_idx: torch.Tensor,
    texts: torch.Tensor,
    sigmas=(0.8, 0.95),
    seed: int = 0,
) -> dict[str, float]:
    """Flow-matching loss of normalised latents ``x0`` (N, C, F, h, w) with their own captions and with the
    direction word, or the shape colour, swapped (``texts``: embeddings of ``all_moving_scenes()``). A model
    that reads a word pays for getting it wrong: a model that films the colours but ignores the direction
    has the same loss with the opposite direction. Same noise for all three, mean over ``sigmas``."""
    was_training = transformer.training
    transformer.eval()
    gen = torch.Generator(device=x0.device).manual_seed(seed)
    scene_idx = scene_idx.to(x0.device)
    swaps = {
        "caption": scene_idx,
        "opposite direction": swapped_scenes("direction").to(x0.device)[scene_idx],
        "other shape colour": swapped_scenes("colour").to(x0.device)[scene_idx],
    }
    totals = dict.fromkeys(swaps, 0.0)
    for sigma in sigmas:
        noise = torch.randn(x0.shape, device=x0.device, generator=gen)
        x_t = (1.0 - sigma) * x0 + sigma * noise
        t = torch.full((len(x0),), sigma * 1000.0, device=x0.device)
        for name, idx in swaps.items():
            pred = transformer(
                hidden_states=x_t, timestep=t, encoder_hidden_states=texts[idx], return_dict=False
            )[0]
            totals[name] += F.mse_loss(pred.float(), noise - x0).item() / len(sigmas)
    transformer.train(was_training)
    return {k: round(v, 4) for k, v in totals.items()}


def frame_shares(args: argparse.Namespace) -> dict[int, float]:
    """Share of transformer steps per frame count: ``--frame-shares`` ("5:0.6,9:0.4") or FRAME_COUNTS'."""
    text = getattr(args, "frame_shares", None)
    if not text:
        return {f: share for f, (share, _) in FRAME_COUNTS.items()}
    shares = {}
    for part in text.split(","):
        frames, _, share = part.partition(":")
        if int(frames) not in FRAME_COUNTS or float(share) < 0:
            raise ValueError(
                f"--frame-shares: {part!r}: frame counts are {sorted(FRAME_COUNTS)}, shares >= 0"
            )
        shares[int(frames)] = float(share)
    if sum(shares.values()) <= 0:
        raise ValueError("--frame-shares: some share must be positive")
    return shares


def train_transformer(pipe, pools: dict, args, log: _Log) -> list[float]:
    """Flow matching on normalised latents, a frame count drawn per step; returns the loss every 100 steps."""
    device = next(iter(pools.values()))[0].device
    transformer = pipe.transformer
    vae_cfg = pipe.vae.config
    num_scenes = len(all_moving_scenes())
    captions = [s.caption for s in all_moving_scenes()] + [""]  # index num_scenes = the empty prompt
    lengths = (T5_MAX_LENGTH, LONG_T5_LENGTH) if args.long_text_fraction > 0 else (T5_MAX_LENGTH,)
    texts = {length: encode_captions(pipe, captions, length, device) for length in lengths}
    shape = (1, LATENT_CHANNELS, 1, 1, 1)
    mean = torch.tensor(vae_cfg.latents_mean, device=device).view(shape)
    std = torch.tensor(vae_cfg.latents_std, device=device).view(shape)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M params")

    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    step_rng = random.Random(args.seed + 3)
    shares = frame_shares(args)
    frame_counts = sorted(f for f in pools if shares.get(f, 0.0) > 0)
    weights = [shares[f] for f in frame_counts]
    reversed_direction = swapped_scenes("direction").to(device)  # scene index -> its reversed twin
    opt = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.01)
    transformer.train()
    # --compile: the training forward through torch.compile (the tiny model's step is launch-bound; fused
    # kernels cut its launches); it shares the module's parameters, so saving and evaluating are unchanged.
    forward = torch.compile(transformer) if getattr(args, "compile", False) else transformer
    losses, running, since = [], 0.0, 0
    budget = StepBudget(args.steps, args.time_budget_s, log, "transformer")
    total, step = args.steps, 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = args.lr * _cosine_lr(step, total, warmup=min(200, total // 10 + 1))
        frames = step_rng.choices(frame_counts, weights)[0]
        means, stds, scene_idx = pools[frames]
        b = args.batch_size
        idx = torch.randint(len(means), (b,), device=device, generator=gen)
        z = means[idx] + stds[idx] * torch.randn(means[idx].shape, device=device, generator=gen)
        x0 = (z - mean) / std
        cond = scene_idx[idx]
        drop = torch.rand(b, device=device, generator=gen) < args.caption_dropout
        cond = torch.where(drop, torch.full_like(cond, num_scenes), cond)
        length = LONG_T5_LENGTH if step_rng.random() < args.long_text_fraction else T5_MAX_LENGTH
        sigma = sample_sigmas(b, device, gen, shift=getattr(args, "sigma_shift", SHIFT))
        noise = torch.randn(x0.shape, device=device, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1.0 - s) * x0 + s * noise
        try:
            pred = forward(
                hidden_states=x_t,
                timestep=sigma * 1000.0,  # WanPipeline passes the scheduler's timesteps, 1000·sigma
                encoder_hidden_states=texts[length][cond],
                return_dict=False,
            )[0]
        except Exception as exc:  # noqa: BLE001 - a compiler failure: train on, eagerly
            if forward is transformer:
                raise
            log(f"--compile: the compiled forward failed ({type(exc).__name__}: {exc}); training eagerly")
            forward = transformer
            pred = forward(
                hidden_states=x_t,
                timestep=sigma * 1000.0,
                encoder_hidden_states=texts[length][cond],
                return_dict=False,
            )[0]
        if args.shape_loss_weight > 0:
            loss_weights = shape_weights(x0, args.shape_loss_weight, LATENT_SHAPE_THRESHOLD)
            loss = ((pred - (noise - x0)).square() * loss_weights).mean() / loss_weights.mean()
        else:
            loss = F.mse_loss(pred, noise - x0)
        if getattr(args, "direction_contrast", 0.0) > 0 and bool((~drop).any()):
            # The same noisy clips under their caption with the direction reversed: a hard negative, itself
            # the caption of other clips, so the model cannot just make it draw badly.
            keep = ~drop
            pred_reversed = forward(
                hidden_states=x_t[keep],
                timestep=sigma[keep] * 1000.0,
                encoder_hidden_states=texts[length][reversed_direction[cond[keep]]],
                return_dict=False,
            )[0]
            target = (noise - x0)[keep]
            own = (pred[keep] - target).square().flatten(1).mean(1)
            other = (pred_reversed - target).square().flatten(1).mean(1)
            loss = loss + args.direction_contrast * F.relu(DIRECTION_MARGIN + own - other).mean()
        _update(opt, loss, transformer.parameters())
        running += loss.detach()  # no .item() per step: it would sync the GPU every step
        since += 1
        if step % 100 == 99 or step == total - 1:
            losses.append(round((running / since).item(), 4))
            running, since = 0.0, 0
        if step % 500 == 0 or step == total - 1:
            log(
                f"transformer step {step}/{total} loss {loss.item():.4f} ({frames} frames, T5 length {length})"
            )
        step += 1
        total = budget(step)
    args.steps = total
    transformer.eval()
    _round_to_fp16(transformer)
    frames = 9 if 9 in pools else max(pools)
    means, _, scene_idx = pools[frames]
    x0_eval = (means[:256] - mean) / std
    args.caption_use = caption_use(transformer, x0_eval, scene_idx[:256], texts[T5_MAX_LENGTH])
    log(
        f"transformer loss on {frames}-frame training clips (sigma 0.8, 0.95) with: {json.dumps(args.caption_use)}"
    )
    for sigma in (0.5, 0.9, 0.99):
        use = caption_use(transformer, x0_eval, scene_idx[:256], texts[T5_MAX_LENGTH], sigmas=(sigma,))
        log(f"  at sigma {sigma}: {json.dumps(use)}")
    return losses


@torch.no_grad()
def generate_clips(
    pipe,
    scenes: list[MovingScene],
    *,
    seed: int = 0,
    num_frames: int = SAMPLING["num_frames"],
    num_inference_steps: int = SAMPLING["num_inference_steps"],
    guidance_scale: float = SAMPLING["guidance_scale"],
    max_sequence_length: int = SAMPLING["max_sequence_length"],
    batch_size: int = 32,
) -> list[np.ndarray]:
    """One uint8 clip (F, H, W, 3) per scene (seed + i for the i-th, CPU generators as ditserve seeds)."""
    device = pipe.transformer.device
    negative = encode_captions(pipe, [""], max_sequence_length, device)
    clips = []
    for start in range(0, len(scenes), batch_size):
        chunk = scenes[start : start + batch_size]
        embeds = encode_captions(pipe, [s.caption for s in chunk], max_sequence_length, device)
        video = pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative.expand(len(chunk), -1, -1),
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            # WanPipeline makes num_frames "factor·k + 1" by adding one frame whenever num_frames % factor != 1,
            # which with this VAE's factor 1 is always; ditserve's runner makes exactly num_frames.
            num_frames=num_frames - 1,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=[torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))],
            output_type="np",
        ).frames
        clips += [(np.asarray(v) * 255).round().clip(0, 255).astype(np.uint8) for v in video]
    return clips


def evaluate(pipe, scenes: list[MovingScene], *, seeds: int, **sampling) -> dict:
    """Fractions of clips whose background, shape colour, direction (all three) and shape are right."""
    counts = {"all_three": 0, "background": 0, "shape_colour": 0, "direction": 0, "shape": 0}
    total = 0
    for k in range(seeds):
        for scene, clip in zip(scenes, generate_clips(pipe, scenes, seed=1000 * k, **sampling), strict=True):
            background, colour, direction = score_clip(clip)
            counts["background"] += background == scene.background
            counts["shape_colour"] += colour == scene.colour
            counts["direction"] += direction == scene.direction
            counts["all_three"] += (background, colour, direction) == (
                scene.background,
                scene.colour,
                scene.direction,
            )
            counts["shape"] += clip_shape(clip) == scene.shape
            total += 1
    return {"clips": total, **{k: f"{v}/{total}" for k, v in counts.items()}}


EVAL_SETTINGS: tuple[tuple[str, dict], ...] = (
    ("9 frames, 20 steps, CFG 5", {}),
    ("5 frames, 8 steps, CFG 5", {"num_frames": 5, "num_inference_steps": 8}),
    ("17 frames, 20 steps, CFG 5", {"num_frames": 17}),
    ("9 frames, 20 steps, no CFG", {"guidance_scale": 1.0}),
    ("9 frames, 20 steps, CFG 5, T5 length 512", {"max_sequence_length": 512}),
)


def evaluate_settings(pipe, args: argparse.Namespace, log: _Log) -> dict[str, dict]:
    scenes = held_out_moving_scenes()[: args.eval_scenes]
    settings = EVAL_SETTINGS if args.device == "cuda" else EVAL_SETTINGS[:2]
    results = {}
    for name, overrides in settings:
        results[f"held-out, {name}"] = evaluate(pipe, scenes, seeds=args.eval_seeds, **overrides)
        log(f"held-out, {name}: {json.dumps(results[f'held-out, {name}'])}")
    train = train_moving_scenes()
    sample = train[:: max(1, len(train) // len(scenes))][: len(scenes)]
    name = f"training captions, {EVAL_SETTINGS[0][0]}"
    results[name] = evaluate(pipe, sample, seeds=1)
    log(f"{name}: {json.dumps(results[name])}")
    return results


_OPTIONS = (
    "out init_from steps vae_init vae_steps batch_size vae_batch_size lr vae_lr vae_shape_weight caption_dropout "
    "long_text_fraction patch_size num_layers travel pool_scale shape_loss_weight frame_shares sigma_shift "
    "direction_contrast compile device seed "
    "eval_scenes eval_seeds"
).split()


def _command(args: argparse.Namespace) -> str:
    parts = ["ditserve", "train-demo-video"]
    for key, value in vars(args).items():
        if isinstance(value, bool):
            parts += [f"--{key.replace('_', '-')}"] if key in _OPTIONS and value else []
        elif key in _OPTIONS and value is not None:
            values = value if isinstance(value, (list, tuple)) else [value]
            parts += [f"--{key.replace('_', '-')}", *(str(v) for v in values)]
    return shlex.join(parts)


def _model_card(args, command: str, seconds: float, machine: str, results: dict, losses: list[float]) -> str:
    import diffusers

    held = ", ".join(f'"{s.caption}"' for s in held_out_moving_scenes())
    rows = "\n".join(
        f"| {name} | {r['clips']} | {r['all_three']} | {r['background']} | {r['shape_colour']} | "
        f"{r['direction']} | {r['shape']} |"
        for name, r in results.items()
    )
    shares = frame_shares(args)
    pools = ", ".join(
        f"{max(8, int(n * args.pool_scale))} clips of {f} frames"
        for f, (_, n) in FRAME_COUNTS.items()
        if shares.get(f, 0.0) > 0
    )
    layers = getattr(args, "num_layers", None) or TRANSFORMER_CONFIG["num_layers"]
    travel = tuple(getattr(args, "travel", None) or TRAVEL)
    init_from = getattr(args, "init_from", None)
    earlier = f"; continued from {init_from}" if init_from else ""
    vae = (
        "VAE from the run continued (not trained further)"
        if init_from
        else f"VAE from its {args.vae_init} init, {args.vae_steps} steps × {args.vae_batch_size} frames (frame-wise; "
        f"shape pixels weighted {1 + args.vae_shape_weight:g}×)"
    )
    return f"""# demo-scenes-video

A tiny Wan-architecture text-to-video pipeline (WanPipeline: WanTransformer3DModel with {layers} blocks of
{TRANSFORMER_CONFIG["num_attention_heads"]} heads × {TRANSFORMER_CONFIG["attention_head_dim"]}, patch {tuple(args.patch_size or TRANSFORMER_CONFIG["patch_size"])}; AutoencoderKLWan with 4 latent channels, 8× spatial and no temporal compression, frame by frame; the
random-weight frozen tiny UMT5) trained on synthetic 64×64 clips: one circle, square or triangle in one of
12 colours crossing a background of another colour, left, right, up or down
("a red circle moving left on a blue background"). It exists so that ditserve's default video model films
what it is asked. Weights are stored in fp16; load in fp32:
`WanPipeline.from_pretrained(path, torch_dtype=torch.float32)`.

## Sampling that works
64×64, the frame counts it was trained on ({", ".join(str(f) for f in sorted(shares) if shares[f] > 0)}; the shape crosses the picture over the clip),
`num_inference_steps={SAMPLING["num_inference_steps"]}` (8 is enough), `guidance_scale={SAMPLING["guidance_scale"]}`
(ditserve's default for Wan) with the negative prompt "", `max_sequence_length={SAMPLING["max_sequence_length"]}`
(what ditserve uses; WanPipeline's default 512 was trained on {args.long_text_fraction:.0%} of steps).

{prompts_card_section(moving=True)}
## Training
- command: `{command}`
- machine: {machine}; diffusers {diffusers.__version__}
- wall time: {seconds:.0f} s (drawing, VAE, transformer, evaluation)
- {vae}; transformer {args.steps} steps ×
  {args.batch_size}, AdamW {args.lr} cosine, {args.caption_dropout:.0%} empty captions, T5 length 512 on
  {args.long_text_fraction:.0%} of steps; pools of {pools} (the shape crossing {travel[0]:.0%}-{travel[1]:.0%} of
  the free room); steps per frame count {shares};
  shape latents weighted {1 + args.shape_loss_weight:g}× in the loss; training sigmas shifted by
  {getattr(args, "sigma_shift", SHIFT):g} (the sampler's flow shift {SHIFT}); direction contrast
  {getattr(args, "direction_contrast", 0.0):g} (margin {DIRECTION_MARGIN}); seed {args.seed}{earlier}
- loss every 100 steps: {losses}{_earlier_run(init_from)}
- loss on training clips (sigma 0.8 and 0.95) with their caption, with the direction reversed and with
  another shape colour (a word the model reads costs loss when wrong): {json.dumps(getattr(args, "caption_use", {}))}

## Held-out accuracy
Scored by `ditserve.replica.models.scorer.score_clip` (background and shape colour from the first and last
frames, direction from how the shape's centre moved between them; shape from the first frame),
{args.eval_seeds} seed(s) per prompt, on held-out captions never drawn in training (last row: training
captions, one seed). fp16 weights loaded in fp32, CPU generators seeded 0, 1, … (and 1000, 1001, …).

| setting | clips | all three | background | shape colour | direction | shape |
|---|---|---|---|---|---|---|
{rows or "| not evaluated (--eval-scenes 0) | | | | | | |"}

Held-out captions: {held}.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--out", type=Path, required=True, help="folder to write the diffusers pipeline to")
    parser.add_argument("--steps", type=int, default=6000, help="transformer training steps")
    parser.add_argument(
        "--vae-init",
        choices=("analytic", "random"),
        default="analytic",
        help="the VAE's starting point: colours of 8×8 blocks set by hand (analytic_init) or random weights",
    )
    parser.add_argument("--vae-steps", type=int, default=2000, help="VAE training steps (0: keep the start)")
    parser.add_argument("--batch-size", type=int, default=512, help="transformer batch size (clips)")
    parser.add_argument(
        "--vae-batch-size", type=int, default=128, help="VAE batch size (single frames of different clips)"
    )
    parser.add_argument("--lr", type=float, default=5e-4, help="transformer peak learning rate")
    parser.add_argument("--vae-lr", type=float, default=3e-3, help="VAE peak learning rate")
    parser.add_argument(
        "--vae-shape-weight",
        type=float,
        default=2.0,
        help="extra weight of the shape's pixels in the VAE's reconstruction loss (0: plain MSE)",
    )
    parser.add_argument(
        "--pool-scale", type=float, default=1.0, help="scale of the clip pools (smoke runs, or more clips)"
    )
    parser.add_argument(
        "--travel",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help=f"share of the free room the shape crosses in a training clip, drawn from [LO, HI] (default "
        f"{TRAVEL[0]} {TRAVEL[1]}: from near one side to near the other, so where the shape starts tells the "
        "direction; 0.6 1.0 starts some clips further in)",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help=f"the transformer's blocks (default {TRANSFORMER_CONFIG['num_layers']})",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from a saved demo-scenes-video folder: its VAE (not trained further), frozen text encoder "
        "and transformer",
    )
    parser.add_argument(
        "--patch-size",
        type=int,
        nargs=3,
        metavar=("T", "H", "W"),
        default=None,
        help=f"the transformer's patch (default {TRANSFORMER_CONFIG['patch_size']}; 1 1 1: a token per latent "
        "pixel, four times the tokens, the shape's motion a token or so a frame instead of half a token)",
    )
    parser.add_argument(
        "--shape-loss-weight",
        type=float,
        default=0.0,
        help="extra weight of the shape's latents in the transformer's flow-matching loss (0: plain MSE)",
    )
    parser.add_argument(
        "--frame-shares",
        default=None,
        help='share of transformer steps per frame count, e.g. "5:0.6,9:0.4" (default: '
        + ",".join(f"{f}:{share}" for f, (share, _) in FRAME_COUNTS.items())
        + ")",
    )
    parser.add_argument(
        "--caption-dropout", type=float, default=0.1, help="share of empty captions (for CFG)"
    )
    parser.add_argument(
        "--direction-contrast",
        type=float,
        default=0.0,
        help="weight of a margin loss that asks each clip's loss with its caption to be DIRECTION_MARGIN below "
        "its loss with the direction reversed (an extra forward of the captioned clips; 0: off)",
    )
    parser.add_argument(
        "--sigma-shift",
        type=float,
        default=TRAIN_SIGMA_SHIFT,
        help=f"shift of the training sigmas' logit-normal (default {TRAIN_SIGMA_SHIFT}; the sampler's is {SHIFT}): larger trains "
        "more steps at high noise, where a clip's trajectory (and so the direction word) is decided",
    )
    parser.add_argument(
        "--long-text-fraction",
        type=float,
        default=0.0,
        help="share of steps with T5 length 512 instead of 32",
    )
    parser.add_argument(
        "--time-budget-s", type=float, default=0, help="cut the transformer's steps to fit (0: no limit)"
    )
    parser.add_argument("--vae-time-budget-s", type=float, default=0, help="the same for the VAE's steps")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="train the transformer through torch.compile (faster steps on a GPU; eager if it fails)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=default_device,
        help=f"default: {default_device} on this machine",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the data, the initial weights and training (default 0)"
    )
    parser.add_argument(
        "--eval-scenes",
        type=int,
        default=len(held_out_moving_scenes()),
        help="held-out prompts scored (0: none)",
    )
    parser.add_argument("--eval-seeds", type=int, default=1, help="clips per held-out prompt")


def run(args: argparse.Namespace) -> Path:
    """Train, save to ``args.out`` (diffusers format, fp16), evaluate held-out prompts, write README.md."""
    from diffusers import WanPipeline

    log = _Log()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; pass --device cpu")
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    np.random.seed(args.seed)

    init_from = getattr(args, "init_from", None)
    if init_from is not None:
        # The earlier run's transformer shape unless asked otherwise (its weights must then fit).
        earlier = json.loads((Path(init_from) / "transformer" / "config.json").read_text())
        args.patch_size = args.patch_size or list(earlier["patch_size"])
        args.num_layers = args.num_layers or earlier["num_layers"]
    pipe = build_video_pipeline_untrained(args.seed, args.patch_size, getattr(args, "num_layers", None))
    if init_from is not None:
        # The frozen text encoder too: the transformer was trained on its embeddings, and a fresh one (its
        # random weights follow --seed) would make it learn every caption again.
        load_weights(pipe, init_from, ("vae", "transformer"))
        pipe.text_encoder = type(pipe.text_encoder).from_pretrained(
            Path(init_from) / "text_encoder", dtype=torch.float32
        )
        log(f"started from the VAE, transformer and text encoder of {init_from}")
        args.vae_steps = 0
    elif args.vae_init == "analytic":
        analytic_init(pipe.vae)
    pipe.to(device)
    pipe.text_encoder.requires_grad_(False)
    travel = tuple(getattr(args, "travel", None) or TRAVEL)
    # Pools for the frame counts trained on, and the 9-frame one the latent statistics and the loss report use.
    shares = frame_shares(args)
    sizes = {
        f: max(8, int(n * args.pool_scale))
        for f, (_, n) in FRAME_COUNTS.items()
        if shares.get(f, 0.0) > 0 or f == 9
    }
    clips = {f: draw_clip_pool(n, f, args.seed + f, travel) for f, n in sizes.items()}
    log(f"drew {sizes} clips of {len(train_moving_scenes())} training scenes")

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest 2-D convolutions
    if args.vae_steps > 0:
        vae_frames = torch.cat([_frames(pixels)[:, :, 0] for pixels, _ in clips.values()]).to(device)
    start = None
    if args.vae_init == "analytic" and args.vae_steps > 0:
        # A learning rate too high for the hand-set start scrambles it within ~100 steps: keep the start if
        # training reads clearly fewer training clips right (1 in 24 is noise).
        start = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
        start_right = training_scenes_right(pipe.vae)
    if args.vae_steps > 0:
        train_vae(pipe.vae, vae_frames, args, log)
        del vae_frames
    if start is not None:
        trained_right = training_scenes_right(pipe.vae)
        log(
            "VAE reconstructions of 96 training-scene clips read right: "
            f"start {start_right}, trained {trained_right}"
        )
        if trained_right < start_right - 4:
            pipe.vae.load_state_dict(start)
            log("VAE training read fewer clips right than its analytic start: keeping the start")
        del start
    log(vae_report(pipe.vae))
    pipe.vae.requires_grad_(False)
    pools = {}
    for f, (pixels, scene_idx) in clips.items():
        means, stds = encode_clips(pipe.vae, pixels.to(device))
        pools[f] = (means, stds, scene_idx.to(device))
    if init_from is None:
        means, stds = pools[9][0], pools[9][1]
        sample = means + stds * torch.randn(
            means.shape, device=device, generator=torch.Generator(device).manual_seed(0)
        )
        channel_mean = sample.mean(dim=(0, 2, 3, 4))
        channel_std = sample.std(dim=(0, 2, 3, 4))
        pipe.vae.register_to_config(
            latents_mean=[round(v, 4) for v in channel_mean.tolist()],
            latents_std=[round(v, 4) for v in channel_std.tolist()],
        )
    log(f"vae latents: mean {pipe.vae.config.latents_mean}, std {pipe.vae.config.latents_std}")
    del clips

    losses = train_transformer(pipe, pools, args, log)
    del pools

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.to(torch.float16).save_pretrained(out)
    name_tokenizers_generic(out)
    # ditserve reads the size trained on beside the weights: a request without one gets 64×64, not Wan's 832×480.
    size = {"width": IMAGE_SIZE, "height": IMAGE_SIZE}
    (out / "ditserve.json").write_text(json.dumps({"sampling": size}, indent=2) + "\n")
    log(f"saved {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB)")

    results: dict[str, dict] = {}
    if args.eval_scenes > 0:
        pipe = WanPipeline.from_pretrained(out, dtype=torch.float32).to(device)
        pipe.set_progress_bar_config(disable=True)
        results = evaluate_settings(pipe, args, log)
    seconds = time.perf_counter() - log.start
    card = _model_card(args, _command(args), seconds, _machine(device), results, losses)
    (out / "README.md").write_text(card)
    log(f"done in {seconds:.0f} s")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m ditserve.replica.models.train_demo_video", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
