"""Reading LoRA files as people publish them, normalised through diffusers' own converters.

diffusers' ``<Pipeline>.lora_state_dict`` turns kohya (``lora_down/lora_up/alpha``), XLabs, PEFT and the
common Wan formats into one PEFT-style layout (``transformer.<module>.lora_A/B.weight``) with alphas or
PEFT metadata beside it. We read that and fold each module's ``alpha / rank`` (``alpha / sqrt(rank)`` for
rsLoRA) into B, so at run time a request's strength is the only scale left.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API front end reads this module and needs no torch
    import torch

DORA_MARKERS = ("lora_magnitude_vector", "dora_scale")
# LyCORIS adapters other than LoRA (LoKr: Kronecker factors, which diffusers reads for FLUX.2 and Z-Image;
# LoHa: Hadamard products): their deltas are no low-rank A/B pairs that the segmented kernels apply.
LYCORIS_MARKERS = {"LoKr": (".lokr_w1", ".lokr_w2"), "LoHa": (".hada_w1", ".hada_w2")}


@dataclass
class LoRAModule:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], alpha/rank folded in
    bias: torch.Tensor | None  # [out_features] (lora_B bias), alpha/rank folded in


# The experts an adapter can apply to (Wan 2.2 A14B: ``transformer`` runs the high-noise steps,
# ``transformer_2`` the low-noise ones), named as diffusers names the pipeline's components.
TARGETS = ("transformer", "transformer_2")
# LoRAFile.modules' prefix of the second expert's modules (the first expert's have none)
SECOND = "transformer_2."


@dataclass
class LoRAFile:
    # transformer module name → weights; the second expert's (Wan 2.2 A14B) as ``transformer_2.<module>``
    modules: dict[str, LoRAModule]
    rank: int
    ignored: int  # tensors for components other than the transformer and text encoders (not applied)

    @property
    def experts(self) -> set[str]:
        """The experts the adapter has weights for (``transformer`` / ``transformer_2``)."""
        return {"transformer_2" if m.startswith(SECOND) else "transformer" for m in self.modules}


def parse_lora_spec(spec: str, flag: str = "--lora", with_target: bool = False):
    """``NAME[@TARGET]=PATH[:SCALE]`` (the CLI's adapter syntax) → (name, path, scale), with ``with_target``
    (name, path, scale, target): TARGET is the expert the file loads into (``transformer_2``: Wan 2.2 A14B's
    low-noise expert, as diffusers' ``load_lora_weights(..., load_into_transformer_2=True)``), None without."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"{flag} {spec!r}: expected NAME[@TARGET]=PATH[:SCALE]")
    name, at, target = name.partition("@")
    if at and target not in TARGETS:
        raise ValueError(
            f"{flag} {spec!r}: TARGET {target!r} must be one of {', '.join(TARGETS)} (the expert the file loads "
            "into; transformer_2: Wan 2.2 A14B's low-noise expert)"
        )
    if not name:
        raise ValueError(f"{flag} {spec!r}: expected NAME[@TARGET]=PATH[:SCALE]")
    parsed = _path_and_scale(spec, flag, rest)
    return (name, *parsed, target or None) if with_target else (name, *parsed)


def second_expert_refusal(model: str) -> str:
    """The refusal of ``target: transformer_2`` on a model with one transformer."""
    return (
        f"target: transformer_2 names a second expert, which this {model} model does not have (Wan 2.2 A14B "
        "has one); leave target out"
    )


def format_lora_spec(name: str, path: str, scale: float, target: str | None = None) -> str:
    """The ``NAME[@TARGET]=PATH:SCALE`` text that ``parse_lora_spec`` reads back."""
    return f"{name}{'@' + target if target else ''}={path}:{scale}"


def _path_and_scale(spec: str, flag: str, rest: str) -> tuple[str, float]:
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        try:
            scale = float(tail)
        except ValueError:
            return rest, 1.0  # a ':' inside the path, no scale
        # the API's bounds (POST /v1/loras scale): a NaN default drew every request that gives none black
        if not -10.0 <= scale <= 10.0:
            raise ValueError(f"{flag} {spec!r}: SCALE {tail} must be a finite number from -10 to 10")
        return head, scale
    return rest, 1.0


def check_allowed(path: Path, roots: tuple[str, ...]) -> Path:
    """Resolve ``path``; with roots configured, it must lie under one of them (no ``..`` escapes).

    A relative path is read against the roots (the first that holds it), never against the server's
    working directory; without roots it must be absolute."""
    try:
        path = path.expanduser()
    except RuntimeError:  # "~someone" with no such user
        raise ValueError(f"path: {path} names a home directory that does not exist") from None
    if not path.is_absolute():
        if not roots:
            raise ValueError(f"path: {path} is relative; give an absolute path (or serve with --lora-root)")
        found = [Path(r).expanduser() / path for r in roots]
        path = next((p for p in found if p.exists()), found[0])
    resolved = path.resolve()
    if roots and not any(resolved.is_relative_to(Path(r).expanduser().resolve()) for r in roots):
        raise ValueError(f"path: {path} is outside the allowed LoRA roots {list(roots)} (--lora-root)")
    return resolved


def _safetensors_file(path: Path) -> tuple[Path, dict]:
    """The adapter's safetensors file (``path`` or the one inside the folder ``path``) and its header."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"path: {path} must hold exactly one .safetensors file, found {len(files)}")
        path = files[0]
    if not path.exists():
        raise ValueError(f"path: {path} does not exist")
    if not path.is_file():
        raise ValueError(f"path: {path} is not a regular file")
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(size) if 0 < size < 100_000_000 else b""
    try:
        keys = json.loads(header)
    except (ValueError, UnicodeDecodeError):
        keys = None
    if keys is None and header.startswith(b"{") and len(header) < size:
        raise ValueError(
            f"path: {path} is truncated: it ends inside its safetensors header (a download cut short?); fetch "
            "the file again"
        )
    if not isinstance(keys, dict) or not any(isinstance(v, dict) and "shape" in v for v in keys.values()):
        raise ValueError(f"path: {path} is not a safetensors file")
    # A download cut short keeps its header: the tensors it lists end past the end of the file.
    ends = [
        v["data_offsets"][1]
        for v in keys.values()
        if isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
        and isinstance(v["data_offsets"][1], int)
    ]
    held = path.stat().st_size - 8 - size
    if ends and max(ends) > held:
        raise ValueError(
            f"path: {path} is truncated: its header lists {max(ends)} bytes of tensors, the file holds {held} "
            "(a download cut short?); fetch the file again"
        )
    if any(marker in k for k in keys for marker in DORA_MARKERS):
        raise ValueError(f"path: {path} is a DoRA adapter; DoRA is not supported (plain LoRA only)")
    for kind, markers in LYCORIS_MARKERS.items():
        found = next((k for k in keys if any(m in k for m in markers)), None)
        if found is not None:
            raise ValueError(
                f"path: {path} is a LyCORIS {kind} adapter ({found}); {kind} is not supported, only LoRA "
                "(lora_A / lora_B or lora_down / lora_up pairs)"
            )
    return path, keys


# The pipeline components diffusers' converters name in a LoRA state dict's keys.
_COMPONENTS = ("transformer.", "transformer_2.", "text_encoder")

# The tensors of a converted file that an adapter applies (or reads its scale from).
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".alpha")

# Text-encoder LoRA weights as kohya (sd-scripts) and ComfyUI save them: lora_te1_*, text_encoders.t5xxl.*
_RAW_TEXT_ENCODER = re.compile(r"(lora_te\d*)_|(text_encoders\.\w+)\.")

# Down-projection keys of the layouts diffusers converts: PEFT/diffusers, kohya, XLabs.
_DOWN_MARKERS = (".lora_A.", ".lora_down.", ".down.")


# LoRA factors under a name the loader did not convert: a PEFT adapter's own name inside the key
# (``<module>.lora_A.default.weight``), or a dotted ``lora.down`` / ``lora.up``
_UNCONVERTED_FACTOR = re.compile(r"\.lora_(?:A|B|down|up)\.\w+\.weight$|\.lora\.(?:down|up)\.")

# Text-encoder LoRA keys in every layout: kohya's lora_te1_*, diffusers' text_encoder(_2).*, ComfyUI's
# text_encoders.t5xxl.*
_TEXT_ENCODER_KEY = re.compile(r"lora_te\d*_|text_encoders?(_\d+)?\.")
# The down / up factor names of those layouts (lora_A / lora_B, lora_down / lora_up, diffusers' old .down / .up)
_FACTOR = re.compile(r"lora_[AB]\.|lora_down\.|lora_up\.|\.down\.|\.up\.")


def _untrained_text_encoder_keys(file: Path, header: dict) -> list[str]:
    """The file's text-encoder keys when every text-encoder module among them adds nothing (a factor all
    zero: LoRA starts with lora_B / lora_up at zero, and some trainers save the text encoder's part
    untrained); [] when the file has none, or when any of them would change the text encoder."""
    keys = [k for k in header if k != "__metadata__" and _TEXT_ENCODER_KEY.match(k)]
    factors: dict[str, list[str]] = {}
    for key in keys:
        if _FACTOR.search(key):
            factors.setdefault(_FACTOR.sub("|", key, count=1), []).append(key)
    if not factors:
        return []
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        if any(all(f.get_tensor(k).any() for k in group) for group in factors.values()):
            return []
    return keys


@contextlib.contextmanager
def _without_keys(file: Path, drop: set[str]):
    """A copy of the safetensors ``file`` without the tensors ``drop`` (its metadata kept), for the call."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        metadata = f.metadata()
    with tempfile.TemporaryDirectory(prefix="ditserve-lora-") as folder:
        reduced = Path(folder) / file.name
        save_file(tensors, str(reduced), metadata=metadata)
        yield reduced


def inspect_adapter(path: str, roots: tuple[str, ...], max_rank: int) -> Path:
    """What can be checked of an adapter file without the model (the frontend does this before a load
    enters the desired state): where it may come from, that it is a safetensors file, its rank. Returns
    the resolved file path. Its shapes against the model are checked where the model is, on the replicas."""
    file, header = _safetensors_file(check_allowed(Path(path), roots))
    ranks = [
        min(entry["shape"])
        for key, entry in header.items()
        if any(m in key for m in _DOWN_MARKERS)
        and isinstance(entry, dict)
        and len(entry.get("shape", ())) == 2
    ]
    if not ranks:
        raise ValueError(f"path: {file} holds no LoRA down-projections (lora_A / lora_down); not an adapter")
    if max(ranks) > max_rank:
        raise ValueError(f"path: {file} has rank {max(ranks)}, above --max-lora-rank {max_rank}")
    return file


def _retarget(key: str, target: str) -> str:
    """A state-dict key of either expert as the ``target`` expert's."""
    for component in ("transformer_2.", "transformer."):
        if key.startswith(component):
            return f"{target}.{key.removeprefix(component)}"
    return key


def _alpha_for(
    module: str,
    rank: int,
    alphas: dict,
    metadata: dict,
    component: str = "transformer.",
    fallback: float | None = None,
) -> float:
    key = f"{component}{module}.alpha"
    for candidate in (key, f"{module}.alpha"):
        if candidate in alphas:
            return float(alphas[candidate])
    pattern = metadata.get("alpha_pattern") or {}
    for pat, value in pattern.items():
        # PEFT's rule (get_pattern_key): the key is a regular expression matching the name's dotted suffix
        try:
            if re.match(rf"(.*\.)?({pat})$", module):
                return float(value)
        except re.error as exc:
            raise ValueError(
                f"path: the file's alpha_pattern key {pat!r} is not a regular expression: {exc}"
            ) from None
    if metadata.get("lora_alpha") is not None:
        return float(metadata["lora_alpha"])
    if fallback is not None:
        # a file with alphas for some modules: diffusers' get_peft_kwargs makes the first one the config's
        # lora_alpha (Counter.most_common of the alpha tensors, each its own), which the others take
        return fallback
    return float(rank)  # diffusers' default: lora_alpha = r, scale 1


def read_lora_file(path: Path, pipeline_class: str, target: str | None = None) -> LoRAFile:
    """Load and normalise one adapter for a served pipeline class, in any layout diffusers' own
    ``lora_state_dict`` of that class reads (diffusers/PEFT, kohya and the other converted formats).

    Two experts (Wan 2.2 A14B): without ``target`` the file's ``transformer.`` weights are the first
    expert's and its ``transformer_2.`` ones the second's (a file holding both loads into both); with
    ``target`` the file holds one expert's weights, under either prefix, and they load into that expert
    (``transformer_2``: as diffusers' ``load_lora_weights(..., load_into_transformer_2=True)``)."""
    import diffusers

    from ..families import pipeline_families

    file, header = _safetensors_file(path)
    loader = getattr(diffusers, pipeline_class)
    family = pipeline_families()[pipeline_class]
    if not hasattr(loader, "lora_state_dict"):
        raise ValueError(
            f"path: diffusers has no LoRA loader for {pipeline_class}; this model takes no adapters"
        )
    if not family.lora:
        raise ValueError(f"path: {pipeline_class} models take no adapters here (per-request LoRA)")
    alphas_returned = family.lora_alphas
    kwargs = {"return_lora_metadata": True}
    if alphas_returned:
        kwargs["return_alphas"] = True
    untrained = set(_untrained_text_encoder_keys(file, header))
    try:
        if untrained:
            # read without them: what diffusers draws is the same (it adds their zero deltas to the encoder)
            with _without_keys(file, untrained) as reduced:
                out = loader.lora_state_dict(str(reduced), **kwargs)
        else:
            out = loader.lora_state_dict(str(file), **kwargs)
    except Exception as exc:  # diffusers raises many types for unknown layouts
        detail = str(exc)
        if not detail:  # a bare assert of a converter (FLUX's kohya one checks FLUX.1-dev's widths): where
            tb = exc.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            detail = f"{type(exc).__name__} in diffusers' {tb.tb_frame.f_code.co_name}"
        raise ValueError(
            f"path: {file} is not a LoRA layout diffusers can read for {pipeline_class}: {detail}"
        ) from exc
    if alphas_returned:
        state, alphas, metadata = out
    else:
        state, metadata = out
        alphas = None
    # PEFT's config per expert (``transformer.r``, ``transformer_2.lora_alpha``; keys of neither prefix are
    # both's); an expert the config does not name reads the other's (one config for a file of either prefix)
    raw = metadata or {}
    shared = {k: v for k, v in raw.items() if not k.startswith(("transformer.", "transformer_2."))}
    own = {
        c: {k.removeprefix(c): v for k, v in raw.items() if k.startswith(c)}
        for c in ("transformer.", "transformer_2.")
    }
    configs = {
        "transformer.": shared | (own["transformer."] or own["transformer_2."]),
        "transformer_2.": shared | (own["transformer_2."] or own["transformer."]),
    }
    # Alpha tensors beside PEFT keys (kohya's convention: scale alpha / rank) that this class's loader leaves in
    # the state dict (FLUX's returns them as network alphas): read as FLUX's loader reads them, never dropped
    alphas = {k: v for k, v in state.items() if k.endswith(".alpha")} | (alphas or {})
    if not any(k.startswith(_COMPONENTS) for k in state) and any(".lora_A." in k for k in state):
        # A file saved from the transformer itself (peft's get_peft_model_state_dict, or PEFT's save_pretrained
        # with its base_model.model. prefix): module names without the pipeline's component prefix, which
        # load_lora_weights skips (it loads nothing and draws the plain image). Read as the transformer's, as
        # diffusers' ``transformer.load_lora_adapter(file, prefix=None)`` reads it; the module names are
        # checked against the model when it loads.
        state = {"transformer." + k.removeprefix("base_model.model."): v for k, v in state.items()}
    # Qwen-Image's and Z-Image's converters (run for any file with alpha tensors) put their transformer. before
    # keys that have it already: PEFT keys with alphas came out as transformer.transformer.<module> (the alphas
    # folded in), which names no module. Read as the transformer's, as for every other family.
    state = {
        "transformer." + k.removeprefix("transformer.transformer.")
        if k.startswith("transformer.transformer.")
        else k: v
        for k, v in state.items()
    }
    # A config with use_dora makes PEFT build DoRA layers (their magnitudes from the model's weights when the
    # file has none): not the plain LoRA delta.
    if any(c.get("use_dora") for c in configs.values()) or any(
        marker in k for k in state for marker in DORA_MARKERS
    ):
        raise ValueError(f"path: {file} is a DoRA adapter; DoRA is not supported (plain LoRA only)")
    if target is not None:
        if target not in TARGETS:
            raise ValueError(f"target: {target!r} must be one of {', '.join(TARGETS)}")
        held = {
            c
            for c in ("transformer_2.", "transformer.")
            for k in state
            if k.startswith(c) and ".lora_A." in k
        }
        if len(held) == 2:
            raise ValueError(
                f"target: {file} holds adapters for both experts (transformer. and transformer_2. keys); load "
                "it without target, and each expert's weights go to that expert"
            )
        # the file's weights, whichever prefix they carry, are the target expert's
        state = {_retarget(k, target): v for k, v in state.items()}
        alphas = {_retarget(k, target): v for k, v in alphas.items()}
    # each expert's first alpha tensor: the alpha of its modules that have none beside alphas for others
    first_alpha: dict[str, float] = {}
    for key, value in alphas.items():
        component = "transformer_2." if key.startswith("transformer_2.") else "transformer."
        first_alpha.setdefault(component, float(value))
    modules: dict[str, LoRAModule] = {}
    ignored = 0
    encoders: set[str] = set()
    full: list[str] = []  # transformer tensors that are no LoRA factors
    for key, a in state.items():
        if key.startswith("text_encoder"):
            # diffusers' load_lora_weights applies these to the text encoder; a request's adapter changes
            # the transformer only, so serving the file would silently give another image.
            encoders.add(key.split(".")[0])
            continue
        component = next((c for c in ("transformer.", "transformer_2.") if key.startswith(c)), None)
        if component is not None and not key.endswith(_LORA_SUFFIXES):
            # e.g. the norm scales of a FLUX Control LoRA, which load_lora_weights writes into the model
            full.append(key.removeprefix(component))
            continue
        if ".lora_A." not in key:
            continue
        if component is None:
            ignored += 1
            continue
        name = key.removeprefix(component).split(".lora_A.")[0]
        b = state.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"path: {file}: {name} has lora_A but no lora_B")
        rank = a.shape[0]
        if rank == 0:
            raise ValueError(f"path: {file}: {name} has rank 0 (an empty lora_A)")
        # PEFT's scaling: alpha / rank, or alpha / sqrt(rank) for a file saved from a config with use_rslora
        config = configs[component]
        scale = _alpha_for(name, rank, alphas, config, component, first_alpha.get(component)) / (
            math.sqrt(rank) if config.get("use_rslora") else rank
        )
        bias = state.get(f"{component}{name}.lora_B.bias")
        module = LoRAModule(
            a=a.float(), b=b.float() * scale, bias=None if bias is None else bias.float() * scale
        )
        # A NaN or infinite weight makes every image drawn with the adapter NaN (served as black).
        if not all(t.isfinite().all() for t in (module.a, module.b, module.bias) if t is not None):
            raise ValueError(f"path: {file}: {name} holds NaN or infinite weights (or an infinite alpha)")
        modules[name if component == "transformer." else SECOND + name] = module
    if not encoders:
        # Text-encoder weights that diffusers' converter of this class maps to no text encoder: Qwen-Image's
        # and Z-Image's make transformer module names of kohya's (which load_lora_weights then skips), FLUX's
        # drops ComfyUI's T5 weights. The file's author trained the text encoder with the transformer, and
        # serving the transformer's half would draw another image. All-zero ones change nothing (untrained
        # ones, whose every module has a zero factor, were left out of the file read above).
        raw = {
            k: m.group(1) or m.group(2)
            for k in header
            if k not in untrained and (m := _RAW_TEXT_ENCODER.match(k))
        }
        if raw:
            from safetensors import safe_open

            with safe_open(str(file), "pt") as f:
                encoders = {
                    f"the text encoder ({prefix}{'_' if prefix.startswith('lora_te') else '.'}*)"
                    for k, prefix in raw.items()
                    if not k.endswith(".alpha") and f.get_tensor(k).any()
                }
    if encoders:
        raise ValueError(
            f"path: {file} holds LoRA weights for {', '.join(sorted(encoders))}; adapters apply to the "
            "transformer only (per request), so save the file without the text encoder's weights"
        )
    unconverted = [k for k in full if _UNCONVERTED_FACTOR.search(k)]
    if unconverted:
        # LoRA factors under names the class's loader keeps as they are (DiffSynth's PEFT adapter-named
        # lora_A.default.weight for Wan, FLUX or SD3): load_lora_weights loads nothing of them
        raise ValueError(
            f"path: {file} holds LoRA weights in a layout diffusers' {pipeline_class} loader does not convert "
            f"(keys such as {unconverted[0]!r}); save them as <module>.lora_A.weight / <module>.lora_B.weight"
        )
    if full:
        raise ValueError(
            f"path: {file} holds tensors for the transformer that are no LoRA weights ({', '.join(full[:4])}"
            f"{', ...' if len(full) > 4 else ''}); an adapter applies lora_A / lora_B pairs (and lora_B biases) "
            "per request and cannot change the model's own weights"
        )
    if not modules:
        # named from the file itself where the converter kept nothing of it
        example = next(iter(state), None) or next((k for k in header if k != "__metadata__"), "none")
        raise ValueError(
            f"path: {file} has no LoRA weights for the transformer in a layout diffusers' {pipeline_class} "
            f"loader reads (keys such as {example!r})"
        )
    refused = family.lora_refuse(sorted({m.removeprefix(SECOND) for m in modules}))
    if refused:
        raise ValueError(f"path: {file}: {refused}")
    return LoRAFile(modules=modules, rank=max(m.a.shape[0] for m in modules.values()), ignored=ignored)
