"""HunyuanVideo 1.5 (text-to-video and image-to-video): dual-stream blocks with joint attention over
[video; image, glyph, text tokens], the text tokens masked (only valid ones attend and are attended),
Qwen2.5-VL + byT5 text encoders (+ SigLIP for the first frame), classifier-free guidance through the
pipeline's guider whenever its scale is not 1 (the CFG-distilled checkpoints ship guidance_scale 1)."""

import json

from . import Family, Folder, vae_spatial_factor


def _frame_multiple(folder: Folder) -> int:
    return int(folder.config("vae").get("temporal_compression_ratio", 4))


_I2V = "HunyuanVideo15ImageToVideoPipeline"

# The pipeline's ClassifierFreeGuidance knobs the engine's step (uncond + scale · (cond - uncond)) follows.
_GUIDER_DEFAULTS = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0}


def _guider_config(folder: Folder) -> dict:
    """The guider's saved config (diffusers writes ``guider/guider_config.json``)."""
    file = folder.path / "guider" / "guider_config.json"
    return json.loads(file.read_text()) if file.is_file() else folder.config("guider")


def _refuse(folder: Folder) -> str | None:
    guider = _guider_config(folder)
    # diffusers loads the class model_index.json names and runs its arithmetic (zero-init steps, projections)
    entry = folder.index.get("guider")
    kind = entry[1] if isinstance(entry, list) and len(entry) == 2 else guider.get("_class_name")
    if kind not in (None, "ClassifierFreeGuidance"):
        return f"the guider is {kind}; only plain classifier-free guidance (ClassifierFreeGuidance) is served"
    for key, default in _GUIDER_DEFAULTS.items():
        if key in guider and guider[key] != default:
            return (
                f"the guider sets {key}={guider[key]!r}; only plain classifier-free guidance is served "
                f"({', '.join(f'{k}={v!r}' for k, v in _GUIDER_DEFAULTS.items())})"
            )
    if folder.config("transformer").get("use_meanflow"):
        return (
            "a MeanFlow transformer (use_meanflow: true, a second timestep per step) is not supported yet. "
            "Supported: HunyuanVideo 1.5 text-to-video and image-to-video folders without MeanFlow."
        )
    return None


def _bucket(folder: Folder, width: int, height: int) -> tuple[int, int]:
    """(width, height): the crop bucket around the transformer's target_size closest to width:height's aspect,
    by diffusers' own image processor (what the pipelines draw when not given a size)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    target = int(folder.config("transformer").get("target_size", 640))
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=vae_spatial_factor(folder))
    out_height, out_width = processor.calculate_default_height_width(height, width, target)
    return int(out_width), int(out_height)


def _default_size(folder: Folder) -> tuple[int, int]:
    """Text-to-video's default: the bucket closest to 16:9 (480p checkpoints: 848×480)."""
    return _bucket(folder, 16, 9)


FAMILY = Family(
    name="hunyuanvideo15",
    pipelines={"HunyuanVideo15Pipeline": "video", _I2V: "video"},
    runner="pipelines.hunyuanvideo15:HunyuanVideo15Runner",
    plan="parallel.hunyuanvideo15:HUNYUANVIDEO15_PLAN",
    guidance="cfg",
    # the VAE's spatial factor (16) × patch 1; frames are (temporal factor)·k + 1
    frame_multiple=_frame_multiple,
    default_size=_default_size,
    # image-to-video: the pipeline takes no size and draws the bucket of the first frame's aspect
    first_frame_size=lambda folder, size: _bucket(folder, *size),
    first_frame=lambda folder: "required" if folder.index.get("_class_name") == _I2V else "none",
    fps=lambda folder: 24,
    refuse=_refuse,
    text_length=False,  # HunyuanVideo15Pipeline pads every prompt to its tokenizer_max_length (1000)
    checkpoints=((r"(?<![a-z])hunyuan-?video-?1\.5", 16),),
    typical_heads=16,
)
