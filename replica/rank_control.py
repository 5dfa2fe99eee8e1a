"""Rank-side control commands for served replicas: weights update, memory release/resume.

``ServingRankWorker`` adds these commands to :class:`RankWorker` (the SPMD worker) without changing it; the
launchers used by ``ditserve serve`` build this class. Like every rank command, each runs on all ranks in
the same order, between two denoising steps.

Weights update is two-phase so that a replica's ranks switch together or not at all: ``stage_weights``
loads the new transformer next to the current one and prepares it the same way (sharded, quantized,
fused, compiled; any rank may fail; then ``discard_weights`` on all), ``commit_weights`` only swaps a
reference, which cannot fail.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .models.local_folder import model_variant
from .models.registry import transformer_folder
from .worker import RankWorker


def _public(config: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


# diffusers' refusal of a checkpoint tensor whose shape is not the model's
_SHAPE_MISMATCH = re.compile(
    r"because (\S+) expected shape torch\.Size\(\[([^\]]*)\]\), but got torch\.Size\(\[([^\]]*)\]\)"
)


def _check_loaded(model: torch.nn.Module, path: str) -> None:
    """A tensor the folder's files lack is left on the meta device by ``from_pretrained``: name it (moving
    the model failed with "Cannot copy out of meta tensor")."""
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"path: {path} lacks the transformer's tensor {missing[0]}{more}")


def _check_finite(model: torch.nn.Module, path: str) -> None:
    """NaN or infinite weights draw black (or noise) for every request: refused like a LoRA file with them."""
    names, finite = [], []
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            names.append(name)
            finite.append(torch.isfinite(tensor).all())  # stays on the device: one sync for the whole model
    if not finite:
        return
    bad = torch.stack(finite).logical_not().nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"path: {path} holds NaN or infinite weights ({names[bad[0]]})")


class ServingRankWorker(RankWorker):
    """A :class:`RankWorker` with the control commands a served replica needs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._staged: tuple[str, dict[str, torch.nn.Module]] | None = None  # tag, transformer(s) by name
        self.released = False

    # -- weights ------------------------------------------------------------------------------------------
    def stage_weights(self, path: str, tag: str) -> dict[str, Any]:
        """Load ``path``'s transformer (both experts of a two-expert model), prepare it like the current one,
        keep it aside under ``tag``."""
        experts = [n for n in ("transformer", "transformer_2") if getattr(self.pipe, n, None) is not None]
        if len(experts) == 1:
            folders = {"transformer": transformer_folder(path)}
        else:  # Wan 2.2 A14B: the pipeline folder, both experts (a transformer folder alone names neither)
            folders = {n: Path(path) / n for n in experts}
            lacking = [n for n, f in folders.items() if not (f / "config.json").is_file()]
            if lacking:
                raise ValueError(
                    f"path: {path} lacks {', '.join(f'{n}/' for n in lacking)}: the served model has two "
                    "experts; give a pipeline folder holding both, transformer/ and transformer_2/"
                )
        staged = {name: self._load_transformer(path, str(folder), name) for name, folder in folders.items()}
        self._staged = (tag, staged)
        return {"rank": self.rank, "tag": tag}

    def _load_transformer(self, path: str, folder: str, name: str) -> torch.nn.Module:
        import diffusers

        current = getattr(self.pipe, name)
        cls = getattr(diffusers, type(current).__name__)
        shown = path if name == "transformer" else f"{path} ({name})"
        try:
            model = cls.from_pretrained(
                folder, dtype=self.config.torch_dtype, variant=model_variant(Path(folder))
            )
        except ValueError as exc:  # diffusers' words advise from_pretrained arguments no user can pass here
            shapes = _SHAPE_MISMATCH.search(str(exc))
            if shapes is None:
                raise
            tensor, want, got = shapes.groups()
            raise ValueError(
                f"path: {shown} holds {tensor} of shape [{got}]; the served model's is [{want}]"
            ) from None
        if _public(model.config) != _public(current.config):
            raise ValueError(f"path: {shown} has a different transformer config than the served model")
        _check_loaded(model, shown)
        model = model.to(self.device).eval()
        _check_finite(model, shown)  # on the device: one pass over the weights where they will be used
        self.prepare_transformer(model)  # sharded, quantized, fused and compiled like the current one
        if hasattr(current, "lora_row_copies"):  # what the runner declared of the model for the adapters
            model.lora_row_copies = current.lora_row_copies
        return model

    def commit_weights(self, tag: str) -> None:
        assert self._staged is not None and self._staged[0] == tag, (self._staged, tag)
        staged = self._staged[1]
        for name, model in staged.items():
            setattr(self.pipe, name, model)
        self._staged = None
        self.reattach_lora()
        if self.released:  # committed while released: the new weights live on the host too
            for model in staged.values():
                model.to("cpu")

    def discard_weights(self) -> None:
        self._staged = None

    # -- memory -------------------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Weights to host memory; on CPU they are already there and only the state changes."""
        self.wait_decodes()  # a realtime chunk's decode may still be using the VAE on the device
        self.runner.model_changed()  # captured graphs hold device memory and the weights' old addresses
        if self.device.type == "cuda":
            self.pipe.to("cpu")
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self.pipe.to(self.device)
        self.released = False
