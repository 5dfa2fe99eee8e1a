"""``POST /v1/images/edits`` in the shape of OpenAI's images API (an ``APIRouter`` included by ``frontend``),
and the checks the gRPC ``EditImage`` shares.

The body is ``multipart/form-data`` as OpenAI's client sends it: the image file once as ``image``, or
several as ``image[]``; ``mask``; the text fields of :class:`~ditserve.cluster.schemas.ImageEditRequest`
(``lora`` and ``cache`` as JSON text, or as the ``lora[name]`` / ``cache[policy]`` fields the client makes
of a mapping in ``extra_body``). What the model does with the images depends on its family: an edit
model (``Family.edit_pipelines``, e.g. FLUX.1 Kontext) takes them as references; another image family with
``Family.img2img`` starts from the first image noised to ``strength`` (image-to-image).

Every upload is decoded here once, only to check it (a PNG / JPEG / WebP within ``max_image_bytes`` and
``max_image_pixels``); the engine receives the encoded bytes, and how many images the model takes (and
whether it takes a mask) is checked by the engine, where the model is known. Each refusal is a 400
naming the field. The answer is the images response of ``POST /v1/images/generations``, in the asked
``output_format`` (png, jpeg or webp).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import ValidationError

from ditserve.replica.families import fit_size
from ditserve.replica.media import check_image
from ditserve.replica.request import GenerationParams

from .errors import BadRequest, validation_error
from .http_base import (
    MIN_SIDE,
    REPLICA_HEADER,
    check_size,
    form_list,
    frontend,
    list_in_form,
    multipart_message,
    nest_form_fields,
)
from .schemas import ImageData, ImageEditRequest, ImagesResponse, usage_of

EDITS_PATH = "/v1/images/edits"
IMAGE_FIELDS = ("image", "image[]")

router = APIRouter(tags=["images"])


def upload_allowance(fe: Any) -> int:
    """Bytes an edit request may carry beyond ``max_body_bytes``: its image files (the model's reference
    count, or one start image) and a mask where the family inpaints."""
    family = fe.spec.family_spec
    files = max(1, fe.spec.max_references) + (1 if family.inpainting else 0)
    return files * fe.args.max_image_bytes


def _edit_size(fe: Any, size: str | None, sizes: list[tuple[int, int]], masked: bool) -> tuple[int, int]:
    """The requested size, or (absent / "auto") the edit or inpaint pipeline's own choice from the images
    (``ModelSpec.edit_request_size``), scaled down to the server's maximum and rounded down to the model's
    size multiple."""
    limits, multiple = fe.args, fe.spec.size_multiple
    if size not in (None, "", "auto"):
        return check_size(size, limits.max_width, limits.max_height, multiple)
    width, height = fit_size(
        fe.spec.edit_request_size(list(sizes), masked), limits.max_width, limits.max_height, 1
    )
    width, height = width // multiple * multiple, height // multiple * multiple
    least = max(multiple, MIN_SIDE)
    if min(width, height) < least:  # the image's own sides, not the pipeline's choice from them
        shown = ", ".join(f"{w}x{h}" for w, h in sizes)
        raise BadRequest(
            f"size: the image ({shown}) fitted within {limits.max_width}x{limits.max_height} is under "
            f"{least} pixels on a side; give size",
            param="size",
        )
    return width, height


def mask_shape_refusal(mask: tuple[int, int], image: tuple[int, int]) -> str | None:
    """Why a mask of upright (width, height) ``mask`` does not fit the image, or None. A mask is stretched
    over the image as diffusers' inpaint pipelines stretch it; one of another shape (beyond a pixel's
    rounding) would repaint other places than it shows."""
    (mw, mh), (iw, ih) = mask, image
    if abs(mw * ih - mh * iw) > max(iw, ih, mw, mh):
        return f"{mw}x{mh} is not the shape of the image ({iw}x{ih}); send a mask of the image's size"
    return None


def edit_params(
    fe: Any, body: ImageEditRequest, images: list[bytes], mask: bytes | None
) -> tuple[GenerationParams, int, int]:
    """Checks shared by HTTP and gRPC (limits, model kind, the uploads) → engine parameters, width, height."""
    fe.check_model(body.model)
    if fe.model_kind != "image":
        raise BadRequest(f"model {fe.model_name!r} makes videos; use POST /v1/videos", param="model")
    if body.response_format != "b64_json":
        raise BadRequest("response_format: only 'b64_json' is supported", param="response_format")
    limits = fe.args
    if body.n > limits.max_n:
        raise BadRequest(f"n: {body.n} is above the maximum {limits.max_n}", param="n")
    body = fe.check_prompt_and_steps(body)
    if not images:
        raise BadRequest(
            "image: at least one image file is required (image, or image[] for several)", param="image"
        )
    sizes = []
    for data in images:
        try:
            sizes.append(
                check_image(
                    data, "image", max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels
                )
            )
        except ValueError as exc:
            raise BadRequest(str(exc), param="image") from None
    if mask is not None:
        if not fe.spec.inpaints:  # said before the mask is read: it is not used
            raise BadRequest(f"mask: {fe.spec.mask_refusal()}", param="mask")
        try:
            mask_size = check_image(
                mask, "mask", max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels
            )
        except ValueError as exc:
            raise BadRequest(str(exc), param="mask") from None
        if (refused := mask_shape_refusal(mask_size, sizes[0])) is not None:
            raise BadRequest(f"mask: {refused}", param="mask")
    if body.strength is not None and fe.spec.edits and mask is None:
        inpaints = " (with a mask it inpaints, and takes strength)" if fe.spec.inpaints else ""
        raise BadRequest(
            f"strength: {fe.model_name} takes the images as references and does not noise them{inpaints}; "
            "leave it out",
            param="strength",
        )
    width, height = _edit_size(fe, body.size, sizes, mask is not None)
    return body.to_params(width, height, fe.spec, tuple(images), mask), width, height


def _read_form(content_type: str, raw: bytes) -> tuple[dict[str, str], list[bytes], bytes | None]:
    """multipart/form-data → (text fields, image files in order, mask), with the standard library's MIME
    parser (binary parts come back byte for byte)."""
    if not content_type.lower().startswith("multipart/form-data"):  # media types ignore case (RFC 9110)
        raise BadRequest("request body must be multipart/form-data (image files and text fields)")
    message = multipart_message(content_type, raw)
    fields: dict[str, str] = {}
    images: list[bytes] = []
    mask: bytes | None = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        data = part.get_payload(decode=True) or b""
        if name in (*IMAGE_FIELDS, "mask") and part.get_filename() == "" and not data:
            continue  # an HTML form's file input left empty (filename "", no bytes): no file given
        if name in IMAGE_FIELDS:
            images.append(data)
        elif name == "mask":
            if mask is not None:
                raise BadRequest("mask: one mask per request", param="mask")
            mask = data
        elif part.get_filename():
            raise BadRequest(f"{name}: files are taken only as image, image[] and mask", param=name)
        elif name in fields:
            if (listed := form_list(name)) is not None:  # a second item's lora[][name]: a list
                raise list_in_form(listed)
            raise BadRequest(f"{name}: given more than once", param=name)
        else:
            try:
                fields[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"{name}: not UTF-8 text", param=name) from None
    return fields, images, mask


def _parsed_edit(fe: Any, content_type: str, raw: bytes) -> tuple[GenerationParams, ImageEditRequest]:
    fields, images, mask = _read_form(content_type, raw)
    # lora[name], cache[policy]: a mapping OpenAI's client sent from extra_body, folded as videos fold it
    body = validate_edit(nest_form_fields(fields))
    params, _, _ = edit_params(fe, body, images, mask)
    return params, body


def validate_edit(data: dict[str, Any]) -> ImageEditRequest:
    try:
        return ImageEditRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def encode_output(png: bytes, output_format: str, compression: int | None) -> bytes:
    """The engine's PNG in the asked ``output_format`` (jpeg / webp at quality ``compression``, default 100).
    A JPEG of quality 90 or more keeps full-resolution colour (4:4:4): Pillow's default 4:2:0 halves the
    chroma, which on a detailed picture costs more than the quality asked for (24 dB against 50 dB at 100)."""
    if output_format == "png":
        return png
    quality = 100 if compression is None else compression
    extra = {"subsampling": 0} if output_format == "jpeg" and quality >= 90 else {}
    buf = io.BytesIO()
    with Image.open(io.BytesIO(png)) as image:
        image.convert("RGB").save(buf, format=output_format.upper(), quality=quality, **extra)
    return buf.getvalue()


def images_response(
    result: Any, output_format: str = "png", compression: int | None = None
) -> dict[str, Any]:
    """The images response of ``POST /v1/images/generations``, the images in ``output_format``."""
    response = ImagesResponse(
        created=int(time.time()),
        data=[
            ImageData(b64_json=base64.b64encode(encode_output(png, output_format, compression)).decode())
            for png in result.outputs
        ],
        seed=result.seed,
        size=f"{result.width}x{result.height}",
        usage=usage_of(result),
        output_format=output_format,
    )
    return response.model_dump(exclude_none=True)


def _binary(description: str) -> dict[str, Any]:
    return {"type": "string", "format": "binary", "description": description}


def _form_schema() -> dict[str, Any]:
    """The multipart body's schema: the files beside the text fields."""
    schema = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    properties = schema["properties"]
    for name in ("lora", "cache"):  # JSON text in a form
        properties[name] = {"type": "string", "description": properties[name]["description"]}
    schema.pop("$defs", None)
    schema["properties"] = {
        "image": _binary("The image to edit (PNG, JPEG or WebP); several as image[]."),
        "image[]": {
            "type": "array",
            "items": _binary("A reference image."),
            "description": "Several images.",
        },
        "mask": _binary(
            "Inpainting mask of the image's shape (image-to-image models that inpaint; FLUX.1 Kontext, "
            "Qwen-Image-Edit and FLUX.2 Klein): its transparent pixels are repainted, or without transparency its white ones."
        ),
        **schema["properties"],
    }
    return schema


@router.post(
    EDITS_PATH,
    response_model=ImagesResponse,
    openapi_extra={
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _form_schema()}}}
    },
)
async def images_edits(request: Request, fe: Any = Depends(frontend)) -> Response:
    """Edit (reference images) or image-to-image, by the served model's family. With ``stream: true``:
    server-sent ``image_edit.*`` events (api_stream), ``partial_images`` of them previews."""
    fe.check_auth(request, admin=False)
    content_type, raw = request.headers.get("content-type", ""), await request.body()
    # Parsing the form and checking its images is CPU work in proportion to the upload: off the event loop
    # that serves every other request.
    params, body = await asyncio.to_thread(_parsed_edit, fe, content_type, raw)
    if body.stream:
        if body.output_format != "png":
            raise BadRequest("output_format: streamed images are png; leave it out", param="output_format")
        return await fe.stream_images(params, partial_images=body.partial_images, kind="image_edit")
    answer = await fe.call_engine(fe.generate.remote(params))
    # Re-encoding (jpeg / webp) is CPU work: off the event loop that serves every other request.
    response = await asyncio.to_thread(
        images_response, answer["result"], body.output_format, body.output_compression
    )
    return JSONResponse(response, headers={REPLICA_HEADER: answer["replica"]})
