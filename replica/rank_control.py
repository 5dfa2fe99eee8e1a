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

from typing import Any

import torch

from .models.registry import transformer_folder
from .worker import RankWorker


def _public(config: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def _check_loaded(model: torch.nn.Module, path: str) -> None:
    """A tensor the folder's files lack is left on the meta device by ``from_pretrained``: name it (moving
    the model failed with "Cannot copy out of meta tensor")."""
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"path: {path} lacks the transformer's tensor {missing[0]}{more}")


def _check_finite(model: torch.nn.Module, path: str) -> None:
    """NaN or infinite weights draw black (or noise) for every request: refused like a LoRA file with them."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"path: {path} holds NaN or infinite weights ({name})")


class ServingRankWorker(RankWorker):
    """A :class:`RankWorker` with the control commands a served replica needs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._staged: tuple[str, torch.nn.Module] | None = None
        self.released = False

    # -- weights ------------------------------------------------------------------------------------------
    def stage_weights(self, path: str, tag: str) -> dict[str, Any]:
        """Load ``path``'s transformer, prepare it like the current one, keep it aside under ``tag``."""
        import diffusers

        if getattr(self.pipe, "transformer_2", None) is not None:
            raise ValueError(
                f"path: {path}: updating the weights of a two-expert model (transformer_2) is not supported; "
                "restart the replica on the new folder"
            )
        folder = transformer_folder(path)
        current = self.pipe.transformer
        cls = getattr(diffusers, type(current).__name__)
        model = cls.from_pretrained(folder, dtype=self.config.torch_dtype)
        if _public(model.config) != _public(current.config):
            raise ValueError(f"path: {path} has a different transformer config than the served model")
        _check_loaded(model, path)
        model = model.to(self.device).eval()
        _check_finite(model, path)  # on the device: one pass over the weights where they will be used
        self.prepare_transformer(model)  # sharded, quantized, fused and compiled like the current one
        if hasattr(current, "lora_row_copies"):  # what the runner declared of the model for the adapters
            model.lora_row_copies = current.lora_row_copies
        self._staged = (tag, model)
        return {"rank": self.rank, "tag": tag}

    def commit_weights(self, tag: str) -> None:
        assert self._staged is not None and self._staged[0] == tag, (self._staged, tag)
        self.pipe.transformer = self._staged[1]
        self._staged = None
        self.reattach_lora()
        if self.released:  # committed while released: the new weights live on the host too
            self.pipe.transformer.to("cpu")

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
