"""Model names and folders: what ``--model`` accepts.

A model is either an embedded demo name (built or unpacked locally, never downloaded) or a local folder
in diffusers format whose ``model_index.json`` names a pipeline family we serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .demo import DEMO_BUILDERS, ensure_demo_model

Family = Literal["flux", "wan"]

# diffusers pipeline class → (family, output kind)
SUPPORTED_PIPELINES: dict[str, tuple[Family, Literal["image", "video"]]] = {
    "FluxPipeline": ("flux", "image"),
    "WanPipeline": ("wan", "video"),
}

DEFAULT_MODEL = "demo-scenes"


def _embedded_paths() -> dict[str, Path]:
    paths: dict[str, Path] = {}
    try:
        from .scenes import scenes_model_path

        path = scenes_model_path()
        if (path / "model_index.json").is_file():
            paths["demo-scenes"] = path
    except ImportError:
        pass
    return paths


def embedded_model_names() -> list[str]:
    return sorted(set(DEMO_BUILDERS) | set(_embedded_paths()))


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: the name users see, its local folder and what it produces."""

    name: str
    path: Path
    family: Family
    kind: Literal["image", "video"]
    pipeline_class: str

    def transformer_config(self) -> dict:
        return json.loads((self.path / "transformer" / "config.json").read_text())

    @property
    def num_attention_heads(self) -> int:
        return int(self.transformer_config()["num_attention_heads"])

    @property
    def sampling(self) -> dict:
        """Recommended sampling settings shipped beside the weights (``ditserve.json``), if any."""
        extra = self.path / "ditserve.json"
        return json.loads(extra.read_text()).get("sampling", {}) if extra.is_file() else {}

    def guidance_defaults(
        self, negative_prompt: str | None, true_cfg_scale: float | None
    ) -> tuple[str | None, float]:
        """Fill what the user left out: the model's recommended negative prompt and true-CFG scale."""
        sampling = self.sampling
        if negative_prompt is None and true_cfg_scale is None:
            negative_prompt = sampling.get("negative_prompt")
            true_cfg_scale = sampling.get("true_cfg_scale")
        if true_cfg_scale is None:
            true_cfg_scale = 4.0 if negative_prompt is not None and self.family == "flux" else 1.0
        return negative_prompt, float(true_cfg_scale)

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE's spatial factor × the patch size."""
        vae = json.loads((self.path / "vae" / "config.json").read_text())
        patch = self.transformer_config().get("patch_size", 1)
        if self.family == "flux":  # latents are packed in 2×2 patches
            return 2 ** (len(vae["block_out_channels"]) - 1) * 2
        spatial = 2 ** len(vae.get("temperal_downsample", [])) if "temperal_downsample" in vae else 8
        return spatial * (patch[1] if isinstance(patch, list) else patch)

    @property
    def frame_multiple(self) -> int:
        """Video models take ``frame_multiple·k + 1`` frames (the VAE's temporal factor)."""
        if self.kind != "video":
            return 1
        vae = json.loads((self.path / "vae" / "config.json").read_text())
        return 2 ** sum(bool(x) for x in vae.get("temperal_downsample", []))


def resolve_model(model: str) -> ModelSpec:
    """Map ``--model`` (an embedded name or a local diffusers folder) to a :class:`ModelSpec`.

    Raises ``ValueError`` saying what was found and what is expected.
    """
    embedded = _embedded_paths()
    if model in embedded:
        path, name = embedded[model], model
    elif model in DEMO_BUILDERS:
        path, name = ensure_demo_model(model), model
    else:
        path = Path(model).expanduser()
        name = path.name
        if not path.exists():
            raise ValueError(
                f"--model {model!r}: no such folder, and not an embedded model; expected a local diffusers "
                f"folder (with model_index.json) or one of {embedded_model_names()}"
            )
        if not (path / "model_index.json").is_file():
            found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "a file"
            raise ValueError(
                f"--model {model!r}: found {found} but no model_index.json; expected a diffusers-format "
                f"pipeline folder (FluxPipeline or WanPipeline, as written by save_pretrained)"
            )
    index = json.loads((path / "model_index.json").read_text())
    cls = index.get("_class_name", "<missing _class_name>")
    if cls not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"--model {model!r}: found pipeline {cls}; supported pipelines are {sorted(SUPPORTED_PIPELINES)}"
        )
    family, kind = SUPPORTED_PIPELINES[cls]
    _refuse_unsupported_variant(model, cls, index)
    return ModelSpec(name=name, path=path, family=family, kind=kind, pipeline_class=cls)


def _component(index: dict, name: str) -> bool:
    """Whether ``model_index.json`` holds component ``name`` (diffusers writes ``[null, null]`` when absent)."""
    entry = index.get(name)
    return isinstance(entry, list) and entry[:1] != [None]


def _refuse_unsupported_variant(model: str, cls: str, index: dict) -> None:
    """A folder of a supported pipeline class can still hold a variant the family does not run; serving it
    as the base variant would give silently wrong output, so it is refused with what was found."""
    if cls == "WanPipeline":
        if _component(index, "transformer_2") or index.get("boundary_ratio") is not None:
            raise ValueError(
                f"--model {model!r}: a Wan 2.2 folder with two experts (transformer_2, boundary_ratio="
                f"{index.get('boundary_ratio')}) is not supported yet; serving the first expert alone would "
                "draw wrong videos. Supported: Wan 2.1 text-to-video folders (one transformer)."
            )
        if index.get("expand_timesteps"):
            raise ValueError(
                f"--model {model!r}: a Wan 2.2 TI2V folder (expand_timesteps: per-frame timesteps) is not "
                "supported yet. Supported: Wan 2.1 text-to-video folders."
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
