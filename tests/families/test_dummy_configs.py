"""Folders built the way diffusers' own pipeline tests build theirs (``get_dummy_components``): their
transformer and VAE configs, which differ from ours (patch size 1, one block, 2 or 3 heads, tiny joint
dims, VAEs of one or two blocks, FLUX.1 and Kontext without a guidance embedding, Wan I2V's image_dim
without added_kv_proj_dim), with tiny text encoders made offline in place of the hf-internal-testing
downloads (widths matching the transformer). On each folder (SD3, FLUX.1, Kontext, FLUX.2, Klein,
Qwen-Image, Z-Image, Wan 2.1, Wan 2.2 A14B and TI2V-5B, Wan I2V, HunyuanVideo 1.5) one rank gives the
family's diffusers pipeline image or video at the size diffusers' tests use and at a non-square one; the
layouts the config admits give the one-rank output (one per family by default, the rest -m slow); the
layouts it does not admit (3 heads over ulysses 2, 85 MLP features over tp 2) are refused naming the flag."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ditserve.replica.config import EngineConfig
from ditserve.replica.media import decode_mp4, encode_mp4
from ditserve.replica.request import GenerationParams
from ditserve.replica.worker import RankWorker
from tests.families.harness import (
    cli_generate,
    layout_id,
    load_pipeline,
    pipeline_output,
    results,
    running_engine,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.helpers import png_pixels, psnr

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------
# Folders: diffusers' dummy transformer and VAE configs, our offline text encoders and tokenizers.


def _sd3(path: Path) -> Path:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from tests.families import sd3

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    base = sd3.build_pipeline("tiny")
    # the CLIPs' hidden states side by side fill the joint dim, their projections the pooled dim
    parts = base.components | {
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": sd3._clip(base.tokenizer, 16, 32),
        "text_encoder_2": sd3._clip(base.tokenizer_2, 16, 32),
        "text_encoder_3": sd3._t5(base.tokenizer_3, 32),
    }
    StableDiffusion3Pipeline(**parts).save_pretrained(path)
    return path


def _flux2_parts(klein: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from tests.families import flux2

    torch.manual_seed(0)
    # diffusers' joint_attention_dim is 16 for one text layer (its tests pass text_encoder_out_layers=(1,));
    # the pipelines' default reads three layers of the 16-wide encoders: 48
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4], guidance_embeds=not klein,
    )  # fmt: skip
    vae = AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    tokenizer = flux2.build_tokenizer("qwen" if klein else "mistral")
    encoder = flux2.build_qwen3(len(tokenizer)) if klein else flux2.build_mistral3(len(tokenizer))
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": vae,
        "text_encoder": encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def _flux2(path: Path) -> Path:
    from diffusers import Flux2Pipeline

    Flux2Pipeline(**_flux2_parts(klein=False)).save_pretrained(path)
    return path


def _klein(path: Path) -> Path:
    from diffusers import Flux2KleinPipeline

    Flux2KleinPipeline(**_flux2_parts(klein=True), is_distilled=False).save_pretrained(path)
    return path


def _qwenimage(path: Path) -> Path:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from tests.families import qwenimage

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    tokenizer = qwenimage.build_tokenizer()
    QwenImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=qwenimage.build_text_encoder(tokenizer, hidden_size=16, num_heads=2),
        tokenizer=tokenizer,
    ).save_pretrained(path)
    return path


def _zimage(path: Path) -> Path:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    from tests.families import zimage
    from tests.families.flux2 import build_tokenizer

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )  # fmt: skip
    with torch.no_grad():  # torch.empty in diffusers (its test sets them to ones as well)
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
    )  # fmt: skip
    tokenizer = build_tokenizer("qwen")
    ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=zimage._text_encoder(len(tokenizer), 16),
        tokenizer=tokenizer,
        transformer=transformer,
    ).save_pretrained(path)
    return path


def _flux(path: Path, vae_blocks: int = 1, kontext: bool = False) -> Path:
    """diffusers' FLUX.1 (or Kontext) test folder; ``vae_blocks``: its VAE's blocks (1: no downsampling)."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from ditserve.replica.models.demo import _tiny_clip, _tiny_t5
    from ditserve.replica.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    torch.manual_seed(0)
    # guidance_embeds left at its default (False), as diffusers' test leaves it
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,) * vae_blocks,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks, up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer(model_max_length=48)
    pipeline = diffusers.FluxKontextPipeline if kontext else diffusers.FluxPipeline
    pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=_tiny_clip(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_t5(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    ).save_pretrained(path)
    return path


def _kontext(path: Path, vae_blocks: int = 1) -> Path:
    return _flux(path, vae_blocks, kontext=True)


def _wan_transformer(in_channels: int = 16, out_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=out_channels, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra,
    )  # fmt: skip


def _wan_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def _wan_text():
    from ditserve.replica.models.tokenizers import build_t5_tokenizer
    from tests.families.wan22 import tiny_text_encoder

    tokenizer = build_t5_tokenizer(model_max_length=16)
    return {"tokenizer": tokenizer, "text_encoder": tiny_text_encoder(tokenizer, d_model=32)}


def _wan21(path: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    WanPipeline(
        transformer=_wan_transformer(), vae=_wan_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        **_wan_text(),
    ).save_pretrained(path)  # fmt: skip
    return path


def _wan22(path: Path) -> Path:
    from diffusers import WanPipeline

    from tests.families.wan22 import scheduler

    WanPipeline(
        transformer=_wan_transformer(), transformer_2=_wan_transformer(), boundary_ratio=0.875, vae=_wan_vae(),
        scheduler=scheduler(3.0), **_wan_text(),
    ).save_pretrained(path)  # fmt: skip
    return path


def _wan22_5b(path: Path) -> Path:
    from diffusers import AutoencoderKLWan, WanPipeline

    from tests.families.wan22 import scheduler

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
    )  # fmt: skip
    WanPipeline(
        transformer=_wan_transformer(48, 48), vae=vae, scheduler=scheduler(3.0), expand_timesteps=True,
        **_wan_text(),
    ).save_pretrained(path)  # fmt: skip
    return path


def _wan_i2v(path: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    # image_dim without added_kv_proj_dim, as diffusers' test: the image tokens go through attn2's own
    # projections with the text
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            intermediate_size=16, patch_size=1,
        )
    )  # fmt: skip
    WanImageToVideoPipeline(
        transformer=_wan_transformer(36, 16, image_dim=4), vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), image_encoder=encoder,
        image_processor=CLIPImageProcessor(crop_size=32, size=32), **_wan_text(),
    ).save_pretrained(path)  # fmt: skip
    return path


def _hunyuan(path: Path) -> Path:
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance

    from tests.families import hunyuanvideo15 as hv

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v",
    )  # fmt: skip
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False,
    )  # fmt: skip
    tokenizer = hv.build_qwen_tokenizer()
    tokenizer_2, text_encoder_2 = hv._byt5(32, 2)
    HunyuanVideo15Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=hv._qwen(tokenizer, hidden=16, layers=2, heads=2, kv_heads=2, intermediate=16),
        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
    ).save_pretrained(path)  # fmt: skip
    return path


# ---------------------------------------------------------------------------------------------------------
# What each family is asked, and how its diffusers pipeline is called for the same request.


@dataclass(frozen=True)
class Case:
    build: Any
    pipeline: str  # diffusers class name
    square: GenerationParams  # the size diffusers' test uses
    wide: GenerationParams  # a non-square size
    call: dict[str, Any] = field(default_factory=dict)  # extra pipeline kwargs
    engine: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    layouts: tuple[dict, ...] = ()  # admitted: equal one rank (the first by default, the rest slow)
    refused: tuple[tuple[dict, str], ...] = ()  # (layout, flag the refusal names)


def _params(width: int, height: int, **kw) -> GenerationParams:
    return GenerationParams(width=width, height=height, num_inference_steps=2, seed=0, **kw)


SQUIRREL = "A painting of a squirrel eating a burger"
CASES: dict[str, Case] = {
    "sd3": Case(
        _sd3,
        "StableDiffusion3Pipeline",
        _params(32, 32, prompt=SQUIRREL, negative_prompt="blurry", guidance_scale=5.0),
        _params(37, 23, prompt=SQUIRREL, guidance_scale=5.0),
        call={"max_sequence_length": 16},
        engine={"max_sequence_length": 16},
        layouts=(
            {"tp_size": 2, "cfg_parallel_size": 2},
            {"ulysses_degree": 2, "ring_degree": 2},
            {"ulysses_degree": 4},
        ),
    ),
    "flux2": Case(
        _flux2,
        "Flux2Pipeline",
        _params(32, 32, prompt="a dog is dancing", guidance_scale=5.0),
        _params(56, 24, prompt="a dog is dancing", guidance_scale=5.0),
        call={"max_sequence_length": 64},
        engine={"max_sequence_length": 64},
        layouts=({"ulysses_degree": 2, "ring_degree": 2}, {"tp_size": 2}),
        refused=(({"cfg_parallel_size": 2}, "--cfg-parallel-size"),),
    ),
    "klein": Case(
        _klein,
        "Flux2KleinPipeline",
        _params(32, 32, prompt="a dog is dancing", guidance_scale=4.0),
        _params(56, 24, prompt="a dog is dancing", guidance_scale=4.0),
        call={"max_sequence_length": 64},
        engine={"max_sequence_length": 64},
        layouts=({"tp_size": 2, "cfg_parallel_size": 2}, {"ulysses_degree": 2, "ring_degree": 2}),
    ),
    "qwenimage": Case(
        _qwenimage,
        "QwenImagePipeline",
        _params(32, 32, prompt="dance monkey", negative_prompt="bad quality", true_cfg_scale=4.0),
        _params(48, 24, prompt="dance monkey", negative_prompt="bad quality", true_cfg_scale=4.0),
        call={"max_sequence_length": 16},
        engine={"max_sequence_length": 16},
        layouts=({"ring_degree": 2, "cfg_parallel_size": 2},),
        refused=(({"ulysses_degree": 2}, "--ulysses-degree"), ({"tp_size": 2}, "--tp-size")),
    ),
    "zimage": Case(
        _zimage,
        "ZImagePipeline",
        _params(32, 32, prompt="dance monkey", negative_prompt="bad quality", guidance_scale=3.0),
        _params(48, 16, prompt="dance monkey", negative_prompt="bad quality", guidance_scale=3.0),
        call={"max_sequence_length": 16},
        engine={"max_sequence_length": 16},
        layouts=({"ulysses_degree": 2, "cfg_parallel_size": 2}, {"ring_degree": 2}),
        # 85 MLP features (dim 32 × 8/3) do not split over 2 ranks
        refused=(({"tp_size": 2}, "--tp-size"),),
    ),
    "flux": Case(
        _flux,
        "FluxPipeline",
        _params(32, 32, prompt=SQUIRREL, guidance_scale=5.0),
        _params(40, 24, prompt=SQUIRREL, negative_prompt="bad quality", true_cfg_scale=2.0),
        call={"max_sequence_length": 48},
        engine={"max_sequence_length": 48},
        layouts=({"ring_degree": 2, "cfg_parallel_size": 2}, {"ulysses_degree": 2}, {"tp_size": 2}),
    ),
    "kontext": Case(
        _kontext,
        "FluxKontextPipeline",
        _params(32, 32, prompt=SQUIRREL, guidance_scale=5.0),
        _params(40, 24, prompt=SQUIRREL, negative_prompt="bad quality", true_cfg_scale=2.0),
        call={"max_sequence_length": 48},
        engine={"max_sequence_length": 48},
        layouts=({"ulysses_degree": 2, "cfg_parallel_size": 2}, {"ring_degree": 2}, {"tp_size": 2}),
    ),
}


def _first_frame(width: int, height: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (width, height), (30, 60, 90))
    image.paste((220, 40, 20), (width // 4, height // 6, 3 * width // 4, 5 * height // 6))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _video(width: int, height: int, **kw) -> GenerationParams:
    fields = {"prompt": "dance monkey", "negative_prompt": "negative", "guidance_scale": 6.0, **kw}
    return _params(width, height, num_frames=9, **fields)


def _wan_case(build, pipeline: str, square: int, wide: tuple[int, int], **kw) -> Case:
    i2v = {"images": (_first_frame(40, 30),)} if pipeline == "WanImageToVideoPipeline" else {}
    return Case(
        build,
        pipeline,
        _video(square, square, **i2v),
        _video(*wide, **i2v),
        call={"max_sequence_length": 16},
        engine={"max_sequence_length": 16},
        **kw,
    )


WAN_LAYOUTS = ({"ulysses_degree": 2, "cfg_parallel_size": 2}, {"ring_degree": 2}, {"tp_size": 2})
CASES.update(
    {
        "wan21": _wan_case(_wan21, "WanPipeline", 16, (48, 16), layouts=WAN_LAYOUTS),
        "wan22": _wan_case(_wan22, "WanPipeline", 16, (32, 48), layouts=WAN_LAYOUTS[1:]),
        "wan22_5b": _wan_case(_wan22_5b, "WanPipeline", 32, (64, 32), layouts=WAN_LAYOUTS[1:]),
        "wan_i2v": _wan_case(_wan_i2v, "WanImageToVideoPipeline", 32, (48, 32), layouts=WAN_LAYOUTS),
        "hunyuan": Case(
            _hunyuan,
            "HunyuanVideo15Pipeline",
            _video(16, 16, guidance_scale=1.0),
            _video(24, 16, guidance_scale=4.0),
            layouts=({"ulysses_degree": 2, "cfg_parallel_size": 2}, {"ring_degree": 2}, {"tp_size": 2}),
        ),
    }
)


def diffusers_output(pipe, p: GenerationParams, call: dict[str, Any]) -> np.ndarray:
    """The pipeline's uint8 image (H, W, 3) or frames (F, H, W, 3) for ``p``."""
    fields = ("negative_prompt", "guidance_scale", "true_cfg_scale")
    kwargs = {k: getattr(p, k) for k in fields if k in p.model_fields_set} | call
    if type(pipe).__name__ == "FluxKontextPipeline":
        kwargs["max_area"] = p.width * p.height  # the requested size as is (not ~1024²)
    if type(pipe).__name__.startswith("HunyuanVideo15"):
        pipe.guider.guidance_scale = kwargs.pop("guidance_scale")  # its scale is its guider's
    if p.num_frames > 1:
        kwargs["num_frames"] = p.num_frames
    return pipeline_output(pipe, p, **kwargs)


def one_rank(folder: Path, requests: list[GenerationParams], **engine) -> list[np.ndarray]:
    """The rank worker alone (no MP4 in between): each request stepped to the end, decoded."""
    worker = RankWorker(EngineConfig(model=str(folder), device="cpu", dtype="float32", **engine))
    out = []
    for i, params in enumerate(requests):
        worker.add(f"r{i}", params)
        while worker.step([f"r{i}"])[f"r{i}"] < worker.states[f"r{i}"].num_steps:
            pass
        out.append(worker.finish(f"r{i}")["pixels"][0])
    return out


def engine_outputs(folder: Path, case: Case, flags: dict) -> list[np.ndarray]:
    """The engine's image pixels, or its MP4's frames, for [square, wide] on the layout ``flags``."""
    with running_engine(folder, flags, **case.engine) as engine:
        done = results(engine, [case.square, case.wide])
    if case.square.num_frames > 1:
        return [decode_mp4(r.outputs[0]) for r in done]
    return [png_pixels(r.outputs[0]) for r in done]


def as_delivered(pixels: np.ndarray) -> np.ndarray:
    """Pixels as the engine hands them over: an image as is, frames through the MP4 it writes (lossy)."""
    return decode_mp4(encode_mp4(pixels)) if pixels.ndim == 4 else pixels


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, list[np.ndarray]]]:
    """Family name → (its folder, one rank's pixels for [square, wide]), each made once when first asked."""
    return {}


def folder_and_one_rank(built, tmp_path_factory, name: str) -> tuple[Path, list[np.ndarray]]:
    if name not in built:
        case = CASES[name]
        folder = case.build(tmp_path_factory.mktemp(name) / name)
        built[name] = folder, one_rank(folder, [case.square, case.wide], **case.engine)
    return built[name]


@pytest.fixture(params=list(CASES))
def family(request, built, tmp_path_factory) -> tuple[Case, Path, list[np.ndarray]]:
    """(case, folder, one rank's pixels for [square, wide]) per family."""
    return CASES[request.param], *folder_and_one_rank(built, tmp_path_factory, request.param)


def test_one_rank_equals_diffusers(family):
    """fp32 on one machine: the same arithmetic as the pipeline's (bit for bit but where an op's order
    differs). 60 dB, not 40: text padded to 512 tokens where the pipeline encodes 16 (Wan I2V) was 43 dB on
    these tiny weights."""
    from diffusers import DiffusionPipeline

    case, folder, ours = family
    pipe = load_pipeline(DiffusionPipeline, folder)
    assert type(pipe).__name__ == case.pipeline
    for p, got in zip((case.square, case.wide), ours, strict=True):
        expected = diffusers_output(pipe, p, case.call)
        frames = (p.num_frames,) if p.num_frames > 1 else ()
        assert got.shape == expected.shape == (*frames, p.height, p.width, 3)
        assert psnr(got, expected) >= 60, (p.width, p.height)


def _layout_params():
    for name, case in CASES.items():
        for i, flags in enumerate(case.layouts):
            marks = () if i == 0 else (pytest.mark.slow,)
            yield pytest.param(name, flags, marks=marks, id=f"{name}-{layout_id(flags)}")


@pytest.mark.parametrize(("name", "flags"), list(_layout_params()))
def test_layout_equals_one_rank(name, flags, built, tmp_path_factory):
    case = CASES[name]
    folder, expected = folder_and_one_rank(built, tmp_path_factory, name)
    for got, want in zip(engine_outputs(folder, case, flags), expected, strict=True):
        assert got.shape == want.shape
        assert psnr(got, as_delivered(want)) >= 40


def _refused_params():
    for name, case in CASES.items():
        for flags, flag in case.refused:
            yield pytest.param(name, flags, flag, id=f"{name}-{layout_id(flags)}")


@pytest.mark.parametrize(("name", "flags", "flag"), list(_refused_params()))
def test_layout_the_config_does_not_admit_is_refused_naming_the_flag(
    name, flags, flag, built, tmp_path_factory
):
    folder, _ = folder_and_one_rank(built, tmp_path_factory, name)
    with pytest.raises(ValueError, match=flag):
        with running_engine(folder, flags, **CASES[name].engine):
            pass


def test_kontext_without_a_size_draws_the_pipelines_default(tmp_path):
    """FluxKontextPipeline called without a size brings its default square to max_area (1024² pixels)
    whatever the VAE's factor; a Kontext folder whose VAE is not FLUX's 8× (16× here: 5 blocks) was given
    128 latents × the factor (2048², a 400 under smaller limits) by ``ditserve generate`` and the API."""
    from diffusers import FluxKontextPipeline

    from ditserve.replica.models.registry import resolve_model

    folder = _kontext(tmp_path / "kontext-16x", vae_blocks=5)
    pipe = load_pipeline(FluxKontextPipeline, folder)
    out = pipe(prompt="a fox", num_inference_steps=1, max_sequence_length=48, output_type="np")
    height, width = out.images[0].shape[:2]
    assert resolve_model(str(folder)).default_size == (width, height)


def test_generate_without_a_size_under_the_least_side_says_so(built, tmp_path_factory, tmp_path):
    """HunyuanVideo15Pipeline's default on diffusers' test transformer (target_size 16) is 20x12, under the
    16 pixels a side a request may ask: ``ditserve generate`` without a size said '--height: Input should be
    greater than or equal to 16', a flag the user never gave. Now it names the default and asks for a size."""
    folder, _ = folder_and_one_rank(built, tmp_path_factory, "hunyuan")
    with pytest.raises(AssertionError, match=r"default size 20x12 \(its pipeline's\) is under 16 pixels"):
        cli_generate("dance monkey", folder, tmp_path / "out.mp4", "--num-inference-steps", "1")
