"""Pieces of the API that need no server: committed gRPC stubs, the multipart parser, SSE parsing,
latent previews, the proto ↔ pydantic field mapping."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fastapi import Request
from PIL import Image
from pydantic import BaseModel, ConfigDict

from ditserve.cluster.api_videos import VideoCreateRequest, _form_fields
from ditserve.cluster.client import sse_events
from ditserve.cluster.errors import BadRequest
from ditserve.cluster.grpc_gen import build
from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_service import _in_rpc_terms, fields
from ditserve.cluster.replica_streams import latent_preview
from ditserve.cluster.schemas import ImageGenerationRequest


def test_committed_grpc_stubs_match_the_proto():
    assert build.main(["--check"]) == 0, "run python -m ditserve.cluster.grpc_gen.build"


def test_proto_fields_validate_like_http():
    body = ImageGenerationRequest.model_validate(fields(pb.GenerateRequest(prompt="a fox", seed=5, n=2)))
    assert (body.seed, body.n, body.num_inference_steps) == (5, 2, 20)  # unset → the HTTP default
    with pytest.raises(ValueError, match="seed"):
        ImageGenerationRequest.model_validate(fields(pb.GenerateRequest(prompt="a fox", seed=-1)))


def test_grpc_messages_name_the_rpc_where_http_names_a_route():
    assert _in_rpc_terms("replica memory is released; POST /v1/admin/memory/resume first") == (
        "replica memory is released; ResumeMemory first"
    )
    assert _in_rpc_terms("give 1 to 3 (POST /v1/images/edits, not /v1/images/generations)") == (
        "give 1 to 3 (EditImage, not Generate)"
    )
    assert _in_rpc_terms("made with POST /v1/videos and remixed with POST /v1/videos/{id}/remix") == (
        "made with CreateVideo and remixed with RemixVideo"
    )
    assert _in_rpc_terms("shut down by POST /v1/admin/shutdown; restart the service") == (
        "shut down by Shutdown; restart the service"
    )
    assert _in_rpc_terms("image: at least one image file is required (image, or image[] for several)") == (
        "image: at least one image file is required (the image field, once per file)"
    )


def test_multipart_form_fields_as_openai_sends_them():
    boundary = "b0undary"
    raw = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nwaves, at dusk\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="num_frames"\r\n\r\n5\r\n--{boundary}--\r\n'
    ).encode()
    data, upload = _form_fields(f"multipart/form-data; boundary={boundary}", raw)
    assert data == {"prompt": "waves, at dusk", "num_frames": "5"} and upload is None
    assert VideoCreateRequest.model_validate(data).num_frames == 5
    with pytest.raises(BadRequest, match="multipart"):
        _form_fields("multipart/form-data; boundary=zz", b"garbage")


def test_sse_events_stop_at_done():
    lines = ["event: a", 'data: {"x": 1}', "", 'data: {"y": 2}', "", "data: [DONE]", "data: {}"]
    assert list(sse_events(iter(lines))) == [("a", {"x": 1}), ("message", {"y": 2})]


def test_latent_preview_is_a_pixel_per_latent():
    grid = np.random.default_rng(0).standard_normal((8, 12, 16)).astype(np.float32)  # (h, w, channels)
    image = np.array(Image.open(io.BytesIO(latent_preview(grid))))
    assert image.shape == (8, 12, 3) and image.min() == 0 and image.max() >= 254
    one = np.array(Image.open(io.BytesIO(latent_preview(grid[..., :1]))))  # one channel: grey
    assert one.shape == (8, 12, 3) and (one[..., 0] == one[..., 2]).all()


class PromptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str


def _json_app():
    """The ingress's FastAPI app factory and JSON-body middleware around two small routes."""
    from fastapi.testclient import TestClient

    from ditserve.cluster.http_base import JSONBodyMiddleware, build_fastapi

    app = build_fastapi()

    @app.post("/json")
    async def json_route(body: PromptBody) -> dict:
        return {"prompt": body.prompt}

    @app.post("/raw")
    async def raw_route(request: Request) -> dict:
        return {"content_type": request.headers.get("content-type")}

    app.add_middleware(JSONBodyMiddleware)
    return TestClient(app)


@pytest.mark.parametrize(
    "content_type",
    ["application/x-www-form-urlencoded", "text/plain", None, "application/json; charset=utf-8"],
)
def test_json_body_is_read_whatever_its_content_type(content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = _json_app().post("/json", content=b'{"prompt": "a fox"}', headers=headers)
    assert r.status_code == 200 and r.json() == {"prompt": "a fox"}, r.text


def test_multipart_stays_multipart_and_bad_bodies_say_what_is_wrong():
    client = _json_app()
    multipart = "multipart/form-data; boundary=b"
    assert client.post("/raw", content=b"--b--\r\n", headers={"content-type": multipart}).json() == {
        "content_type": multipart
    }
    form = {"content-type": "application/x-www-form-urlencoded"}
    cases = [
        (
            b"prompt=a+fox",
            form,
            "request body is not valid JSON: send a JSON object; URL-encoded form fields",
        ),
        (b"prompt: a fox", {"content-type": "text/plain"}, "request body is not valid JSON"),
        (b"[1, 2]", form, "request body must be a JSON object"),
        (b"--b--\r\n", {"content-type": multipart}, "request body must be a JSON object"),
        (b"", form, "request body is missing"),
        (b'{"prompt": 1}', form, "prompt"),
    ]
    for content, headers, message in cases:
        r = client.post("/json", content=content, headers=headers)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (content, r.text)


def _served_schema(**limits):
    from ditserve.cluster.config import AppArgs
    from ditserve.cluster.frontend import fastapi_app
    from ditserve.cluster.http_base import openapi_schema

    args = AppArgs(model="demo-flux", api_key="k", **limits)
    return openapi_schema(fastapi_app, args, "demo-flux", "image", "64x64")


def test_openapi_documents_the_error_statuses_in_the_error_model():
    schema = _served_schema()
    operations = {(m, p): op for p, item in schema["paths"].items() for m, op in item.items()}
    videos = operations[("post", "/v1/videos")]  # documented; an image server refuses it naming model
    assert "makes images: it answers 400" in videos["description"]
    assert set(videos["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    for (method, path), op in operations.items():
        assert "422" not in op["responses"], (method, path)  # validation errors are answered as 400
        for status, response in op["responses"].items():
            if not status.startswith("2"):  # successes (200, 206 byte ranges) carry their own content
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (method, path, status)
    content = operations[("get", "/v1/videos/{video_id}/content")]["responses"]
    assert "video/mp4" in content["206"]["content"]  # a Range request's answer, documented as such
    image = operations[("post", "/v1/images/generations")]["responses"]
    assert {"400", "413", "429", "503"} <= set(image) and "401" not in image  # the key guards admin only
    assert "text/event-stream" in image["200"]["content"]
    assert {"401", "404"} <= set(operations[("delete", "/v1/loras/{name}")]["responses"])
    assert "410" in operations[("post", "/v1/sessions/{session_id}/generate")]["responses"]
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_openapi_carries_the_servers_limits():
    import re

    from ditserve.cluster.http_base import check_size

    schema = _served_schema(max_steps=3, max_width=64, max_height=32, max_n=2, max_prompt_chars=50)
    props = schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert props["num_inference_steps"]["maximum"] == 3 and props["n"]["maximum"] == 2
    assert props["prompt"]["maxLength"] == 50
    assert props["model"]["anyOf"][0]["enum"] == ["demo-flux"]
    pattern = re.compile(props["size"]["anyOf"][0]["pattern"])
    for width in range(0, 100, 8):  # the pattern takes exactly the sizes the server takes
        for height in range(0, 60, 8):
            size = f"{width}x{height}"
            try:
                check_size(size, 64, 32)
                taken = True
            except BadRequest:
                taken = False
            assert bool(pattern.match(size)) == taken, size
    session = schema["components"]["schemas"]["SessionGenerateRequest"]["properties"]
    assert session["num_inference_steps"]["maximum"] == 3
    # --max-prompt-chars bounds the negative prompt too, on every route that takes one
    for body in (props, session):
        assert body["negative_prompt"]["anyOf"][0] == {"type": "string", "maxLength": 50}


def test_method_not_allowed_names_every_allowed_method():
    from fastapi.testclient import TestClient

    from ditserve.cluster.http_base import build_fastapi

    app = build_fastapi()
    app.get("/things")(lambda: {})
    app.post("/things")(lambda: {})
    answer = TestClient(app).put("/things")
    assert answer.status_code == 405
    assert answer.headers["allow"] == "GET, POST"
    assert answer.json()["error"]["message"] == "PUT is not allowed on /things; allowed: GET, POST"


def test_method_not_allowed_names_the_methods_of_included_routers():
    """Routes of an ``include_router`` (the sessions, videos and admin groups), with or without a prefix,
    name their methods too."""
    from fastapi import APIRouter
    from fastapi.testclient import TestClient

    from ditserve.cluster.http_base import build_fastapi

    app = build_fastapi()
    sessions = APIRouter(prefix="/v1/sessions")
    sessions.post("")(lambda: {})
    sessions.delete("/{session_id}")(lambda session_id: {})
    app.include_router(sessions)
    prefixed = APIRouter()
    prefixed.get("/items")(lambda: {})
    app.include_router(prefixed, prefix="/v2")
    client = TestClient(app)
    for method, path, allowed in [
        ("put", "/v1/sessions", "POST"),
        ("get", "/v1/sessions/abc.def", "DELETE"),
        ("post", "/v2/items", "GET"),
    ]:
        answer = client.request(method, path)
        assert answer.status_code == 405, (path, answer.text)
        assert answer.headers["allow"] == allowed
        assert answer.json()["error"]["message"].endswith(f"; allowed: {allowed}")


def test_json_integers_are_what_the_schema_calls_integer():
    """An integer field takes 3 and 3.0 (JSON Schema integers) and refuses true, "3" and 2.5, naming the field."""
    from pydantic import ValidationError

    from ditserve.cluster.schemas import ImageGenerationRequest
    from ditserve.replica.caching import CacheSettings

    assert ImageGenerationRequest(prompt="a", num_inference_steps=3.0, seed=7.0).num_inference_steps == 3
    for bad in (True, "3", 2.5):
        with pytest.raises(ValidationError) as exc:
            ImageGenerationRequest(prompt="a", num_inference_steps=bad)
        assert exc.value.errors()[0]["loc"] == ("num_inference_steps",)
    assert CacheSettings.model_validate({"policy": "taylorseer", "interval": 2.0}).interval == 2
