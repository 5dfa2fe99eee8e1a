"""What a model family declares, and the families this replica serves.

A *family* is one diffusers pipeline architecture served through the engine's own step loop (so
continuous batching, per-request LoRA, sessions, streaming progress, CUDA graphs, ``--compile``, FP8 and
the sharded layouts apply to it). Adding a family is three new files and no edit to generic code:

- ``replica/families/<name>.py``: ``FAMILY = Family(...)``, this declaration. Pure data (no torch or
  diffusers import): the ingress reads it to resolve ``--model`` and check requests.
- ``replica/pipelines/<name>.py``: the runner (``prepare`` / ``model_forward`` / ``decode``), following
  the diffusers pipeline's own arithmetic so that one request alone gives ``pipe(...)``'s output.
- ``replica/parallel/<name>.py``: the parallel plan, a :class:`~ditserve.replica.parallel.plan.ParallelPlan`
  (which linears are column/row-parallel, where sequence sharding starts and ends, which tokens stay
  replicated, the attention processor).

Families are discovered by listing this package, so a new file is all the registry needs.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

Kind = Literal["image", "video"]
Guidance = Literal["distilled", "true_cfg", "cfg", "none"]
FirstFrame = Literal["none", "optional", "required"]


def read_json(file: Path) -> dict[str, Any]:
    """A model folder's JSON file (``model_index.json``, a component's ``config.json``); ValueError naming the
    file where it is not a JSON object (a truncated copy, a Git LFS pointer)."""
    try:
        value = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not valid JSON (a {type(value).__name__}, not an object)")
    return value


@dataclass(frozen=True)
class Folder:
    """What a family's rules may read of a model folder: its ``model_index.json`` and component configs."""

    path: Path
    index: Mapping[str, Any]
    # component → its config.json, read once (the engine checks every request against them)
    _configs: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def config(self, component: str) -> dict[str, Any]:
        """``component/config.json`` (empty where there is none); shared: read it, do not change it."""
        if component not in self._configs:
            file = self.path / component / "config.json"
            self._configs[component] = read_json(file) if file.is_file() else {}
        return self._configs[component]

    def has(self, component: str) -> bool:
        """Whether ``model_index.json`` holds ``component`` (diffusers writes ``[null, null]`` when absent)."""
        entry = self.index.get(component)
        return isinstance(entry, list) and entry[:1] != [None]


def vae_spatial_factor(folder: Folder) -> int:
    """The spatial downsampling of a diffusers VAE folder (AutoencoderKL's blocks, Wan's/Hunyuan's ratios)."""
    vae = folder.config("vae")
    for key in ("spatial_compression_ratio", "scale_factor_spatial"):
        if key in vae:
            return int(vae[key])
    if "temperal_downsample" in vae:  # AutoencoderKLWan
        return 2 ** len(vae["temperal_downsample"])
    return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)


def transformer_patch(folder: Folder) -> int:
    """The transformer's spatial patch size (an int, or Wan's (t, h, w))."""
    patch = folder.config("transformer").get("patch_size", 1)
    return int(patch[-1]) if isinstance(patch, list) else int(patch)


def default_size_multiple(folder: Folder) -> int:
    return vae_spatial_factor(folder) * transformer_patch(folder)


def fit_size(size: tuple[int, int], max_width: int, max_height: int, multiple: int) -> tuple[int, int]:
    """``size`` (width, height), scaled down keeping its aspect to fit within the limits where it does not,
    each side rounded down to ``multiple`` (at least one multiple)."""
    width, height = size
    # a side a family's rule floored to nothing (a 2-pixel-wide reference): its caller refuses it
    if min(width, height) < 1:
        return width, height
    scale = min(1.0, max_width / width, max_height / height)
    if scale == 1.0:
        return width, height
    return (
        max(multiple, int(width * scale) // multiple * multiple),
        max(multiple, int(height * scale) // multiple * multiple),
    )


def default_heads(transformer_config: Mapping[str, Any]) -> int:
    return int(transformer_config["num_attention_heads"])


@dataclass(frozen=True)
class Family:
    """One model family's declaration. Callables take a :class:`Folder` (or the transformer config)."""

    name: str
    # diffusers pipeline class (``model_index.json``'s ``_class_name``) → what it produces
    pipelines: Mapping[str, Kind]
    # "module:attr" relative to ``ditserve.replica``: the runner class and the parallel plan
    runner: str
    plan: str
    # How guidance reaches the model: "distilled" (an embedding, no second branch), "true_cfg" (a second
    # branch only with a negative prompt and true_cfg_scale > 1), "cfg" (a second branch when
    # guidance_scale > 1), "none". CFG parallelism (--cfg 2) needs a second branch.
    guidance: Guidance = "cfg"
    # Why this folder never runs a second (uncond) branch, or None. CFG parallelism would only repeat cfg rank
    # 0's work on rank 1, so --cfg-parallel-size 2 is refused naming the flag (FLUX.2 dev's distilled guidance;
    # a step-distilled FLUX.2 Klein).
    single_branch: Callable[[Folder], str | None] = lambda folder: None
    # true_cfg_scale when the user gives a negative prompt but no scale ("true_cfg" families)
    default_true_cfg: float = 4.0
    negative_prompt: bool = True
    # pipelines of ``pipelines`` that take reference images (POST /v1/images/edits), and how many at most
    edit_pipelines: frozenset[str] = frozenset()
    max_references: int = 0
    # fewer for some of those pipelines, by class name (QwenImageEditPipeline: 1 of the family's 3)
    pipeline_references: Mapping[str, int] = field(default_factory=dict)
    # pipelines of ``edit_pipelines`` that cannot make an image without a reference (Qwen-Image-Edit); the
    # others also draw from the prompt alone (FLUX.1 Kontext, FLUX.2)
    references_required: frozenset[str] = frozenset()
    # The output (width, height) of an edit request that names no size, from its references' (width,
    # height) in order: what the edit pipeline draws without height and width (Qwen-Image-Edit: the last
    # reference's aspect at about 1024² pixels; FLUX.2: the first reference's size, at most 1024² pixels;
    # FLUX.1 Kontext: 1024² whatever the reference); None: ``default_size``.
    edit_size: Callable[[Folder, list[tuple[int, int]]], tuple[int, int]] | None = None
    # image-to-image from ``init_latents`` + ``strength`` (sessions, /v1/images/edits on non-edit families)
    img2img: bool = False
    # The output (width, height) of an image-to-image or inpaint request that names no size, from its start
    # image's (width, height), where the family's img2img / inpaint pipelines size it by the image (Z-Image:
    # its own size); None: ``default_size``, the size FluxImg2ImgPipeline, QwenImageImg2ImgPipeline and
    # StableDiffusion3Img2ImgPipeline (and their inpaint pipelines) draw without height and width, the image
    # resized to it.
    img2img_size: Callable[[Folder, tuple[int, int]], tuple[int, int]] | None = None
    # takes an inpainting ``mask`` with its image-to-image start image (POST /v1/images/edits ``mask``);
    # refused otherwise, and by the family's edit pipelines other than ``inpainting_edits``
    inpainting: bool = False
    # The strength of such an inpaint request that gives none: the family's inpaint pipeline's default
    # (FluxInpaintPipeline, StableDiffusion3InpaintPipeline, QwenImageInpaintPipeline: 0.6, as image-to-image;
    # ZImageInpaintPipeline: 1.0)
    inpainting_strength: float = 0.6
    # Edit pipelines that also take a ``mask``, as diffusers' inpaint pipeline for them (FluxKontextPipeline:
    # FluxKontextInpaintPipeline): the one image is both the start image noised to ``strength`` and the
    # reference. Class name → that inpaint pipeline's default strength.
    inpainting_edits: Mapping[str, float] = field(default_factory=dict)
    # The output (width, height) of such a masked edit that names no size, from its image's (width, height),
    # where the inpaint pipeline sizes it otherwise than ``edit_size``; None: as any edit of the family.
    inpainting_edit_size: Callable[[Folder, tuple[int, int]], tuple[int, int]] | None = None
    # (width, height) of a request that names no size: the pipeline's own default (its __call__'s)
    default_size: Callable[[Folder], tuple[int, int]] = lambda folder: (1024, 1024)
    # Video families whose pipeline sizes an image-to-video request by its first frame: (width, height) from
    # the frame's (width, height); None: ``default_size``
    first_frame_size: Callable[[Folder, tuple[int, int]], tuple[int, int]] | None = None
    # width/height multiple, (frames - 1) multiple, attention heads (for the layout check)
    size_multiple: Callable[[Folder], int] = default_size_multiple
    frame_multiple: Callable[[Folder], int] = lambda folder: 1
    # Video families: the frame rate the model films at (its model card's export_to_video fps), a request's
    # default: its MP4's rate and how many frames its seconds are
    fps: Callable[[Folder], int] = lambda folder: 16
    heads: Callable[[Mapping[str, Any]], int] = default_heads
    # Video families: whether a request gives the first frame (POST /v1/videos input_reference): "none" (text
    # to video only), "optional" (text or text+image, e.g. Wan 2.2 TI2V), "required" (image-to-video).
    first_frame: Callable[[Folder], FirstFrame] = lambda folder: "none"
    # Components the pipeline runs without when ``model_index.json`` has them as ``[null, null]`` (a folder
    # saved without them): passed to ``from_pretrained`` as None, as diffusers asks (SD3 without its T5).
    optional_components: frozenset[str] = frozenset()
    # A variant of a listed pipeline the family does not run (a message naming what was found), or None.
    refuse: Callable[[Folder], str | None] = lambda folder: None
    # A size the model cannot run beyond ``size_multiple`` (a message naming ``size``), or None: (folder,
    # width, height, chunks) with ``chunks`` the chunks of a chunked video (a whole video's, or a realtime
    # session's ``max_chunks``; None: a session without an end).
    refuse_size: Callable[[Folder, int, int, int | None], str | None] = lambda folder, w, h, chunks: None
    # The chunks a whole video of ``num_frames`` frames is generated in (chunk-autoregressive families).
    video_chunks: Callable[[Folder, int], int] = lambda folder, num_frames: 1
    # takes --max-sequence-length (its pipeline's ``max_sequence_length``); False: the pipeline encodes a fixed
    # length, and the flag is refused at start rather than ignored
    text_length: bool = True
    # applies a request's step cache (``cache``); refused with a 400 naming ``cache`` otherwise
    step_cache: bool = True
    # applies per-request adapters; False: loading one is refused naming ``path`` (as for a pipeline class
    # without a LoRA loader in diffusers), never loaded for requests that would all be refused
    lora: bool = True
    # diffusers' ``lora_state_dict`` of this pipeline class returns network alphas
    lora_alphas: bool = False
    # An adapter's transformer modules (names) the family cannot apply per request (a message), or None.
    lora_refuse: Callable[[list[str]], str | None] = lambda modules: None
    # ``ditserve deploy kuberay`` for folders that exist only in the image: public checkpoint folder names
    # (regex on the folder name → attention heads), and the heads assumed for ``--model-kind <name>``
    checkpoints: tuple[tuple[str, int], ...] = ()
    typical_heads: int = 24
    extra: Mapping[str, Any] = field(default_factory=dict)

    def load(self, attr: Literal["runner", "plan"]) -> Any:
        module, _, name = getattr(self, attr).partition(":")
        return getattr(importlib.import_module(f"..{module}", __package__), name)

    def kind(self, pipeline_class: str) -> Kind:
        return self.pipelines[pipeline_class]


@cache
def families() -> dict[str, Family]:
    """Every family declared in this package, by name."""
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f".{info.name}", __package__)
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            if family.name in found:
                raise RuntimeError(f"two families named {family.name!r}")
            found[family.name] = family
    return found


def pipeline_families() -> dict[str, Family]:
    """diffusers pipeline class → the family that serves it."""
    out: dict[str, Family] = {}
    for family in families().values():
        for cls in family.pipelines:
            if cls in out:
                raise RuntimeError(f"{cls} is claimed by {out[cls].name} and {family.name}")
            out[cls] = family
    return out


def get_family(name: str) -> Family:
    try:
        return families()[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(families())}") from None
