"""What ``--model`` finds on disk beyond ``model_index.json``: a Hugging Face cache entry for a repo id, the
component folders the index lists, and the weights variant (``*.fp16.safetensors``) the folder was saved in.

Checked before anything loads, so that a folder diffusers would fail on deep inside ``from_pretrained`` (a
component folder missing, no weights in it, only ``variant=`` files) is refused with what was found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..families import read_json

# diffusers' and transformers' weight file names: plain, a variant (``model.fp16.safetensors``), sharded
# (``model-00001-of-00002.safetensors``, ``model.fp16-00001-of-00002.safetensors``) and shard indexes
# (``model.safetensors.index.json``, ``model.safetensors.index.fp16.json``).
_WEIGHTS = re.compile(
    r"^(?:diffusion_pytorch_model|model|pytorch_model)(?:\.(?P<variant>[^.\-]+))?(?:-\d+-of-\d+)?"
    r"\.(?:safetensors|bin)$"
)
_INDEX = re.compile(
    r"^(?:diffusion_pytorch_model|model|pytorch_model)\.(?:safetensors|bin)\.index(?:\.(?P<variant>[^.]+))?\.json$"
)
# Class names of models in ``model_index.json`` (diffusers' ``...Model`` and ``Autoencoder...``, transformers'
# ``...Model``, ``...ModelWithProjection``, ``...ForConditionalGeneration``); tokenizers, processors,
# schedulers and guiders hold no weights. A component folder with a ``config.json`` is a model whatever its name.
_MODEL_CLASS = re.compile(r"(Model|ModelWithProjection|For[A-Z]\w*)$|^Autoencoder")
# ``org/name`` as the Hugging Face Hub spells a repo id
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_ENTRY = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")

_LFS_POINTER = b"version https://git-lfs.github.com/spec/"

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".sft")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.startswith(".")


def hub_snapshot(model: str) -> Path:
    """The local snapshot folder of Hugging Face repo ``model`` (``org/name``) in the Hub cache (``HF_HOME`` /
    ``HF_HUB_CACHE``), as diffusers' ``from_pretrained`` finds it offline. Never downloads: every rank of every
    replica resolves ``--model`` by itself, so a model is fetched once, beforehand, not by each of them."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=model, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"--model {model!r}: no such folder, and not in the Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"ditserve reads models from disk and downloads nothing: fetch it first (`hf download {model}`, "
            "the same HF_HOME) or give its folder"
        ) from None


def cache_repo_id(path: Path) -> str | None:
    """``org/name`` for a snapshot folder of the Hugging Face cache (``models--org--name/snapshots/<sha>``)."""
    for folder in (path, path.resolve()):
        if folder.parent.name == "snapshots":
            found = _CACHE_ENTRY.match(folder.parent.parent.name)
            if found:
                return f"{found['org']}/{found['name']}"
    return None


def cache_entry_snapshot(path: Path) -> Path:
    """The snapshot ``refs/main`` names of a Hugging Face cache entry (``.../hub/models--org--name``, given
    where its snapshot folder was meant); any other path as it is."""
    ref = path / "refs" / "main"
    if path.is_dir() and _CACHE_ENTRY.match(path.resolve().name) and ref.is_file():
        snapshot = path / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    return path


def single_file_hint(model: str, path: Path) -> str:
    """The refusal of a single-file checkpoint given as ``--model``."""
    return (
        f"--model {model!r} is a single-file checkpoint; ditserve loads diffusers folders (model_index.json "
        "and a folder per component, as save_pretrained writes them): convert it once with diffusers, e.g. "
        f"`FluxPipeline.from_single_file({str(path)!r}, config=<the diffusers folder of its base model>)"
        ".save_pretrained(<folder>)`, and give that folder"
    )


def _is_model(folder: Path, cls: Any) -> bool:
    return (folder / "config.json").is_file() or bool(_MODEL_CLASS.search(str(cls)))


def _variants(folder: Path) -> set[str | None]:
    """The weights variants a component folder holds (None: plain, unnamed weights)."""
    found: set[str | None] = set()
    for file in folder.iterdir():
        match = _WEIGHTS.match(file.name) or _INDEX.match(file.name)
        if match:
            found.add(match["variant"])
    return found


def _lfs_pointers(folder: Path) -> list[str]:
    """Weight files of ``folder`` that are Git LFS pointers (a clone made without git-lfs): small text files
    in place of the tensors."""
    pointers = []
    for file in sorted(folder.iterdir()):
        if _WEIGHTS.match(file.name) and file.stat().st_size < 1024:
            with open(file, "rb") as handle:
                if handle.read(len(_LFS_POINTER)) == _LFS_POINTER:
                    pointers.append(file.name)
    return pointers


def model_variant(folder: Path) -> str | None:
    """The weights variant to load one model folder with (a weights update's transformer): None where it
    holds plain weights, else the variant its files name (the first by name where there are several)."""
    found = _variants(folder) if folder.is_dir() else set()
    return None if None in found or not found else sorted(found)[0]


def check_components(model: str, path: Path, index: Mapping[str, Any]) -> str | None:
    """Refuse (ValueError naming the path and what is missing) a folder whose ``model_index.json`` lists a
    component that is not on disk: no folder, a model's folder without ``config.json`` or without weights.
    Returns the weights variant to load (``from_pretrained(variant=...)``): None where every model has plain
    weights (as diffusers loads by default), else the one variant the models without plain weights share."""
    listed = {
        name: entry
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] is not None
    }
    missing = [f"{name}/ ({entry[1]})" for name, entry in listed.items() if not (path / name).is_dir()]
    if missing:
        raise ValueError(
            f"--model {model!r}: {path} lacks {', '.join(missing)}, which its model_index.json lists; copy "
            "the whole pipeline folder (every component save_pretrained wrote)"
        )
    variants: dict[str, set[str | None]] = {}
    problems: list[str] = []
    pointers: list[str] = []
    for name, entry in listed.items():
        if not _is_model(path / name, entry[1]):
            continue
        if not (path / name / "config.json").is_file():
            problems.append(f"{name}/ has no config.json")
            continue
        try:
            read_json(path / name / "config.json")
        except ValueError as exc:
            problems.append(str(exc).replace(f"{path}/", "", 1))
            continue
        variants[name] = _variants(path / name)
        if not variants[name]:
            problems.append(f"{name}/ holds no weights (*.safetensors or *.bin)")
        pointers += [f"{name}/{file}" for file in _lfs_pointers(path / name)]
    if problems:
        raise ValueError(f"--model {model!r}: in {path}, {'; '.join(problems)}")
    if pointers:
        raise ValueError(
            f"--model {model!r}: in {path}, {', '.join(pointers)} are Git LFS pointers, not weights (the folder "
            "was cloned without git-lfs): run `git lfs pull` in it, or download it with `hf download`"
        )
    lacking = {name: found for name, found in variants.items() if None not in found}
    if not lacking:
        return None
    shared = set.intersection(*lacking.values())
    if len(shared) == 1:
        return shared.pop()
    held = ", ".join(f"{name}/: {sorted(v for v in found if v)}" for name, found in lacking.items())
    raise ValueError(
        f"--model {model!r}: {path} holds only variant weights ({held}) and no one variant covers every "
        "component; keep one variant (diffusers loads one per pipeline) or save the folder without variant"
    )
