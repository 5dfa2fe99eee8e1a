"""Step-level denoising on top of a diffusers pipeline's parts.

diffusers' ``pipe(...)`` runs one request from start to end. Serving needs one *step* at a time over a
batch whose members started at different times, with their own timesteps, guidance, seeds and adapters.
So a runner splits the pipeline into ``prepare`` (text encoding, latents, a private scheduler),
``step`` (one transformer forward for the whole batch, then each request's own scheduler step) and
``decode`` (VAE). The arithmetic follows the diffusers pipeline, so a request alone gives the image
``pipe(...)`` gives.

CFG: a request with guidance contributes a "cond" and an "uncond" row group. Without CFG parallelism
the two branches run as two forwards, one per branch (as most pipelines call their transformer), or as one
forward of [uncond rows; cond rows] for a family whose pipeline batches them (``batch_cfg``); with ``cfg`` =
2 rank 0 runs every cond row and rank 1 every uncond row (padded to the same rows), and the predictions are
all-gathered once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..request import GenerationParams


@dataclass
class RequestState:
    """Everything a running request keeps between steps (identical on every rank)."""

    req_id: str
    params: GenerationParams
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    cond: dict[str, torch.Tensor]  # per-row model inputs, batch dim first
    uncond: dict[str, torch.Tensor] | None
    cfg_scale: float
    bucket: tuple
    step_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def rows(self) -> int:
        return self.latents.shape[0]


def keep_unmasked(state: RequestState) -> None:
    """After a scheduler step of a masked request (``state.step_index`` the step just taken): the latents
    outside the mask become the start latents noised to the next timestep (the clean ones after the last),
    as the inpaint pipelines blend them."""
    known = state.extra.get("inpaint")
    if known is None:
        return
    init = known["init"]
    i = state.step_index
    if i < len(state.timesteps) - 1:
        # after its step, the scheduler's step index is the next timestep's: scale_noise reads its sigma
        init = state.scheduler.scale_noise(init, state.timesteps[i + 1 : i + 2], known["noise"])
    state.latents = (1 - known["mask"]) * init + known["mask"] * state.latents


def count_forwards(state: RequestState, guided: bool) -> None:
    """One step's transformer forwards of a request (one per CFG branch that ran: ``guided``, the uncond
    branch's too), for its ``usage``."""
    state.extra["forwards"] = state.extra.get("forwards", 0) + (2 if guided else 1)


def usage(state: RequestState) -> dict[str, int]:
    """What a request cost: the transformer forwards it took part in (one per CFG branch and step) and how
    many of them its step cache answered (the blocks after the first skipped)."""
    caches = state.extra.get("cache", {}).values()
    return {
        "transformer_forwards": int(state.extra.get("forwards", 0)),
        "cached_forwards": sum(c.cached for c in caches),
    }


def request_scheduler(pipe):
    """A fresh instance of the pipeline's own scheduler class and config, for one request: multistep
    schedulers (Wan2.1's UniPC) keep per-request history, so requests never share one."""
    return type(pipe.scheduler).from_config(pipe.scheduler.config)


def true_cfg_branch(params: GenerationParams) -> bool:
    """Whether a true-CFG pipeline (FluxPipeline, QwenImagePipeline) runs its negative branch: a scale above 1
    with a negative prompt. A scale above 1 without one is refused naming the field: diffusers' pipelines
    then draw unguided (with a warning), which would drop the guidance the request asked for."""
    if params.true_cfg_scale > 1 and params.negative_prompt is None:
        raise ValueError(
            f"true_cfg_scale: {params.true_cfg_scale:g} guides against a negative prompt, and the request gives "
            'none (nor does the model recommend one); give negative_prompt (" " for a blank one), or leave '
            "true_cfg_scale out"
        )
    return params.true_cfg_scale > 1


def open_image(data: bytes):
    """An uploaded image (PNG / JPEG / WebP bytes, checked at the ingress) as diffusers' ``load_image`` gives
    it: EXIF orientation applied, RGB (``media.to_rgb``)."""
    import io

    from PIL import Image

    from ditserve.replica.media import to_rgb

    return to_rgb(Image.open(io.BytesIO(data)))


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats → uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    return (images * 255).round().clip(0, 255).astype("uint8")


class PipelineRunner(ABC):
    """One model family's prepare / step / decode. Subclasses fill in the model-specific parts."""

    # Inputs shared by every row of a bucket (not concatenated): e.g. Flux's txt_ids / img_ids.
    shared_inputs: tuple[str, ...] = ()
    # Step caching: the transformer's block lists in call order, and what one block returns (in order).
    cache_blocks: tuple[str, ...] = ()
    cache_outputs: tuple[str, ...] = ("hidden_states",)
    # CFG on one rank: True runs both branches in one forward, [uncond rows; cond rows], as pipelines that
    # batch them do (StableDiffusion3Pipeline): one launch of every kernel instead of two, and the GEMMs of
    # the pipeline's shapes (a batch of one picks other kernels, so other roundings in bf16).
    batch_cfg: bool = False
    # The pipeline's tokenizer for the encoder whose states the transformer attends (Flux: T5's), by whose
    # count a request's ``usage`` reports its text tokens.
    prompt_tokenizer: str = "tokenizer"

    def __init__(
        self,
        pipe,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_sequence_length: int | None,
        mesh=None,
        cuda_graphs: bool = False,
    ):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        # --max-sequence-length (None: not given, 512); a family whose pipeline encodes a fixed length
        # (Family.text_length False) is never given one
        self.max_sequence_length = 512 if max_sequence_length is None else max_sequence_length
        self.max_sequence_length_given = max_sequence_length  # None: the flag was left out
        self.mesh = mesh
        # --cuda-graphs: forwards replay a captured graph per input signature (and adapter layout).
        self.graphs = None
        if cuda_graphs:
            from .graphs import StepGraphs

            self.graphs = StepGraphs(self.model_forward, device)
        # Set by the LoRA manager: called with the row → request layout before each forward.
        self.before_forward: Callable[[list[tuple[RequestState, int]]], None] | None = None
        # Set by the LoRA manager: for a forward with adapters, (its layout as part of a graph key, what a
        # graph captured for it must keep alive), or None when it must run without a graph.
        self.graph_key: Callable[[], tuple[tuple, object] | None] | None = None
        # Set by the LoRA manager: step caching narrows the forward's adapter layout to the computing rows for
        # the blocks after the first (rows, their first rows), and restores it with (None, None).
        self.relayout: Callable[[list[int] | None, list[int] | None], None] | None = None

    def text_token_limit(self) -> int:
        """The most prompt tokens the family encodes (its prompts are cut there)."""
        return self.max_sequence_length

    def prompt_tokens(self, prompt: str) -> int:
        """The prompt's tokens as :attr:`prompt_tokenizer` counts them, cut where the family cuts the prompt:
        the text the request paid for, without special tokens, a chat template around it or padding."""
        tokenizer = getattr(self.pipe, self.prompt_tokenizer, None) or getattr(self.pipe, "tokenizer", None)
        if tokenizer is None:
            return 0
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds one
        limit = min(self.text_token_limit(), tokenizer.model_max_length)
        ids = tokenizer(prompt, add_special_tokens=False, truncation=True, max_length=limit)["input_ids"]
        return len(ids)

    def step_cache(self):
        """The served transformer's step-cache wrapper (a no-op for forwards without caching rows)."""
        return self.step_cache_of(self.pipe.transformer)

    def step_cache_of(self, model):
        """``model``'s step-cache wrapper, applied on first use. It lives on the model, so a transformer that
        replaces the served one (a weights update) gets its own on its first caching forward."""
        from ..caching.blocks import ATTR, apply_step_cache

        handle = getattr(model, ATTR, None)
        if handle is None:
            group = None
            if self.mesh is not None and self.mesh.sp_size > 1:
                group = self.mesh.sp_mesh.get_group()
            handle = apply_step_cache(
                model, block_lists=self.cache_blocks, outputs=self.cache_outputs, group=group
            )
        return handle

    def request_cache(self, state: RequestState, branch: str):
        """The request's cache for one CFG branch, or None when it does not cache (or the rows are padding)."""
        settings = state.params.cache
        if settings is None or not settings.enabled or not self.cache_blocks:
            return None
        if branch == "uncond" and not self.needs_uncond(state):
            # cfg-parallel padding rows (no uncond branch, or none at this step): computed and discarded
            return None
        from ..caching.state import RequestCache

        caches = state.extra.setdefault("cache", {})
        if branch not in caches:
            caches[branch] = RequestCache(settings)
        return caches[branch]

    def usage(self, state: RequestState) -> dict[str, int]:
        """The request's :func:`usage`, called on every rank. Under CFG parallelism each cfg rank keeps the
        cache of its own branch, so the cached forwards of a guided request are summed over the cfg group
        (a collective: every rank holds the same states, so every rank takes this path or none does)."""
        cost = usage(state)
        cache = state.params.cache
        if self.cfg_size > 1 and state.uncond is not None and cache is not None and cache.enabled:
            import torch.distributed as dist

            cached = torch.tensor([cost["cached_forwards"]], dtype=torch.int64, device=state.latents.device)
            dist.all_reduce(cached, group=self.mesh.get_group("cfg"))
            cost["cached_forwards"] = int(cached.item())
        return cost

    @property
    def cfg_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.cfg_size

    @property
    def cfg_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.cfg_rank

    @abstractmethod
    def encode(self, params: GenerationParams) -> dict[str, Any]:
        """Everything the encoders compute for one request (prompt embeddings, pooled vectors, negative
        prompt's, reference images' latents): a dict of tensors (nested dicts/lists/None allowed).

        Runs only where the encoders are (``--encoder-placement``: the replica's first rank, or every
        rank); the result travels to the other ranks, so it holds nothing that needs the encoders again."""

    @abstractmethod
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict[str, Any]) -> RequestState:
        """The request's state from ``encode``'s result (on this rank's device): latents, scheduler,
        per-row inputs. Runs on every rank, identically."""

    def add(self, req_id: str, params: GenerationParams) -> RequestState:
        """``prepare(encode(...))`` on one process (tests, benchmarks, a replica of one rank)."""
        return self.prepare(req_id, params, self.encode(params))

    @abstractmethod
    def model_forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """One transformer call on concatenated rows; returns the noise prediction, same shape as latents."""

    @abstractmethod
    def decode(self, state: RequestState) -> np.ndarray:
        """uint8 images [n, H, W, 3] or videos [n, F, H, W, 3]."""

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        """The first output's current latents on the latent grid, (channels, height, width): what a progress
        preview shows. Default: latents kept as [n, C, h, w] (SD3, Z-Image), or a video's [n, C, frames, h,
        w] (its first frame); a family that packs its latents unpacks them."""
        x = state.latents[0]
        return x[:, 0] if x.dim() == 4 else x

    def needs_uncond(self, state: RequestState) -> bool:
        """Whether the request's uncond branch runs at this step (a family may switch guidance off for
        some steps, e.g. Z-Image's CFG truncation)."""
        return state.uncond is not None

    @classmethod
    def pipeline_components(cls, folder: Path) -> dict[str, Any]:
        """Components to pass to the pipeline's ``from_pretrained`` instead of loading them from ``folder``
        (e.g. a processor that must be built differently on this machine). Default: none."""
        return {}

    def concat_inputs(self, inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One forward's per-row inputs from every request's (same keys); a family whose rows differ in
        length (padded prompts) overrides it."""
        return {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}

    def guide(self, state: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """One request's guided prediction from its two branches: the pipeline's CFG arithmetic."""
        return uncond + state.cfg_scale * (cond - uncond)

    def timestep_rows(self, state: RequestState) -> torch.Tensor:
        t = state.timesteps[state.step_index]
        return t.expand(state.rows).to(state.latents.dtype)

    # -- one step for a batch of requests that share a bucket -------------------------------------------
    def _run_rows(self, groups: list[tuple[RequestState, str]]) -> torch.Tensor:
        """Run the model once on the rows of ``groups`` (a request and the branch of its rows, in row
        order), concatenated."""
        rows = [(s, getattr(s, branch) if getattr(s, branch) is not None else s.cond) for s, branch in groups]
        latents = torch.cat([s.latents for s, _ in rows])
        timesteps = torch.cat([self.timestep_rows(s) for s, _ in rows])
        inputs = self.concat_inputs([c for _, c in rows])
        if self.before_forward is not None:
            self.before_forward([(s, s.rows) for s, _ in rows])
        shared = groups[0][0].extra["shared"]
        caches = [(self.request_cache(s, branch), s.rows) for s, branch in groups]
        if any(c is not None for c, _ in caches):
            # Caching forwards run without CUDA graphs: which rows compute changes from step to step, and a
            # captured graph would freeze one decision (--compile still runs each block compiled).
            cache = self.step_cache()
            # The remaining blocks run on the computing rows only; the LoRA manager narrows its adapter
            # segments to them (without it, rows with adapters keep the whole batch in every block).
            cache.relayout = self.relayout
            cache.set_plan(
                caches, shrink=self.relayout is not None or not any(s.params.lora for s, _ in rows)
            )
            try:
                return self.model_forward(latents, timesteps, inputs, shared)
            finally:
                cache.set_plan(None)
        if self.graphs is not None:
            if not any(s.params.lora for s, _ in rows):
                return self.graphs(latents, timesteps, inputs, shared)
            lora = self.graph_key() if self.graph_key is not None else None
            if lora is not None:
                return self.graphs(latents, timesteps, inputs, shared, extra=lora[0], keep=lora[1])
        return self.model_forward(latents, timesteps, inputs, shared)

    def model_changed(self) -> None:
        """The transformer's modules or weights moved or changed: captured graphs point at the old ones."""
        if self.graphs is not None:
            self.graphs.clear()

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every request of ``states`` (one bucket) by one denoising step."""
        assert states and all(s.bucket == states[0].bucket and not s.done for s in states)
        guided = [s for s in states if self.needs_uncond(s)]
        if self.cfg_size == 2:
            # Branch per cfg rank; rank 1 runs uncond rows where a request has them, cond rows otherwise
            # (same shapes on both ranks for the all-gather; those extra rows are discarded).
            from ..parallel import cfg_all_gather

            branch = "cond" if self.cfg_rank == 0 else "uncond"
            local = self._run_rows([(s, branch) for s in states])
            both = cfg_all_gather(local.contiguous(), self.mesh)
            cond_pred, uncond_pred = both[0], both[1]
        elif self.batch_cfg and guided:
            pred = self._run_rows([(s, "uncond") for s in guided] + [(s, "cond") for s in states])
            split = sum(s.rows for s in guided)
            uncond_pred, cond_pred = pred[:split], pred[split:]
        else:
            cond_pred = self._run_rows([(s, "cond") for s in states])
            uncond_pred = self._run_rows([(s, "uncond") for s in guided]) if guided else None
        offset, uoffset = 0, 0
        for s in states:
            pred = cond_pred[offset : offset + s.rows]
            needs_uncond = self.needs_uncond(s)  # at this step (before it advances)
            if needs_uncond:
                if self.cfg_size == 2:
                    neg = uncond_pred[offset : offset + s.rows]
                else:
                    neg = uncond_pred[uoffset : uoffset + s.rows]
                    uoffset += s.rows
                pred = self.guide(s, pred, neg)
            offset += s.rows
            t = s.timesteps[s.step_index]
            s.latents = s.scheduler.step(pred, t, s.latents, return_dict=False)[0]
            keep_unmasked(s)  # a masked request: outside its mask, the start image back
            s.step_index += 1
            count_forwards(s, needs_uncond)
