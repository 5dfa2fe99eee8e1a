"""AnyFlow-FAR: chunk-autoregressive video (a causal Wan 2.1), by ``AnyFlowFARPipeline``'s arithmetic.

The video is a sequence of latent chunks (``chunk_partition``, e.g. 1, 3, 3, ... latent frames). Each chunk
is denoised alone with flow-map steps (``FlowMapEulerDiscreteScheduler``: t → r per step), attending to the
past chunks through a K/V cache; before a chunk starts, one "cache" forward re-encodes every finished chunk
(the last ``full_chunk_limit - 1`` at full resolution, older ones through the compressed 4×4 patches) and
writes their keys and values. :class:`FarRollout` is that state: noise, finished latents, the K/V cache, the
streaming VAE decoder's cache.

Two ways in, one loop:

- a batch request (``POST /v1/videos``) is one rollout over all its chunks; a step is one flow-map step of
  the current chunk (the cache forward rides on a chunk's first step), so its steps are chunks × steps;
- a realtime session keeps one rollout on its owner replica (``prepare_chunk`` / ``close_session``); each
  chunk is a job of ``num_inference_steps`` steps and its ``decode`` gives that chunk's frames only, through
  the VAE decoder with its causal cache carried from the previous chunk, so the frames of all chunks equal
  one decode of the whole video.

Requests are stepped one by one (their caches differ in length); the engine still interleaves them with
the other jobs at step granularity. A chunk's prompt may change between chunks (realtime prompt events):
the cache forward before chunk k runs with chunk k's prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..families.anyflow import chunk_partition
from ..parallel.anyflow import FarCall, FarCausalAttnProcessor, FarLayerCache, FarRope
from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler


def session_partition(frames_per_chunk: int, num_chunks: int, temporal: int) -> list[int]:
    """A session's partition: one latent frame first (one video frame), then ``frames_per_chunk / 4``."""
    return [1] + [frames_per_chunk // temporal] * (num_chunks - 1)


def cache_tokens(
    config: Any, *, num_chunks: int, longest: int, height: int, width: int, ring: int = 1, ulysses: int = 1
) -> int:
    """Positions of one layer's K/V buffer on one rank for a rollout of ``num_chunks`` chunks of at most
    ``longest`` latent frames (``height``/``width`` in latent pixels), under ring degree ``ring`` and
    Ulysses degree ``ulysses``: the compressed chunks, the full ones and the chunk being denoised; on one
    ring block, the zero keys that pad it to a multiple of 128 too; over a ring, about 1/``ring`` of the
    tokens (each rank's block of the cached sequence and of the chunk, each padded by up to ``ulysses``
    rows; the pad keys are counted without being stored: ``parallel/anyflow.far_attention``)."""
    full = (height // config.patch_size[1]) * (width // config.patch_size[2])
    compressed = (height // config.compressed_patch_size[1]) * (width // config.compressed_patch_size[2])
    tokens = config.full_chunk_limit * longest * full
    tokens += max(0, num_chunks - config.full_chunk_limit + 1) * longest * compressed
    if ring == 1:
        return tokens + max(128, ulysses)
    return -(-tokens // ring) + 2 * ulysses


def kv_cache_bytes(
    config: Any,
    *,
    rows: int,
    partition: list[int],
    height: int,
    width: int,
    dtype_bytes: int,
    ring: int = 1,
    ulysses: int = 1,
) -> int:
    """Bytes of the K/V cache one rank holds for a rollout over ``partition`` (``height``/``width`` in
    latent pixels) under ring degree ``ring`` and Ulysses degree ``ulysses`` (H/U heads of its tokens)."""
    tokens = cache_tokens(
        config,
        num_chunks=max(len(partition), 2),
        longest=max(partition),
        height=height,
        width=width,
        ring=ring,
        ulysses=ulysses,
    )
    heads = config.num_attention_heads // ulysses
    per_layer = 2 * rows * heads * config.attention_head_dim * tokens * dtype_bytes
    return per_layer * config.num_layers


@dataclass(eq=False)
class FarRollout:
    """One video's chunk-autoregressive state (identical on every rank)."""

    partition: list[int]  # latent frames per chunk, known so far (a session grows it chunk by chunk)
    rows: int  # videos (n)
    guided: bool
    height: int  # latent height and width
    width: int
    noise: torch.Tensor | None  # (rows, T, C, h, w) drawn up front when the length is known
    generator: torch.Generator  # per-chunk draws otherwise
    outputs: list[torch.Tensor] = field(default_factory=list)  # finished chunks (rows, f, C, h, w)
    kv_cache: dict[int, FarLayerCache] | None = None
    cache_chunks: int = 0  # the chunks ``kv_cache`` has room for
    kv_flag: dict[str, Any] = field(default_factory=lambda: {"num_cached_chunks": 0, "is_cache_step": False})
    cache_prompt: tuple | None = None  # the prompt the cached K/V were computed with (None: none valid)
    feat_map: list | None = None  # the VAE decoder's causal cache (sessions)
    decoded_frames: int = 0

    @property
    def next_chunk(self) -> int:
        return len(self.outputs)


# The cache forward's attention follows the chunk spans in its ``FarCall``; a non-None mask stops diffusers
# from building a flex block mask nobody reads.
_SPANS_IN_FLAG = object()


def flow_map_step(pred: torch.Tensor, sigmas: torch.Tensor, i: int, sample: torch.Tensor) -> torch.Tensor:
    """``FlowMapEulerDiscreteScheduler.step(pred, timesteps[i], sample)``'s arithmetic (from sigma i to
    sigma i + 1, in the schedule's dtype), without its look-up of the step index from the timestep's
    value (three reads back from the device)."""
    shape = [1] * pred.ndim
    sigma_t, sigma_r = sigmas[i].view(shape), sigmas[i + 1].view(shape)
    return (sample - (sigma_t - sigma_r) * pred).to(pred.dtype)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float, channel_first: bool):
    """``WanRMS_norm.forward``'s arithmetic (its scale is the square root of gamma's length)."""
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normalized = torch.nn.functional.normalize(wide, dim=1 if channel_first else -1).to(x.dtype)
    return normalized * gamma.shape[0] ** 0.5 * gamma + bias


@functools.cache
def compiled_rms_norm():
    """:func:`rms_norm` compiled once for every norm of the decoder: sizes (channels, frames, pixels)
    symbolic, so the norms of every stage share a few graphs. Compiled per module, each stage's channel
    count (a parameter's, so static) and frame count made new graphs of the one forward until dynamo's
    recompile limit (8), after which the later norms ran eagerly."""
    return torch.compile(rms_norm, dynamic=True)


def _norm_call(module, x: torch.Tensor) -> torch.Tensor:
    bias = module.bias.detach() if isinstance(module.bias, torch.Tensor) else module.bias
    # Detached: dynamo keeps a parameter's sizes static, a plain tensor's symbolic.
    return compiled_rms_norm()(x, module.gamma.detach(), bias, module.channel_first)


class AnyFlowRunner(PipelineRunner):
    default_guidance = 1.0  # released checkpoints fuse guidance into the weights

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.sessions: dict[str, FarRollout] = {}
        self._embeds: tuple[tuple, dict] | None = None  # the last prompt's embeddings (sessions reuse them)
        self._rope_shift: tuple[int, int] | None = None  # see _rope_table
        self._schedules: dict[int, tuple[torch.Tensor, torch.Tensor, list[bool]]] = {}
        self._latent_stats: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # see _unscale

    # -- encoders ---------------------------------------------------------------------------------------
    def _guidance(self, params: GenerationParams) -> float:
        return params.guidance_scale if params.guidance_scale is not None else self.default_guidance

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        pipe = self.pipe
        do_cfg = self._guidance(params) > 1.0
        key = (params.prompt, params.negative_prompt if do_cfg else None, do_cfg, params.n)
        if self._embeds is not None and self._embeds[0] == key:
            out = dict(self._embeds[1])
        else:
            embeds, neg_embeds = pipe.encode_prompt(
                prompt=params.prompt,
                negative_prompt=params.negative_prompt,
                do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=params.n,
                max_sequence_length=min(self.max_sequence_length, pipe.tokenizer.model_max_length),
                device=self.device,
            )
            out = {"cond": {"encoder_hidden_states": embeds.to(self.dtype)}}
            if do_cfg:
                out["uncond"] = {"encoder_hidden_states": neg_embeds.to(self.dtype)}
            self._embeds = (key, dict(out))
        out["context"] = self._first_frame(params) if params.images else None
        return out

    def _first_frame(self, params: GenerationParams) -> torch.Tensor:
        """The first frame's latents (rows, 1, C, h, w), as the pipeline's ``video=`` path encodes them."""
        # upright and 8-bit, as diffusers' load_image gives it (an EXIF-turned phone photo, a 16-bit PNG)
        image = open_image(params.images[0])
        latents = self.pipe.encode_video([image], height=params.height, width=params.width)
        return latents.to(self.dtype).repeat(params.n, 1, 1, 1, 1)

    # -- requests ---------------------------------------------------------------------------------------
    def _rollout(self, params: GenerationParams, partition: list[int], *, noise_up_front: bool) -> FarRollout:
        pipe = self.pipe
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latent_h = params.height // pipe.vae_scale_factor_spatial
        latent_w = params.width // pipe.vae_scale_factor_spatial
        noise = None
        if noise_up_front:  # exactly the pipeline's draw: all frames at once, (B, C, T, h, w) in fp32
            temporal = pipe.vae_scale_factor_temporal
            num_frames = (sum(partition) - 1) * temporal + 1
            channels = pipe.transformer.config.in_channels
            noise = pipe.prepare_latents(
                params.n,
                channels,
                params.height,
                params.width,
                num_frames,
                torch.float32,
                self.device,
                generator,
            )
            noise = noise.to(self.dtype).permute(0, 2, 1, 3, 4)
        return FarRollout(
            partition=list(partition),
            rows=params.n,
            guided=self._guidance(params) > 1.0,
            height=latent_h,
            width=latent_w,
            noise=noise,
            generator=generator,
        )

    def _state(
        self, req_id, params, encoded, rollout: FarRollout, num_steps: int, bucket: tuple
    ) -> RequestState:
        scheduler = request_scheduler(self.pipe)
        state = RequestState(
            req_id=req_id,
            params=params,
            latents=torch.empty(0),
            scheduler=scheduler,
            timesteps=torch.zeros(num_steps),  # the step count; each chunk sets its own schedule
            cond=encoded["cond"],
            uncond=encoded.get("uncond"),
            cfg_scale=self._guidance(params),
            bucket=bucket,
            # chunk_step: the next flow-map step of the current chunk, -1 before the chunk began
            extra={"rollout": rollout, "context": encoded.get("context"), "chunk_step": -1, "shared": {}},
        )
        return state

    @staticmethod
    def _refuse(params: GenerationParams, chunk: bool = False) -> None:
        """What this runner's own chunk loop does not apply: refused rather than silently dropped. A whole
        video applies its adapters (every forward of its own, the K/V cache encodings too); a realtime
        session's chunks take none."""
        if chunk and params.lora:
            raise ValueError("lora: realtime sessions of AnyFlow-FAR take no adapters")
        if params.cache is not None and params.cache.enabled:
            raise ValueError(f"cache: step caching ({params.cache.policy}) is not supported for AnyFlow-FAR")

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        """A whole video: every chunk of its partition, one after the other."""
        self._refuse(params)
        temporal = self.pipe.vae_scale_factor_temporal
        latent_frames = (params.num_frames - 1) // temporal + 1
        partition = chunk_partition(latent_frames, tuple(self.pipe.transformer.config.chunk_partition))
        rollout = self._rollout(params, partition, noise_up_front=True)
        context = 1 if encoded.get("context") is not None else 0
        steps = context + (len(partition) - context) * params.num_inference_steps
        bucket = ("anyflow", params.height, params.width, params.num_frames)
        state = self._state(req_id, params, encoded, rollout, steps, bucket)
        state.extra["whole"] = True
        return state

    @torch.no_grad()
    def prepare_chunk(
        self,
        req_id: str,
        session_id: str,
        chunk_index: int,
        params: GenerationParams,
        encoded: dict,
        max_chunks: int | None,
    ) -> RequestState:
        """Chunk ``chunk_index`` of realtime session ``session_id`` (``params.num_frames``: frames per chunk;
        ``max_chunks``: the session's length when known, so its noise is the pipeline's draw)."""
        self._refuse(params, chunk=True)
        temporal = self.pipe.vae_scale_factor_temporal
        rollout = self.sessions.get(session_id)
        if rollout is None:
            if chunk_index != 0:
                raise ValueError(f"chunk_index: session {session_id} holds no state (closed or expired)")
            known = max_chunks is not None
            partition = session_partition(params.num_frames, max_chunks or 1, temporal)
            rollout = self._rollout(params, partition, noise_up_front=known)
            self.sessions[session_id] = rollout
        if chunk_index != rollout.next_chunk:
            raise ValueError(
                f"chunk_index: expected chunk {rollout.next_chunk} of {session_id}, got {chunk_index}"
            )
        if chunk_index >= len(rollout.partition):
            rollout.partition.append(params.num_frames // temporal)
        context = chunk_index == 0 and encoded.get("context") is not None
        steps = 1 if context else params.num_inference_steps
        bucket = ("realtime", params.height, params.width, params.num_frames)
        state = self._state(req_id, params, encoded, rollout, steps, bucket)
        state.extra["session"] = session_id
        return state

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    # -- the chunk loop ---------------------------------------------------------------------------------
    def _chunk_noise(self, rollout: FarRollout, index: int) -> torch.Tensor:
        start, size = sum(rollout.partition[:index]), rollout.partition[index]
        if rollout.noise is not None:
            return rollout.noise[:, start : start + size]
        from diffusers.utils.torch_utils import randn_tensor

        channels = self.pipe.transformer.config.in_channels
        shape = (rollout.rows, channels, size, rollout.height, rollout.width)
        noise = randn_tensor(shape, generator=rollout.generator, device=self.device, dtype=torch.float32)
        return noise.to(self.dtype).permute(0, 2, 1, 3, 4)

    def _encoder_states(self, state: RequestState) -> torch.Tensor:
        cond = state.cond["encoder_hidden_states"]
        if state.uncond is None:
            return cond
        return torch.cat([state.uncond["encoder_hidden_states"], cond])

    def _allocate_cache(self, rollout: FarRollout, num_chunks: int) -> None:
        """K/V buffers for a rollout of ``num_chunks`` chunks. A session that outgrows them gets larger ones
        (half as large again, so an endless session reallocates rarely) holding what the old ones held (the
        next cache forward keeps the oldest chunks' keys and values: ``_kept_chunks``), one layer at a time
        (the old buffers freed as the new ones fill)."""
        if rollout.kv_cache is not None and rollout.cache_chunks >= num_chunks:
            return
        if rollout.kv_cache is not None:
            num_chunks = max(num_chunks, rollout.cache_chunks * 3 // 2)
        config = self.pipe.transformer.config
        # Sharded, each rank caches its slice of the heads (Ulysses) and its block of the tokens (ring).
        ring = 1 if self.mesh is None else self.mesh.ring_size
        ulysses = 1 if self.mesh is None else self.mesh.ulysses_size
        tokens = cache_tokens(
            config,
            num_chunks=num_chunks,
            longest=max(rollout.partition),
            height=rollout.height,
            width=rollout.width,
            ring=ring,
            ulysses=ulysses,
        )
        rows = rollout.rows * (2 if rollout.guided else 1)
        heads, dim = config.num_attention_heads // ulysses, config.attention_head_dim
        old, rollout.kv_cache = rollout.kv_cache or {}, {}
        for layer in range(config.num_layers):
            kv = torch.zeros((2, rows, heads, tokens, dim), device=self.device, dtype=self.dtype)
            held = old.pop(layer, None)
            if held is not None:
                kv[:, :, :, : held.kv.shape[3]] = held.kv
            rollout.kv_cache[layer] = FarLayerCache(kv)
        rollout.cache_chunks = num_chunks

    def _transformer(self):
        """The transformer with :class:`FarCausalAttnProcessor` in every block (the parallel plan installs
        its sharded one; a freshly loaded or one-rank model gets the one-rank one here) and its rotary
        table handed to the blocks as a :class:`FarRope`."""
        transformer = self.pipe.transformer
        if not isinstance(transformer.blocks[0].attn1.processor, FarCausalAttnProcessor):
            for block in transformer.blocks:
                block.attn1.set_processor(FarCausalAttnProcessor())
        if not getattr(transformer.rope, "_far_rope_hook", False):
            transformer.rope.register_forward_hook(self._rope_table, with_kwargs=True)
            transformer.rope._far_rope_hook = True
        return transformer

    def _rope_table(self, module, args, kwargs, out) -> FarRope:
        """The rotary table of a forward. A cache forward that keeps the oldest chunks (``_rope_shift``:
        their frames and tokens) runs over the later chunks only, which sit that many frames further on:
        their rows of the table over all chunks."""
        if self._rope_shift is None:
            return FarRope(out)
        frames, tokens = self._rope_shift
        far_cfg = dict(kwargs["far_cfg"])
        far_cfg["total_frames"] += frames
        far_cfg["num_compressed_frames"] += frames
        whole = type(module).forward(module, far_cfg=far_cfg, device=kwargs["device"])
        return FarRope({name: table[:, :, tokens:] for name, table in whole.items()})

    def _kept_chunks(self, state: RequestState, upto: int) -> int:
        """How many of the oldest chunks the cache forward over chunks < ``upto`` can keep as the previous
        one wrote them: those compressed then and now (chunk j's keys and values depend only on chunks <= j,
        their patches, positions and the prompt; the compressed chunks are a prefix that only grows), when
        the previous cache forward (over chunks < ``upto - 1``) wrote these buffers with this prompt. One rank
        or Ulysses; a ring's cache forward is sharded by its tokens and rewrites every chunk."""
        rollout: FarRollout = state.extra["rollout"]
        if self.mesh is not None and self.mesh.ring_size > 1:
            return 0
        if rollout.cache_prompt != self._prompt_key(state):  # none yet, new buffers or a new prompt
            return 0
        limit = self.pipe.transformer.config.full_chunk_limit - 1
        return max(0, upto - 1 - limit)

    @staticmethod
    def _prompt_key(state: RequestState) -> tuple:
        params = state.params
        return (params.prompt, params.negative_prompt if state.uncond is not None else None, params.n)

    def _cache_chunks(self, state: RequestState, upto: int) -> None:
        """The pipeline's ``encode_kv_cache`` after chunk ``upto - 1``: one forward over chunks < ``upto``
        (diffusers re-encodes every finished chunk each time; the oldest ones whose keys and values cannot
        have changed are kept instead, ``_kept_chunks``: the forward's tokens stay bounded in a long
        session)."""
        rollout: FarRollout = state.extra["rollout"]
        transformer = self._transformer()
        config = transformer.config
        partition = rollout.partition[:upto]
        kept = self._kept_chunks(state, upto)
        flag = rollout.kv_flag
        flag["is_cache_step"] = True
        latents = torch.cat(rollout.outputs[kept:upto], dim=1)
        inputs = torch.cat([latents] * 2) if rollout.guided else latents
        inputs = inputs.to(self.dtype)
        zeros = torch.zeros((inputs.shape[0], inputs.shape[1]), device=self.device, dtype=torch.long)
        # The cache sequence: the oldest chunks compressed (all but the last full_chunk_limit - 1), then the
        # full ones; a chunk attends to every chunk up to its own (diffusers' "cache" block mask).
        h, w = inputs.shape[-2:]
        full = (h // config.patch_size[1]) * (w // config.patch_size[2])
        compressed = (h // config.compressed_patch_size[1]) * (w // config.compressed_patch_size[2])
        num_compressed = max(0, len(partition) - (config.full_chunk_limit - 1))
        ends, end = [], 0
        for j, frames in enumerate(partition):
            end += frames * (compressed if j < num_compressed else full)
            ends.append(end)
        base = ends[kept - 1] if kept else 0
        self._rope_shift = (sum(partition[:kept]), base) if kept else None
        self._adapters(state, inputs.shape[0])
        try:
            transformer(
                hidden_states=inputs,
                chunk_partition=partition[kept:],
                timestep=zeros,
                r_timestep=zeros,
                encoder_hidden_states=self._encoder_states(state),
                attention_mask=_SPANS_IN_FLAG,  # not None: diffusers would build its block mask
                return_dict=False,
                kv_cache=rollout.kv_cache,
                kv_cache_flag=FarCall(flag, ends=tuple(ends[kept:]), base=base),
            )
        finally:
            self._rope_shift = None
        flag["num_cached_chunks"] += 1
        flag["is_cache_step"] = False
        rollout.cache_prompt = self._prompt_key(state)

    def _adapters(self, state: RequestState, rows: int) -> None:
        """The next transformer call's rows are ``state``'s alone (each forward runs one request): its
        adapters, or none, for the LoRA layers (as the shared step loop's forwards declare theirs)."""
        if self.before_forward is not None:
            self.before_forward([(state, rows)])

    def _begin_chunk(self, state: RequestState) -> None:
        rollout: FarRollout = state.extra["rollout"]
        index = rollout.next_chunk
        if index > 0:
            self._allocate_cache(rollout, max(len(rollout.partition), index + 1))
            while rollout.kv_flag["num_cached_chunks"] < index:
                self._cache_chunks(state, rollout.kv_flag["num_cached_chunks"] + 1)
        elif rollout.kv_cache is None:
            self._allocate_cache(rollout, len(rollout.partition))
        state.latents = self._chunk_noise(rollout, index)
        state.extra["schedule"] = self._schedule(state)
        state.extra["chunk_step"] = 0

    def _schedule(self, state: RequestState) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """A chunk's flow-map schedule (the same for every chunk): the scheduler's timesteps and sigmas on
        the device, and which steps the pipeline skips (t == r), known on the host: the steps never wait for
        the device (``set_timesteps`` per chunk copies the schedule over and waits; ``scheduler.step`` reads
        the timestep back, three times a call)."""
        steps = state.params.num_inference_steps
        if steps not in self._schedules:
            scheduler = state.scheduler
            scheduler.set_timesteps(steps, device="cpu")  # computed on the host, then moved
            n = scheduler.config.num_train_timesteps
            skips = [bool(scheduler.timesteps[i] == scheduler.sigmas[i + 1] * n) for i in range(steps)]
            self._schedules[steps] = (
                scheduler.timesteps.to(self.device),
                scheduler.sigmas.to(self.device),
                skips,
            )
        return self._schedules[steps]

    def _end_chunk(self, state: RequestState) -> None:
        rollout: FarRollout = state.extra["rollout"]
        rollout.outputs.append(state.latents)
        state.extra["chunk_step"] = -1

    def _flow_step(self, state: RequestState) -> None:
        rollout: FarRollout = state.extra["rollout"]
        i = state.extra["chunk_step"]
        timesteps, sigmas, skips = state.extra["schedule"]
        state.extra["chunk_step"] = i + 1
        if skips[i]:  # the pipeline's ``t == r``
            return
        t = timesteps[i]
        r = sigmas[i + 1] * state.scheduler.config.num_train_timesteps
        chunk = state.latents
        inputs = torch.cat([chunk] * 2) if rollout.guided else chunk
        frames = inputs.shape[1]
        timestep = t.expand(inputs.shape[0]).unsqueeze(-1).repeat((1, frames))
        r_timestep = r.expand(inputs.shape[0]).unsqueeze(-1).repeat((1, frames))
        partition = rollout.partition[: rollout.next_chunk + 1]
        self._adapters(state, inputs.shape[0])
        pred, _ = self._transformer()(
            hidden_states=inputs,
            timestep=timestep,
            r_timestep=r_timestep,
            encoder_hidden_states=self._encoder_states(state),
            return_dict=False,
            chunk_partition=partition,
            kv_cache=rollout.kv_cache,
            kv_cache_flag=FarCall(rollout.kv_flag),
        )
        if rollout.guided:
            uncond, cond = pred.chunk(2)
            pred = uncond + state.cfg_scale * (cond - uncond)
        state.latents = flow_map_step(pred, sigmas, i, chunk)

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        for state in states:
            rollout: FarRollout = state.extra["rollout"]
            context = state.extra["context"]
            if rollout.next_chunk == 0 and context is not None:
                # Image-to-video: the first chunk is the given frame, encoded (no denoising).
                rollout.outputs.append(context)
                state.step_index += 1
                continue
            if state.extra["chunk_step"] < 0:
                self._begin_chunk(state)
            self._flow_step(state)
            state.step_index += 1
            if state.extra["chunk_step"] >= state.params.num_inference_steps:
                self._end_chunk(state)

    def model_forward(self, latents, timesteps, inputs, shared):  # steps run through ``step``
        raise NotImplementedError("AnyFlow-FAR runs its own chunk loop (AnyFlowRunner.step)")

    # -- decode ---------------------------------------------------------------------------------------
    def _unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """(rows, f, C, h, w) transformer latents → the VAE's (rows, C, f, h, w), as the pipeline does."""
        vae = self.pipe.vae
        latents = latents.permute(0, 2, 1, 3, 4).to(vae.dtype)
        key = (latents.device, latents.dtype)
        stats = self._latent_stats.get(key)
        if stats is None:  # made once: a host-to-device copy blocks the decode thread on its stream
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
                latents
            )
            stats = self._latent_stats[key] = (mean, inv_std)
        mean, inv_std = stats
        return latents / inv_std + mean

    @staticmethod
    def _frames(video: torch.Tensor) -> np.ndarray:
        """(rows, 3, f, H, W) decoded video → uint8 (rows, f, H, W, 3): the arithmetic of the pipeline's
        ``postprocess_video(output_type="np")`` and ``to_uint8``, done on the device (one uint8 copy to the
        host instead of a float one and four passes over it in numpy)."""
        video = (video * 0.5 + 0.5).clamp(0, 1)  # ``denormalize``, in the VAE's dtype as the pipeline
        video = (video.permute(0, 2, 3, 4, 1).float() * 255).round().clamp(0, 255)
        return video.to(torch.uint8).cpu().numpy()

    def _vae(self):
        """The VAE; with ``--compile`` (the transformer's blocks compiled) its decoder's RMS norms are compiled
        too: in eager each is seven passes over the activations with an fp32 copy, the largest memory cost
        of the decoder at 480p next to its 3D convolutions (``benchmarks/probes/realtime_profile.py``). One
        compiled function with dynamic shapes serves them all (:func:`compiled_rms_norm`)."""
        vae = self.pipe.vae
        compiled = getattr(self.pipe.transformer.blocks[0], "_compiled_call_impl", None) is not None
        if compiled and not getattr(vae, "_far_norms_compiled", False):
            for module in vae.decoder.modules():
                if type(module).__name__ == "WanRMS_norm":
                    module._compiled_call_impl = functools.partial(_norm_call, module)
            vae._far_norms_compiled = True
        return vae

    @staticmethod
    def _tuned_convolutions():
        """cuDNN picks its 3D convolution algorithms by timing them (once per shape: a session's chunks repeat
        the shapes); only inside the decode, which is where the 3D convolutions are."""
        cudnn = torch.backends.cudnn
        return cudnn.flags(
            enabled=cudnn.enabled,
            benchmark=True,
            deterministic=cudnn.deterministic,
            allow_tf32=cudnn.allow_tf32,
        )

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        rollout: FarRollout = state.extra["rollout"]
        if not state.extra.get("whole"):  # a session's last chunk
            return self._decode_chunk(rollout, rollout.outputs[-1])
        with self._tuned_convolutions():
            latents = self._unscale(torch.cat(rollout.outputs, dim=1))
            return self._frames(self._vae().decode(latents, return_dict=False)[0])

    def chunk_decoder(self, state: RequestState):
        """A session chunk's decode, bound now to its latents (the rollout's last chunk) and run later,
        maybe in another thread while the next chunk is denoised: ``decode(stream)`` on CUDA stream
        ``stream`` (None: the current one) gives its frames, uint8 (rows, f, H, W, 3)."""
        rollout: FarRollout = state.extra["rollout"]
        latents = rollout.outputs[-1]

        def decode(stream: torch.cuda.Stream | None = None) -> np.ndarray:
            if stream is not None:  # the step loop's stream may free the rollout (session closed) meanwhile
                latents.record_stream(stream)
            with torch.no_grad():
                return self._decode_chunk(rollout, latents)

        return decode

    def _decode_chunk(self, rollout: FarRollout, latents: torch.Tensor) -> np.ndarray:
        """One chunk's frames through the decoder with the causal cache its predecessors left
        (``rollout.feat_map``): the frames of all chunks equal one decode of the whole video."""
        vae = self._vae()
        with self._tuned_convolutions():
            if rollout.feat_map is None:
                # The decoder's own count of cached convolutions, without ``clear_cache``: that resets the
                # VAE's encoder state too, which the step loop may be using (a first frame's encode).
                counts = getattr(vae, "_cached_conv_counts", None)
                if counts is None:
                    vae.clear_cache()
                rollout.feat_map = [None] * (counts["decoder"] if counts is not None else vae._conv_num)
            x = vae.post_quant_conv(self._unscale(latents))
            pieces = []
            for i in range(x.shape[2]):
                pieces.append(
                    vae.decoder(
                        x[:, :, i : i + 1],
                        feat_cache=rollout.feat_map,
                        feat_idx=[0],
                        first_chunk=rollout.decoded_frames == 0,
                    )
                )
                rollout.decoded_frames += 1
            return self._frames(torch.clamp(torch.cat(pieces, dim=2), min=-1.0, max=1.0))
