"""Model names and folders: what ``--model`` accepts.

A model is either an embedded demo name (built or unpacked locally, never downloaded) or a local folder
in diffusers format whose ``model_index.json`` names a pipeline family we serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from ..caching.settings import CacheSettings
from ..families import Family, Folder, fit_size, get_family, pipeline_families, read_json
from .demo import DEMO_BUILDERS, ensure_demo_model
from .local_folder import (
    SINGLE_FILE_SUFFIXES,
    cache_entry_snapshot,
    cache_repo_id,
    check_components,
    hub_snapshot,
    looks_like_repo_id,
    single_file_hint,
)


def supported_pipelines() -> dict[str, tuple[str, Literal["image", "video"]]]:
    """diffusers pipeline class → (family, output kind), from the family declarations (``families/``)."""
    return {cls: (family.name, family.kind(cls)) for cls, family in pipeline_families().items()}


DEFAULT_MODEL = "demo-scenes"
# The video model to name where one is suggested: trained (films what it is asked), unlike demo-wan (random
# weights, noise; kept for parity tests of the Wan code paths).
DEFAULT_VIDEO_MODEL = "demo-scenes-video"


def _embedded_paths() -> dict[str, Path]:
    paths: dict[str, Path] = {}
    try:
        from .scenes import scenes_model_path, scenes_video_model_path

        for name, path in (
            ("demo-scenes", scenes_model_path()),
            (DEFAULT_VIDEO_MODEL, scenes_video_model_path()),
        ):
            if (path / "model_index.json").is_file():
                paths[name] = path
    except ImportError:
        pass
    return paths


def video_model_hint() -> str:
    """The video model to suggest to a user: the trained one where its weights ship, else ``demo-wan``
    (random weights: it runs the Wan code paths but films noise)."""
    return DEFAULT_VIDEO_MODEL if DEFAULT_VIDEO_MODEL in _embedded_paths() else "demo-wan"


def embedded_model_names() -> list[str]:
    return sorted(set(DEMO_BUILDERS) | set(_embedded_paths()))


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: the name users see, its local folder and what it produces."""

    name: str
    path: Path
    family: str
    kind: Literal["image", "video"]
    pipeline_class: str
    # The weights variant the folder was saved in (``save_pretrained(variant="fp16")``: ``*.fp16.safetensors``),
    # passed to ``from_pretrained``; None: plain weights
    variant: str | None = None
    # An embedded demo model (trained and tested at 64×64), not a user's folder whatever its name
    embedded: bool = False

    @property
    def family_spec(self) -> Family:
        """The family's declaration (``replica/families/<family>.py``)."""
        return get_family(self.family)

    @cached_property
    def folder(self) -> Folder:
        # Read once per spec (the engine checks every request against these; the folder does not change).
        return Folder(self.path, read_json(self.path / "model_index.json"))

    def transformer_config(self) -> dict:
        return dict(self.folder.config("transformer"))

    @cached_property
    def min_steps(self) -> int:
        """The fewest denoising steps the folder's scheduler draws with: 2 where it stretches its schedule to
        a terminal sigma (``shift_terminal``, as Qwen-Image's): one step stretches by 0 / 0, and diffusers' own
        pipeline draws NaN latents (a black image); else 1."""
        file = self.path / "scheduler" / "scheduler_config.json"
        config = read_json(file) if file.is_file() else {}
        return 2 if config.get("shift_terminal") else 1

    @property
    def num_attention_heads(self) -> int:
        return self.family_spec.heads(self.transformer_config())

    @property
    def max_references(self) -> int:
        """How many reference images this folder's pipeline takes (its family's count, or its own)."""
        family = self.family_spec
        return family.pipeline_references.get(self.pipeline_class, family.max_references)

    @property
    def edits(self) -> bool:
        """Whether the model takes reference images (POST /v1/images/edits without image-to-image)."""
        return self.pipeline_class in self.family_spec.edit_pipelines

    @property
    def inpaints(self) -> bool:
        """Whether the model takes an inpainting mask with its image: image-to-image families that inpaint,
        and the edit pipelines diffusers has an inpaint pipeline for (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 Klein)."""
        family = self.family_spec
        return self.pipeline_class in family.inpainting_edits if self.edits else family.inpainting

    def edit_request_size(self, sizes: list[tuple[int, int]], masked: bool) -> tuple[int, int]:
        """(width, height) of an edit or image-to-image request that names no size, from its images' (before
        the server's limits): what the family's pipeline draws without height and width — the inpaint
        pipeline's rule for a masked edit (``Family.inpainting_edit_size``), the edit pipeline's
        (``Family.edit_size``), the img2img / inpaint pipelines' (``Family.img2img_size``), else
        ``default_size``. The embedded demo models edit at the first image's size."""
        family = self.family_spec
        if self.embedded:
            return sizes[0]
        if self.edits:
            if masked and family.inpainting_edit_size is not None:
                return family.inpainting_edit_size(self.folder, sizes[0])
            rule = family.edit_size
            return self.default_size if rule is None else rule(self.folder, list(sizes))
        if family.img2img_size is not None:
            return family.img2img_size(self.folder, sizes[0])
        return self.default_size

    def mask_refusal(self) -> str:
        """Why the model takes no mask (said after ``mask: ``)."""
        if self.edits:
            return (
                f"{self.name} ({self.pipeline_class}) takes its images as references and does not inpaint "
                "(diffusers has no inpaint pipeline for it); send the image without a mask"
            )
        return f"{self.name} does not inpaint; send the image without a mask"

    def default_strength(self, masked: bool, img2img: float) -> float:
        """The ``strength`` of an image-to-image or inpaint request that gives none: ``img2img`` (the img2img
        pipelines' default), the family's inpaint pipeline's with a mask, an edit model's inpaint pipeline's
        for a masked edit."""
        if self.edits:
            return self.masked_edit_strength()
        return self.family_spec.inpainting_strength if masked else img2img

    def masked_edit_strength(self) -> float:
        """The default ``strength`` of a masked edit: the pipeline's inpaint pipeline's."""
        return self.family_spec.inpainting_edits[self.pipeline_class]

    @property
    def needs_references(self) -> bool:
        """Whether every request must bring a reference image (Qwen-Image-Edit: no image from text alone)."""
        return self.pipeline_class in self.family_spec.references_required

    @cached_property
    def first_frame(self) -> str:
        """Video models: whether a request's first frame (``input_reference``) is "none", "optional" or
        "required" (image-to-video)."""
        return self.family_spec.first_frame(self.folder) if self.kind == "video" else "none"

    @cached_property
    def recommendations(self) -> dict:
        """The folder's ``ditserve.json`` (read once: requests consult it on the serving event loop)."""
        extra = self.path / "ditserve.json"
        return read_json(extra) if extra.is_file() else {}

    @property
    def sampling(self) -> dict:
        """Recommended sampling settings shipped beside the weights (``ditserve.json``), if any."""
        return self.recommendations.get("sampling", {})

    @property
    def recommended_cache(self) -> CacheSettings | None:
        """The step cache the folder's ``ditserve.json`` recommends (``"cache": {...}``), if any."""
        value = self.recommendations.get("cache")
        if value is None:
            return None
        try:
            return CacheSettings.model_validate(value)
        except ValueError as exc:
            raise ValueError(f'--model {self.name}: ditserve.json\'s "cache" is not valid: {exc}') from None

    def guidance_defaults(
        self, negative_prompt: str | None, true_cfg_scale: float | None
    ) -> tuple[str | None, float]:
        """Fill what the user left out, each on its own: the model's recommended negative prompt (unless the
        request turns true CFG off, true_cfg_scale <= 1) and true-CFG scale. A request that raises the scale
        without a negative prompt guides against the recommended one: true CFG needs a negative prompt, and
        such a request was drawn without guidance at all."""
        sampling = self.sampling
        if negative_prompt is None and (true_cfg_scale is None or true_cfg_scale > 1):
            negative_prompt = sampling.get("negative_prompt")
        if true_cfg_scale is None:
            true_cfg_scale = sampling.get("true_cfg_scale")
        if true_cfg_scale is None:
            family = self.family_spec
            true_cfg = negative_prompt is not None and family.guidance == "true_cfg"
            true_cfg_scale = family.default_true_cfg if true_cfg else 1.0
        return negative_prompt, float(true_cfg_scale)

    @cached_property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this (the VAE's spatial factor × the patch size)."""
        return self.family_spec.size_multiple(self.folder)

    @cached_property
    def default_size(self) -> tuple[int, int]:
        """(width, height) of a request that names none: 64×64 for the embedded demo models (trained and
        tested there), the folder's ``ditserve.json`` "sampling" "width" and "height" where it gives both (what
        ``ditserve train-demo`` / ``train-demo-video`` write), else the family pipeline's own default (1024² for
        the image families, 832×480 for Wan)."""
        if self.embedded:
            return 64, 64
        if "width" in self.sampling and "height" in self.sampling:
            return int(self.sampling["width"]), int(self.sampling["height"])
        return self.family_spec.default_size(self.folder)

    def request_size(self, first_frame: tuple[int, int] | None = None) -> tuple[int, int]:
        """(width, height) of a request that names none: where the family's pipeline sizes image-to-video by
        the first frame ((width, height) given), that; else ``default_size``."""
        rule = self.family_spec.first_frame_size
        if first_frame is not None and rule is not None and not self.embedded:
            return rule(self.folder, first_frame)
        return self.default_size

    def fitted_size(
        self, max_width: int, max_height: int, first_frame: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        """``request_size`` scaled down, keeping its aspect, to a server's limits."""
        return fit_size(self.request_size(first_frame), max_width, max_height, self.size_multiple)

    @cached_property
    def takes_adapters(self) -> bool:
        """Whether per-request adapters can load here: diffusers has a LoRA loader for the pipeline class and
        the family applies them."""
        import diffusers

        loader = getattr(diffusers, self.pipeline_class, None)
        return self.family_spec.lora and hasattr(loader, "lora_state_dict")

    @cached_property
    def two_experts(self) -> bool:
        """A two-expert model (Wan 2.2 A14B: ``transformer_2``), the only kind that takes ``guidance_scale_2``."""
        return self.folder.has("transformer_2")

    def refusal(
        self,
        cache: CacheSettings | None,
        guidance_scale_2: float | None,
        true_cfg_scale: float | None = None,
        guidance_scale: float | None = None,
    ) -> tuple[str, str] | None:
        """(field, message) for request settings this model would not apply, else None."""
        if cache is not None and cache.enabled and not self.family_spec.step_cache:
            return "cache", f"cache: {self.name} does not take a step cache ({cache.policy}); leave it out"
        if guidance_scale_2 is not None and not self.two_experts:
            return "guidance_scale_2", (
                f"guidance_scale_2: {self.name} has one transformer; only two-expert models (Wan 2.2 A14B) take "
                "the second expert's scale"
            )
        if guidance_scale_2 not in (None, 1) and guidance_scale is not None and guidance_scale <= 1:
            # WanPipeline runs the unconditional branch for both experts only when guidance_scale > 1
            return "guidance_scale_2", (
                f"guidance_scale_2: {guidance_scale_2:g} would do nothing with guidance_scale {guidance_scale:g}: "
                "classifier-free guidance runs (for either expert) only when guidance_scale is above 1; raise "
                "guidance_scale or leave guidance_scale_2 out"
            )
        if true_cfg_scale is not None and true_cfg_scale > 1 and self.family_spec.guidance != "true_cfg":
            return "true_cfg_scale", (
                f"true_cfg_scale: {self.name} does not take true CFG (FLUX.1 and Qwen-Image do); its guidance "
                "is guidance_scale"
            )
        return None

    @cached_property
    def fps(self) -> int:
        """The frame rate a video request that names none gets (the family's: 16 for Wan 2.1 / 2.2 A14B, 24
        for Wan 2.2 TI2V-5B and HunyuanVideo 1.5)."""
        return self.family_spec.fps(self.folder) if self.kind == "video" else 16

    @cached_property
    def frame_multiple(self) -> int:
        """Video models take ``frame_multiple·k + 1`` frames (the VAE's temporal factor)."""
        return self.family_spec.frame_multiple(self.folder) if self.kind == "video" else 1


def resolve_model(model: str, files: bool = True) -> ModelSpec:
    """Map ``--model`` (an embedded name or a local diffusers folder) to a :class:`ModelSpec`.

    Raises ``ValueError`` saying what was found and what is expected. ``files=False``: the caller brings the
    pipeline in memory (an in-process engine on a built pipeline, the benchmarks), so the folder holds the
    configs only and its components' files are not checked.
    """
    embedded = _embedded_paths()
    if model in embedded:
        path, name = embedded[model], model
    elif model in DEMO_BUILDERS:
        path, name = ensure_demo_model(model), model
    else:
        path = Path(model).expanduser()
        if not path.exists() and looks_like_repo_id(model):
            path, name = hub_snapshot(model), model  # as diffusers' from_pretrained("org/name") offline
        elif not path.exists():
            raise ValueError(
                f"--model {model!r}: no such folder, and not an embedded model; expected a local diffusers "
                f"folder (with model_index.json), a Hugging Face repo id in the local cache, or one of "
                f"{embedded_model_names()}"
            )
        else:
            path = cache_entry_snapshot(path)  # a Hub cache entry (models--org--name): its current snapshot
            # A Hub snapshot folder is named by its commit: users know it, and ask for it, by its repo id
            # (and ``.`` by the folder's own name).
            name = cache_repo_id(path) or path.resolve().name
        if path.is_file() and path.suffix.lower() in SINGLE_FILE_SUFFIXES:
            raise ValueError(single_file_hint(model, path))
        if not (path / "model_index.json").is_file():
            if path.is_dir() and (path.resolve().parent / "model_index.json").is_file():
                raise ValueError(
                    f"--model {model!r} is the {path.resolve().name}/ component of a pipeline folder; give the "
                    f"pipeline folder, {path.resolve().parent}"
                )
            found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "a file"
            raise ValueError(
                f"--model {model!r}: found {found} but no model_index.json; expected a diffusers-format "
                f"pipeline folder (one of {sorted(supported_pipelines())}, as written by save_pretrained)"
            )
    try:
        index = read_json(path / "model_index.json")
    except ValueError as exc:
        raise ValueError(f"--model {model!r}: {exc}") from None
    cls = index.get("_class_name", "<missing _class_name>")
    supported = pipeline_families()
    if cls not in supported:
        raise ValueError(
            f"--model {model!r}: found pipeline {cls}; supported pipelines are {sorted(supported)}"
        )
    family = supported[cls]
    # A folder of a served pipeline class can still hold a variant the family does not run; serving it as
    # the base variant would give silently wrong output, so it is refused with what was found.
    refused = family.refuse(Folder(path, index))
    if refused:
        raise ValueError(f"--model {model!r}: {refused}")
    variant = check_components(model, path, index) if files else None
    return ModelSpec(
        name=name,
        path=path,
        family=family.name,
        kind=family.kind(cls),
        pipeline_class=cls,
        variant=variant,
        embedded=model in embedded or model in DEMO_BUILDERS,
    )


def transformer_folder(path: str) -> str:
    """The transformer of a weights update: a diffusers pipeline folder (``<path>/transformer``) or a
    transformer folder itself, by absolute path (every host reads the same path)."""
    if not Path(path).is_absolute():
        raise ValueError(
            f"path: {path} is relative; give the folder's absolute path (the same on every host)"
        )
    for folder in (Path(path) / "transformer", Path(path)):
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return str(folder)
    raise ValueError(
        f"path: {path} is not a diffusers pipeline or transformer folder (no config.json with safetensors "
        "weights beside it)"
    )
