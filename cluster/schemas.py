"""HTTP request and response bodies (OpenAI shapes plus ditserve's extensions), and the one error shape."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from ditserve.replica.caching import CacheSettings
from ditserve.replica.jsonfields import JsonInt, json_int
from ditserve.replica.models.registry import ModelSpec
from ditserve.replica.request import GenerationParams, LoRARef

from .errors import BadRequest


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("prompt must not be empty")
    return value


# A prompt in every request body (images, videos, sessions): at least one non-blank character.
Prompt = Annotated[str, StringConstraints(min_length=1), AfterValidator(_non_blank)]

SIZE_RE = re.compile(r"^(\d{1,9})x(\d{1,9})$")  # a side past 9 digits is no size at all


# The ``quality`` values of OpenAI's image routes (its Python client's ImageGenerateParams, which has all of
# ImageEditParams'): accepted and ignored.
OpenAIQuality = Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"]


class ErrorDetail(BaseModel):
    message: str = Field(description="What is wrong, naming the field or flag and the fix.")
    type: str = Field(description="Kind of error, e.g. invalid_request_error, authentication_error.")
    param: str | None = Field(default=None, description="The request field the error is about, if one.")
    code: int | None = Field(default=None, description="The HTTP status of the answer.")


class ErrorResponse(BaseModel):
    """The one error shape every 4xx/5xx answer carries (``http_base.error_body``)."""

    error: ErrorDetail


def parse_size(size: str) -> tuple[int, int]:
    """ "WxH" → (width, height); raises BadRequest naming ``size``."""
    match = SIZE_RE.match(size)
    if not match:
        raise BadRequest(f"size: must look like 'WIDTHxHEIGHT' (e.g. '512x512'), got {size!r}", param="size")
    return int(match.group(1)), int(match.group(2))


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields plus negative_prompt, steps, guidance, seed, lora."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: Prompt = Field(description="What to draw.")
    model: str | None = Field(
        default=None, description="Model name (GET /v1/models); default: the served one."
    )
    n: JsonInt = Field(strict=True, default=1, ge=1, description="Number of images.")
    size: str | None = Field(
        default=None,
        description="WIDTHxHEIGHT, multiples of the model's size multiple (16 for most); absent or 'auto': the model's own default size.",
    )
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json", description="Only b64_json is served."
    )
    negative_prompt: str | None = Field(default=None, description="What not to draw (true CFG with Flux).")
    num_inference_steps: JsonInt = Field(strict=True, default=20, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(
        strict=True, default=None, ge=0, le=100, description="Guidance (model default)."
    )
    true_cfg_scale: float | None = Field(
        strict=True, default=None, ge=0, le=100, description="True-CFG scale (Flux)."
    )
    seed: json_int(ge=0, lt=2**63) | None = Field(
        default=None, description="Random seed (random when absent)."
    )
    lora: LoRARef | list[LoRARef] | None = Field(
        default=None,
        description="Adapter(s) for this request, each {name, scale}: scale is the request's strength of that "
        "adapter (it replaces the scale given at load time, which applies when the request gives none).",
    )
    # Strict: "stream": 0 or "yes" is refused naming the field, as the schema's boolean says.
    stream: bool = Field(
        default=False, strict=True, description="Server-sent progress events before the image."
    )
    preview: bool = Field(
        default=False,
        strict=True,
        description="With stream: an image_generation.partial_image event after each step but the last, "
        "carrying a small PNG of the current latents (partial_image_b64; 1/8 of the image size, no VAE "
        "decode).",
    )
    output_format: Literal["png", "jpeg", "webp"] = Field(
        default="png", description="Encoding of the returned images (stream: png only)."
    )
    output_compression: json_int(ge=0, le=100) | None = Field(
        default=None, description="jpeg / webp quality, 0-100 (default 100); png ignores it."
    )
    partial_images: json_int(ge=0, le=3) | None = Field(
        default=None,
        description="With stream: how many image_generation.partial_image events (the last steps' previews, "
        "as with preview); 0: none. Without stream it is ignored.",
    )
    # Accepted for OpenAI compatibility, ignored: the images are opaque, one quality. Values are OpenAI's:
    # one it does not take is refused (400 naming the field), as OpenAI refuses it.
    user: str | None = None
    safety_identifier: str | None = None
    quality: OpenAIQuality | None = None
    complexity: Literal["low", "medium", "high"] | None = None
    moderation: Literal["low", "auto"] | None = None
    style: Literal["vivid", "natural"] | None = None
    background: Literal["auto", "opaque"] | None = None

    cache: CacheSettings | None = Field(
        default=None,
        description='Step cache for this request, e.g. {"policy": "fbcache", "threshold": 0.1} (steps whose '
        "first-block residual barely changed reuse the rest of the model's last output) or "
        '{"policy": "taylorseer", "interval": 3} (forecast between computed steps). Absent: the server\'s '
        'default (--cache-policy); {"policy": "none"} turns it off.',
    )

    def to_params(self, width: int, height: int, spec: ModelSpec) -> GenerationParams:
        loras = () if self.lora is None else tuple(self.lora if isinstance(self.lora, list) else [self.lora])
        kwargs: dict[str, Any] = {}
        if self.seed is not None:
            kwargs["seed"] = self.seed
        negative, true_cfg = spec.guidance_defaults(self.negative_prompt, self.true_cfg_scale)
        return GenerationParams(
            prompt=self.prompt,
            negative_prompt=negative,
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            true_cfg_scale=true_cfg,
            n=self.n,
            cache=self.cache,
            lora=loras,
            **kwargs,
        )


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class InputTokensDetails(BaseModel):
    text_tokens: int = Field(
        description="The prompt's tokens by the tokenizer of the text encoder the transformer attends (T5's "
        "for Flux and SD3), without special tokens, chat template or padding, cut where the model cuts it; "
        "plus the negative prompt's, counted alike, where the uncond branch read it."
    )
    image_tokens: int = Field(
        default=0,
        description="0: input images are not counted as tokens (an edit's image becomes the start latents or "
        "reference latents, whose size depends on the model; transformer_forwards says what they cost).",
    )


class Usage(BaseModel):
    """What a request cost: OpenAI's token fields (what ``openai``'s ``ImagesResponse.usage`` reads) and
    ditserve's transformer forwards, with how many the step cache answered."""

    input_tokens: int = Field(description="text_tokens + image_tokens.")
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(
        default=0,
        description="0: a diffusion model generates no tokens; its images are denoised latents, whose cost "
        "is transformer_forwards.",
    )
    total_tokens: int = Field(description="input_tokens + output_tokens.")
    transformer_forwards: int = Field(
        description="Transformer forwards of the request (one per CFG branch and step)."
    )
    cached_forwards: int = Field(
        description="Of those, forwards whose blocks after the first the step cache skipped."
    )
    cache_policy: str = Field(default="none", description="The step cache policy the request ran with.")


def usage_of(result: Any) -> dict[str, Any] | None:
    """A result's usage as the API returns it (None when the engine reported none)."""
    if not getattr(result, "usage", None):
        return None
    return api_usage(result.usage)


def api_usage(engine_usage: dict[str, Any]) -> dict[str, Any]:
    """The engine's usage (forwards, cache policy, ``text_tokens``) in the API's shape (:class:`Usage`)."""
    cost = dict(engine_usage)
    text = int(cost.pop("text_tokens", 0))
    details = InputTokensDetails(text_tokens=text)
    return Usage(input_tokens=text, input_tokens_details=details, total_tokens=text, **cost).model_dump()


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    usage: Usage | None = Field(default=None, description="What the request cost (step cache included).")
    seed: int | None = Field(default=None, description="Seed used (ditserve extension).")
    size: str | None = None
    output_format: str = "png"
    background: Literal["opaque"] = Field(default="opaque", description="The images have no transparency.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ditserve"
    kind: Literal["image", "video"]


# -- POST /v1/images/edits ---------------------------------------------------------------------------------

# FluxImg2ImgPipeline's default strength: image-to-image keeps this much of the noise schedule.
DEFAULT_STRENGTH = 0.6


def json_field(value: Any, info: ValidationInfo) -> Any:
    """A multipart form sends ``lora`` / ``cache`` as JSON text; gRPC and JSON send the value itself."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(
                f"{info.field_name} must be JSON, e.g. {_JSON_EXAMPLES[info.field_name]}"
            ) from None
    return value


_JSON_EXAMPLES = {"lora": '{"name": "style", "scale": 0.8}', "cache": '{"policy": "fbcache"}'}


class ImageEditRequest(BaseModel):
    """``POST /v1/images/edits`` (multipart/form-data, as OpenAI's client sends it): the form's text fields.
    The files (``image`` or ``image[]``, ``mask``) travel beside them. Values arrive as form text, so numbers
    are read from their text; ``lora`` and ``cache`` are JSON text."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: Prompt = Field(description="What the edited image shows.")
    model: str | None = Field(
        default=None, description="Model name (GET /v1/models); default: the served one."
    )
    n: int = Field(default=1, ge=1, description="Number of images.")
    size: str | None = Field(
        default=None,
        description="WIDTHxHEIGHT, multiples of the model's size multiple; 'auto' or absent: what the model's "
        "diffusers edit / img2img / inpaint pipeline draws without height and width (e.g. FLUX.1 Kontext 1024x1024, "
        "FLUX.2 the first image's size up to 1024² pixels, image-to-image the pipeline's default size), rounded "
        "down to the multiple, scaled down to the server's maximum.",
    )
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json", description="Only b64_json is served."
    )
    negative_prompt: str | None = Field(default=None, description="What not to draw (true CFG with Flux).")
    num_inference_steps: int = Field(default=20, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, ge=0, le=100, description="Guidance (model default).")
    true_cfg_scale: float | None = Field(default=None, ge=0, le=100, description="True-CFG scale (Flux).")
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Random seed (random when absent).")
    strength: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=f"Image-to-image (models without reference images): how much of the noise schedule runs, "
        f"1 = from noise, small = keep the image (default {DEFAULT_STRENGTH}; inpainting: the inpaint pipeline's, "
        "Z-Image 1.0). Edit models refuse it, except "
        "with a mask where they inpaint (default: their inpaint pipeline's, FLUX.1 Kontext 1.0, Qwen-Image-Edit "
        "0.6, FLUX.2 Klein 0.8).",
    )
    lora: LoRARef | list[LoRARef] | None = Field(
        default=None, description='Adapter(s) as JSON text, e.g. {"name": "style", "scale": 0.8} or a list.'
    )
    cache: CacheSettings | None = Field(
        default=None, description='Step cache as JSON text, e.g. {"policy": "fbcache", "threshold": 0.1}.'
    )
    output_format: Literal["png", "jpeg", "webp"] = Field(
        default="png", description="Encoding of the returned images."
    )
    output_compression: int | None = Field(
        default=None, ge=0, le=100, description="jpeg / webp quality, 0-100 (default 100); png ignores it."
    )
    # OpenAI's fields, accepted and ignored: the images are opaque, one quality (OpenAI's values only).
    user: str | None = None
    safety_identifier: str | None = None
    quality: OpenAIQuality | None = None
    complexity: Literal["low", "medium", "high"] | None = None
    input_fidelity: Literal["high", "low"] | None = None
    background: Literal["auto", "opaque"] | None = None
    # OpenAI's streaming fields
    partial_images: int | None = Field(
        default=None,
        ge=0,
        le=3,
        description="With stream: how many image_edit.partial_image events (the last steps' latent "
        "previews); 0 or absent: none.",
    )
    stream: bool = Field(
        default=False,
        description="Server-sent events: image_edit.progress per step, image_edit.completed per image (png).",
    )

    _lora_json = field_validator("lora", "cache", mode="before")(json_field)

    def to_params(
        self, width: int, height: int, spec: ModelSpec, images: tuple[bytes, ...], mask: bytes | None
    ) -> GenerationParams:
        loras = () if self.lora is None else tuple(self.lora if isinstance(self.lora, list) else [self.lora])
        kwargs: dict[str, Any] = {}
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if not spec.edits or mask is not None:  # image-to-image, or inpainting: its pipeline's default
            default = spec.default_strength(mask is not None, DEFAULT_STRENGTH)
            kwargs["strength"] = self.strength if self.strength is not None else default
        negative, true_cfg = spec.guidance_defaults(self.negative_prompt, self.true_cfg_scale)
        return GenerationParams(
            prompt=self.prompt,
            negative_prompt=negative,
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            true_cfg_scale=true_cfg,
            n=self.n,
            cache=self.cache,
            lora=loras,
            images=images,
            mask=mask,
            **kwargs,
        )
