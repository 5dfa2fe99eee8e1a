"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (a CLIP image encoder; the transformer
cross-attends to its image tokens beside the text) and Wan 2.2 I2V A14B (no image encoder, two experts).

The first frame (``params.images[0]``) is resized to the request's size by the pipeline's video processor
and VAE-encoded on the encoder rank, with a frame mask, into ``condition`` channels that are concatenated to
the noisy latents at every step; everything else (experts, CFG, decode) is :class:`WanRunner`'s.
"""

from __future__ import annotations

import torch

from ..request import GenerationParams
from .wan import WanRunner, first_frame_image, image_condition

# WanAttnProcessor takes everything before the last 512 context tokens as image tokens ("512 is the
# context length of the text encoder, hardcoded") where attn2 projects them apart (added_kv_proj_dim): then
# the text is always 512 long.
IMAGE_TEXT_LENGTH = 512


class WanI2VRunner(WanRunner):
    @property
    def image_tokens(self) -> bool:
        """Wan 2.1 I2V: the transformer takes CLIP image embeddings (``image_dim``)."""
        return self.pipe.transformer.config.image_dim is not None

    def num_latent_channels(self) -> int:
        return self.pipe.vae.config.z_dim  # the transformer's input adds the condition channels

    @property
    def image_text_split(self) -> bool:
        """attn2 projects the image tokens apart (``added_kv_proj_dim``), splitting them off by the text's
        hard-coded 512 tokens. Without it (diffusers' test config) they share attn2's projections with the
        text, whose length is the pipeline's max_sequence_length as anywhere."""
        return self.image_tokens and self.pipe.transformer.config.added_kv_proj_dim is not None

    def text_length(self) -> int:
        return IMAGE_TEXT_LENGTH if self.image_text_split else super().text_length()

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        if not params.images:
            raise ValueError("input_reference: this image-to-video model needs the first frame")
        out = self.encode_text(params)
        if self.image_tokens:
            # The CLIP embeddings of the (unresized) image, as WanImageToVideoPipeline.encode_image.
            embeds = self.pipe.encode_image(first_frame_image(params), self.device)
            embeds = embeds.to(self.dtype).repeat(params.n, 1, 1)
            for branch in ("cond", "uncond"):
                if branch in out:
                    out[branch]["encoder_hidden_states_image"] = embeds
        out.update(image_condition(self.pipe, params, self.device))
        return out

    def _row_inputs(self, encoded: dict, params: GenerationParams) -> tuple[dict, dict | None, dict]:
        if self.expand_timesteps:  # TI2V-style folders: the first latent frame replaced, per-token timesteps
            return super()._row_inputs(encoded, params)
        cond, uncond = dict(encoded["cond"]), encoded.get("uncond")
        uncond = None if uncond is None else dict(uncond)
        for rows in (cond, uncond):
            if rows is not None:
                rows["condition"] = encoded["condition"]  # (n, 4 mask + z_dim, frames, h, w), fp32
        return cond, uncond, {}
