"""The full image API as a user runs it against one real ``ditserve serve --model demo-flux``: the openai
client (plain and streamed), SSE over httpx, the realtime WebSocket, gRPC through the committed stubs,
admin auth, and a bad-input matrix over HTTP and gRPC where every case names its problem and a valid
request right after it succeeds."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import httpx
import msgpack
import pytest
import websockets
from google.protobuf.json_format import MessageToDict
from openai import OpenAI

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from tests.helpers import ServeProcess, png_pixels

KEY = "test-admin-key"
LIMIT = 64 * 1024  # --max-body-bytes


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(
        "--model", "demo-flux", "--api-key", KEY,
        "--max-n", "2", "--max-width", "128", "--max-height", "128", "--max-steps", "20",
        "--max-prompt-chars", "500", "--max-body-bytes", str(LIMIT), "--max-sessions-per-replica", "3",
        "--session-idle-timeout-s", "3",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.DitServeStub(channel)


def http_valid(server) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/images/generations",
        json={"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "seed": 1},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert png_pixels(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (64, 64, 3)


def grpc_valid(stub) -> None:
    reply = stub.Generate(
        pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=1), timeout=120
    )
    assert png_pixels(reply.images[0]).shape == (64, 64, 3)


# -- what works -----------------------------------------------------------------------------------------
def test_openai_client_image(client):
    result = client.images.generate(
        model="demo-flux", prompt="a red fox", size="64x64", extra_body={"num_inference_steps": 2, "seed": 4}
    )
    assert png_pixels(base64.b64decode(result.data[0].b64_json)).shape == (64, 64, 3)
    assert (result.size, result.output_format, result.background) == ("64x64", "png", "opaque")
    # OpenAI's size "auto" is the model's own size, as when it is left out
    auto, default = (
        client.images.generate(model="demo-flux", prompt="a red fox", extra_body={"num_inference_steps": 1, "seed": 4}, **size)
        for size in ({"size": "auto"}, {})
    )  # fmt: skip
    assert auto.size == default.size and auto.data[0].b64_json == default.data[0].b64_json


def test_openai_client_reads_token_usage(client):
    """``usage`` as the openai client models it: the prompt's T5 tokens (the demo tokenizer has one per scene
    word; a prompt given once for n images counts once), no input image or output tokens; ditserve's forwards
    beside them."""
    for prompt, text_tokens in (("a red fox", 3), ("a red fox on the left of a blue square", 10)):
        usage = client.images.generate(
            model="demo-flux", prompt=prompt, size="64x64", extra_body={"num_inference_steps": 2, "seed": 4}
        ).usage
        assert usage.input_tokens_details.text_tokens == text_tokens
        assert usage.input_tokens_details.image_tokens == 0
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (text_tokens, 0, text_tokens)
        assert usage.transformer_forwards == 2
    # a negative prompt is input text too where the uncond branch reads it (FLUX.1: true CFG, on by default
    # with a negative prompt), not where true_cfg_scale 1 leaves it unread
    for extra, text_tokens, forwards in (({}, 6, 4), ({"true_cfg_scale": 1.0}, 3, 2)):
        usage = client.images.generate(
            model="demo-flux", prompt="a red fox", size="64x64", n=2,
            extra_body={"num_inference_steps": 2, "seed": 4, "negative_prompt": "a blue square", **extra},
        ).usage  # fmt: skip
        assert (usage.input_tokens_details.text_tokens, usage.total_tokens) == (text_tokens, text_tokens)
        assert usage.transformer_forwards == forwards


def test_step_cache_usage_and_settings_naming_the_field(server):
    """A request's ``usage`` says how many transformer forwards ran and how many its step cache answered."""
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 6, "seed": 2}
    plain = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)
    tokens = {"input_tokens": 3, "input_tokens_details": {"text_tokens": 3, "image_tokens": 0}, "output_tokens": 0,
              "total_tokens": 3}  # fmt: skip
    assert plain.json()["usage"] == tokens | {
        "transformer_forwards": 6,
        "cached_forwards": 0,
        "cache_policy": "none",
    }
    cached = body | {"cache": {"policy": "taylorseer", "warmup": 2, "interval": 3}}
    r = httpx.post(f"{server.base_url}/v1/images/generations", json=cached, timeout=120)
    assert r.status_code == 200, r.text
    # forwards 0, 1 (warmup), 2 and 5 compute; 3 and 4 are forecast
    assert r.json()["usage"] == tokens | {
        "transformer_forwards": 6,
        "cached_forwards": 2,
        "cache_policy": "taylorseer",
    }
    bad = body | {"cache": {"policy": "taylorseer", "interval": 0}}
    r = httpx.post(f"{server.base_url}/v1/images/generations", json=bad, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache.interval", r.text
    http_valid(server)


def test_openai_client_streams_progress_then_the_image(client):
    events = list(
        client.images.generate(
            model="demo-flux", prompt="a red fox", size="64x64", stream=True,
            extra_body={"num_inference_steps": 3, "seed": 4, "n": 2},
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.progress"] * 3 + ["image_generation.completed"] * 2
    assert [e.step for e in events[:3]] == [1, 2, 3]
    png = base64.b64decode(events[-1].b64_json)
    assert png_pixels(png).shape == (64, 64, 3)


def test_openai_client_partial_images(client):
    """OpenAI's partial_images: that many image_generation.partial_image events, the last steps' previews,
    each with its picture in b64_json (the field the client reads) and the picture's size; 0: none."""
    asked = {"prompt": "a red fox", "size": "64x64", "stream": True}
    steps = {"num_inference_steps": 4, "seed": 4}
    events = list(client.images.generate(**asked, partial_images=2, extra_body=steps))
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert [(e.partial_image_index, e.step) for e in partials] == [(0, 2), (1, 3)]
    for event in partials:
        assert png_pixels(base64.b64decode(event.b64_json)).shape == (8, 8, 3) and event.size == "8x8"
    assert events[-1].type == "image_generation.completed"
    none = list(client.images.generate(**asked, partial_images=0, extra_body=steps))
    assert [e.type for e in none] == ["image_generation.progress"] * 4 + ["image_generation.completed"]
    plain = client.images.generate(prompt="a red fox", size="64x64", partial_images=1, extra_body=steps)
    assert plain.data[0].b64_json == events[-1].b64_json


def test_sse_over_httpx_is_event_stream_with_done(server):
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 9, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/images/generations", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-ditserve-replica"]
        lines = [line for line in r.iter_lines() if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event:")]
    assert names == ["image_generation.progress"] * 2 + ["image_generation.completed"]
    assert lines[-1] == "data: [DONE]"
    # The streamed image is the plain request's image (same seed).
    final = json.loads(lines[-2].split(": ", 1)[1])
    plain = httpx.post(
        f"{server.base_url}/v1/images/generations", json={**body, "stream": False}, timeout=120
    ).json()
    assert final["b64_json"] == plain["data"][0]["b64_json"]


def test_sse_preview_sends_partial_images_between_steps(server):
    """``"preview": true``: OpenAI's ``image_generation.partial_image`` after each step but the last (a PNG
    of the latents at 1/8 size); the final image is the one without previews."""
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 3, "seed": 9, "stream": True}
    url = f"{server.base_url}/v1/images/generations"
    with httpx.stream("POST", url, json={**body, "preview": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line.split(": ", 1)[1]) for line in lines[:-1] if line.startswith("data:")]
    assert [(e["type"].rsplit(".", 1)[1], e.get("step")) for e in events] == [
        ("progress", 1), ("partial_image", 1), ("progress", 2), ("partial_image", 2), ("progress", 3),
        ("completed", None),
    ]  # fmt: skip
    partials = [e for e in events if e["type"] == "image_generation.partial_image"]
    assert [e["partial_image_index"] for e in partials] == [0, 1]
    pictures = [png_pixels(base64.b64decode(e["partial_image_b64"])) for e in partials]
    assert all(p.shape == (8, 8, 3) for p in pictures) and (pictures[0] != pictures[1]).any()
    plain = httpx.post(url, json={**body, "stream": False}, timeout=120).json()
    assert events[-1]["b64_json"] == plain["data"][0]["b64_json"]
    refused = httpx.post(url, json={**body, "stream": False, "preview": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "preview"


def test_grpc_generate_and_stream(stub):
    reply = stub.Generate(pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=2, seed=4))
    assert reply.seed == 4 and reply.size == "64x64" and reply.replica
    events = list(
        stub.GenerateStream(
            pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=2, seed=4)
        )
    )
    assert [e.WhichOneof("event") for e in events] == ["progress", "progress", "result"]
    assert [(e.progress.step, e.progress.total) for e in events[:2]] == [(1, 2), (2, 2)]
    assert events[-1].result.images[0] == reply.images[0]  # same seed, same PNG
    assert [m.id for m in stub.ListModels(pb.Empty()).data] == ["demo-flux"]


def test_grpc_stream_previews_as_http_sends_partial_images(stub):
    """GenerateStream with preview: a PNG of the latents (1/8 of the image size) with each step but the last,
    as HTTP's image_generation.partial_image events; partial_images: with the last N steps only (0: none).
    Previews do not change the image; Generate refuses preview, as HTTP does without stream."""
    asked = dict(prompt="a red fox", size="64x64", num_inference_steps=4, seed=4)

    def previews(**extra) -> tuple[list[int], bytes]:
        """The steps that came with a preview, and the image."""
        events = list(stub.GenerateStream(pb.GenerateRequest(**asked, **extra), timeout=120))
        assert [e.WhichOneof("event") for e in events] == ["progress"] * 4 + ["result"]
        shown = [e.progress for e in events[:-1] if e.progress.preview]
        assert all(png_pixels(p.preview).shape == (8, 8, 3) for p in shown)
        return [p.step for p in shown], events[-1].result.images[0]

    image = stub.Generate(pb.GenerateRequest(**asked), timeout=120).images[0]
    assert previews(preview=True) == ([1, 2, 3], image)
    assert previews(partial_images=2) == ([2, 3], image)
    assert previews(partial_images=0) == ([], image) and previews() == ([], image)
    for request, param in (
        (lambda: stub.Generate(pb.GenerateRequest(**asked, preview=True), timeout=120), "preview"),
        (lambda: list(stub.GenerateStream(pb.GenerateRequest(**asked, partial_images=4))), "partial_images"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            request()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{param}: "), info.value.details()


def test_grpc_lists_replicas_as_http_does(server, stub):
    """ListReplicas answers what GET /v1/replicas answers: without the key the public fields only, with it
    the rest of each entry (node, ranks, applied state, stats) in details."""
    for headers, metadata in (({}, []), (ADMIN, list(ADMIN.items()))):
        http = httpx.get(f"{server.base_url}/v1/replicas", headers=headers, timeout=60).json()
        listed = stub.ListReplicas(pb.Empty(), metadata=metadata, timeout=60)
        assert (listed.expected, listed.desired_version) == (http["expected"], http["desired_version"])
        assert len(listed.data) == len(http["data"]) == 1
        got, want = listed.data[0], http["data"][0]
        assert (got.replica_id, got.health, got.device) == (
            want["replica_id"],
            want["health"],
            want["device"],
        )
        assert (got.control_version, dict(got.layout)) == (want["control_version"], want["layout"])
        details = MessageToDict(got.details)
        assert set(details) == set(want) - {"replica_id", "health", "device", "control_version", "layout"}
        if headers:
            assert details["ranks"] == want["ranks"] and details["stats"].keys() == want["stats"].keys()
        else:
            assert not details


def test_grpc_step_cache_and_usage(stub):
    """The request's step cache over gRPC, and the usage it reports, as over HTTP; a bad setting is
    INVALID_ARGUMENT naming the field."""
    cache = pb.StepCache(policy="taylorseer", warmup=2, interval=3)
    reply = stub.Generate(
        pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=6, seed=2, cache=cache)
    )
    assert (reply.usage.transformer_forwards, reply.usage.cached_forwards) == (6, 2)
    assert reply.usage.cache_policy == "taylorseer"
    # OpenAI's token fields, as HTTP's usage: "a red fox" is 3 T5 tokens; no image or output tokens
    details = reply.usage.input_tokens_details
    assert (details.text_tokens, details.image_tokens) == (3, 0)
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (3, 0, 3)
    plain = stub.Generate(pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=6, seed=2))
    assert (plain.usage.cached_forwards, plain.usage.cache_policy) == (0, "none")
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(
            pb.GenerateRequest(
                prompt="a fox", size="64x64", cache=pb.StepCache(policy="taylorseer", interval=0)
            )
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "interval" in exc.value.details()
    grpc_valid(stub)


def test_grpc_reflection_lists_the_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(stub.ServerReflectionInfo(iter([request]), timeout=30))
    names = [s.name for s in answer.list_services_response.service]
    assert "ditserve.v1.DitServe" in names


def test_grpc_admin_with_key(stub):
    meta = [("authorization", f"Bearer {KEY}")]
    assert stub.ListLoRAs(pb.Empty(), metadata=meta).data == []
    released = stub.ReleaseMemory(pb.Empty(), metadata=meta)
    assert released.replicas and released.missing == 0
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(prompt="a fox", size="64x64", num_inference_steps=1))
    # the fix in gRPC's terms (HTTP's message names POST /v1/admin/memory/resume)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert info.value.details().endswith("memory is released; ResumeMemory first"), info.value.details()
    stub.ResumeMemory(pb.Empty(), metadata=meta)
    grpc_valid(stub)


def test_grpc_session_stream(server, stub):
    """Session steps over gRPC: streamed with previews, or one call for the result only (SessionGenerate, as
    HTTP's POST .../generate: preview refused naming it); each result says its step in the session."""
    from ditserve.cluster.client import Client

    session = stub.OpenSession(pb.OpenSessionRequest(size="64x64"))
    try:
        for step in (1, 2):
            request = pb.SessionGenerateRequest(
                session_id=session.id, prompt="a red fox", num_inference_steps=2, preview=True
            )
            events = list(stub.SessionGenerateStream(request))
            assert events[0].progress.preview[:4] == b"\x89PNG"
            assert png_pixels(events[-1].result.images[0]).shape == (64, 64, 3)
            assert events[-1].result.session_step == step
        with Client(f"127.0.0.1:{server.grpc_port}") as c:
            with pytest.raises(grpc.RpcError) as info:
                c.session_generate(session.id, "a blue fox", preview=True)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("preview: ")
            result = c.session_generate(session.id, "a blue fox", num_inference_steps=2, seed=4)
            c.close_session(c.open_session("64x64", model="demo-flux"))  # the model, as HTTP's open takes it
        assert result.session_step == 3 and result.seed == 4 and result.size == "64x64"
        assert png_pixels(result.images[0]).shape == (64, 64, 3) and result.usage.transformer_forwards > 0
    finally:
        assert stub.CloseSession(pb.SessionRef(id=session.id)).closed
    with pytest.raises(grpc.RpcError) as info:  # closed: NOT_FOUND naming the session, as HTTP's 404
        stub.SessionGenerate(pb.SessionGenerateRequest(session_id=session.id, prompt="a fox"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details().startswith("session_id: session ")


# A step with a negative prompt under true CFG (demo-flux is a FLUX.1: the uncond branch runs).
GUIDED = {
    "prompt": "a red fox",
    "negative_prompt": "blurry",
    "true_cfg_scale": 3.0,
    "seed": 5,
    "num_inference_steps": 3,
}


async def _ws_guided_step(server, session_id: str) -> list[dict]:
    """A refused guidance field, then the guided step, over one socket: the answers (error, image)."""
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream") as ws:
        answers = []
        for message in ({**GUIDED, "true_cfg_scale": "3"}, GUIDED):
            await ws.send(json.dumps(message))
            while (answer := json.loads(await ws.recv()))["type"] == "progress":
                pass
            answers.append(answer)
        return answers


def test_session_steps_take_the_guidance_fields_of_image_generations(server, stub):
    """negative_prompt and true_cfg_scale on POST /v1/sessions/{id}/generate, the WebSocket and gRPC (the
    package client) mean what they mean on /v1/images/generations: a first step draws the same image as
    the image request with the same seed and settings. A refused value is a 400 / INVALID_ARGUMENT naming
    the field, and the session goes on (its next step is step 2, guided: two forwards per step)."""
    image = _post(server, GEN, {**GUIDED, "size": "64x64"}).json()
    expected = png_pixels(base64.b64decode(image["data"][0]["b64_json"]))
    unguided = _post(
        server, GEN, {"prompt": "a red fox", "seed": 5, "num_inference_steps": 3, "size": "64x64"}
    )
    assert (png_pixels(base64.b64decode(unguided.json()["data"][0]["b64_json"])) != expected).any()
    sessions = [
        httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"] for _ in range(3)
    ]
    try:
        sid = sessions[0]
        first = _post(server, f"/v1/sessions/{sid}/generate", GUIDED)
        assert first.status_code == 200, first.text
        assert (png_pixels(base64.b64decode(first.json()["data"][0]["b64_json"])) == expected).all()
        assert first.json()["usage"] == image["usage"]  # the negative prompt's tokens, 2 forwards a step
        for bad, param in (
            ({"true_cfg_scale": 101}, "true_cfg_scale"),
            ({"true_cfg_scale": -1}, "true_cfg_scale"),
            ({"negative_prompt": 5}, "negative_prompt"),
            ({"negative_prompt": "a" * 501}, "negative_prompt"),  # --max-prompt-chars, as for the prompt
        ):
            r = _post(server, f"/v1/sessions/{sid}/generate", {**GUIDED, **bad})
            assert r.status_code == 400, (bad, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(f"{param}: "), (bad, error)
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.SessionGenerateStream(
                    pb.SessionGenerateRequest(session_id=sid, prompt="a", true_cfg_scale=101)
                )
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("true_cfg_scale: ")
        second = _post(server, f"/v1/sessions/{sid}/generate", {**GUIDED, "strength": 1.0})
        assert second.status_code == 200, second.text
        assert second.json()["step"] == 2 and second.json()["usage"]["transformer_forwards"] == 6

        from ditserve.cluster.client import Client

        with Client(f"127.0.0.1:{server.grpc_port}") as c:
            events = list(c.session_step(sessions[1], **GUIDED))
        assert (png_pixels(events[-1].result.images[0]) == expected).all()
        assert events[-1].result.usage.transformer_forwards == 6

        refused, drawn = asyncio.run(_ws_guided_step(server, sessions[2]))
        assert refused["type"] == "error" and refused["error"]["param"] == "true_cfg_scale", refused
        assert drawn["type"] == "image" and drawn["step"] == 1, drawn
        assert (png_pixels(base64.b64decode(drawn["b64_json"])) == expected).all()
    finally:
        for sid in sessions:
            httpx.delete(f"{server.base_url}/v1/sessions/{sid}")


def test_session_steps_take_adapters_as_image_generations_does(server, tmp_path):
    """A loaded adapter on a session step (``lora``, as on /v1/images/generations; sessions refused the
    field): the first step is the image request's image with the adapter, an unloaded name is a 400 naming
    lora and the session goes on, and gRPC's step takes it as GenerateRequest does."""
    from ditserve.cluster.client import Client
    from tests.unit.test_lora_engine import weights, write_kohya

    path = write_kohya(tmp_path / "style.safetensors", weights(1))
    loaded = _post(server, "/v1/loras", {"name": "session-style", "path": str(path)}, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    try:
        step = {"prompt": "a red fox", "seed": 6, "num_inference_steps": 2}
        styled = {**step, "lora": {"name": "session-style", "scale": 0.8}}
        image = png_pixels(
            base64.b64decode(_post(server, GEN, {**styled, "size": "64x64"}).json()["data"][0]["b64_json"])
        )
        plain = png_pixels(
            base64.b64decode(_post(server, GEN, {**step, "size": "64x64"}).json()["data"][0]["b64_json"])
        )
        assert (image != plain).any()
        unknown = _post(server, f"/v1/sessions/{sid}/generate", {**step, "lora": {"name": "nope"}})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora", unknown.text
        first = _post(server, f"/v1/sessions/{sid}/generate", styled)
        assert first.status_code == 200 and first.json()["step"] == 1, first.text[:300]
        assert (png_pixels(base64.b64decode(first.json()["data"][0]["b64_json"])) == image).all()
        with Client(f"127.0.0.1:{server.grpc_port}") as c:
            adapter = [pb.LoRARef(name="session-style", scale=0.8)]
            assert (
                c.session_generate(sid, "a blue fox", num_inference_steps=2, lora=adapter).session_step == 2
            )
            # The client takes lora as HTTP's field does: one adapter (a mapping or a name) or a list. A mapping
            # was read as its keys (adapter 'name' not loaded), a name as its letters, and the session calls
            # took LoRARef messages only.
            mapping = {"name": "session-style", "scale": 0.8}
            assert (
                c.session_generate(sid, "a blue fox", num_inference_steps=2, lora=mapping).session_step == 3
            )
            drawn = c.generate("a red fox", size="64x64", seed=6, num_inference_steps=2, lora=mapping)
            assert (png_pixels(drawn[0]) == image).all()
            by_name = c.generate(
                "a red fox", size="64x64", seed=6, num_inference_steps=2, lora="session-style"
            )
            assert (png_pixels(by_name[0]) != plain).any()
    finally:
        httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
        httpx.delete(f"{server.base_url}/v1/loras/session-style", headers=ADMIN, timeout=60)


async def _ws_steps(server, session_id: str) -> list[dict]:
    url = f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream"
    seen = []
    async with websockets.connect(url) as ws:
        for prompt in ("a red fox", "a blue fox"):
            await ws.send(
                json.dumps({"prompt": prompt, "num_inference_steps": 3, "preview": True, "seed": 2})
            )
            while True:
                message = json.loads(await ws.recv())
                seen.append(message)
                if message["type"] == "image":
                    break
        # A newer step while one runs supersedes it; the newest one completes. Every step is answered
        # (image, superseded or error) in the order sent: three sent at once get three answers.
        for prompt, steps in (("a green fox", 4), ("a white fox", 4), ("a yellow fox", 1)):
            await ws.send(json.dumps({"prompt": prompt, "num_inference_steps": steps}))
        answers = []
        while len(answers) < 3:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=60))
            seen.append(message)
            if message["type"] != "progress":
                answers.append(message)
        seen.append({"type": "answers", "types": [m["type"] for m in answers]})
        # Idle past --session-idle-timeout-s: the server closes with the reason.
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), timeout=30)
        seen.append({"type": "closed", "code": info.value.rcvd.code, "reason": info.value.rcvd.reason})
    return seen


def test_websocket_session_previews_steps_and_idle_close(server):
    session = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()
    seen = asyncio.run(_ws_steps(server, session["id"]))
    images = [m for m in seen if m["type"] == "image"]
    # Each step that answered "image" refines the previous latents: the session counts exactly those.
    assert [m["step"] for m in images] == list(range(1, len(images) + 1))
    answers = next(m["types"] for m in seen if m["type"] == "answers")
    assert set(answers) <= {"image", "superseded"} and answers[-1] == "image"
    previews = [m for m in seen if m["type"] == "progress" and "preview_b64" in m]
    assert previews and png_pixels(base64.b64decode(previews[0]["preview_b64"])).shape == (8, 8, 3)
    assert seen[-1]["code"] == 4408 and "idle" in seen[-1]["reason"]


def test_a_newer_websocket_on_a_session_takes_it_over(server):
    """One socket streams a session at a time: each newer socket closes the older one 4429 (so sockets
    opened on one session cannot pile up on its replica) and carries on from the session's state."""
    sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    url = f"ws://127.0.0.1:{server.port}/v1/sessions/{sid}/stream"
    step = {"prompt": "a red fox", "num_inference_steps": 1, "seed": 3}

    async def image_step(ws) -> int:
        await ws.send(json.dumps(step))
        while (message := json.loads(await asyncio.wait_for(ws.recv(), timeout=60)))["type"] != "image":
            assert message["type"] == "progress", message
        return message["step"]

    async def run() -> tuple[int, list[tuple[int, str]], int]:
        older = await websockets.connect(url)
        first = await image_step(older)
        closes = []
        for _ in range(12):
            newer = await websockets.connect(url)
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(older.recv(), timeout=30)
            closes.append((info.value.rcvd.code, info.value.rcvd.reason))
            older = newer
        last = await image_step(older)
        await older.close()
        return first, closes, last

    try:
        first, closes, last = asyncio.run(run())
    finally:
        httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
    assert first == 1 and last == 2  # the last socket refined the latents the first one made
    assert all(code == 4429 and "another WebSocket" in reason for code, reason in closes), closes
    http_valid(server)


def test_a_realtime_socket_that_opens_no_session_is_closed_when_idle(server):
    """The realtime video route's idle limit holds before any init too: a socket that sends nothing, or only
    messages that open no session, is closed 1000 "session idle timeout" after --session-idle-timeout-s
    (3 s) instead of being held open for ever."""

    async def closed(first: dict | None) -> tuple[int, str]:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/realtime_video/generate") as ws:
            if first is not None:
                await ws.send(msgpack.packb(first))
                assert msgpack.unpackb(await ws.recv())["type"] == "error"
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), timeout=60)
            return info.value.rcvd.code, info.value.rcvd.reason

    assert asyncio.run(closed(None)) == (1000, "session idle timeout")
    assert asyncio.run(closed({"type": "event", "kind": "heartbeat"})) == (1000, "session idle timeout")


def test_session_admission_refuses_past_the_limit(server, stub):
    """HTTP: 429 with Retry-After; gRPC: RESOURCE_EXHAUSTED, the same message with the retry hint in it."""
    opened = []
    try:
        for _ in range(6):
            r = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"})
            if r.status_code != 200:
                break
            opened.append(r.json()["id"])
        assert r.status_code == 429 and "maximum" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenSession(pb.OpenSessionRequest(size="64x64"), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = f" (retry after {r.headers['retry-after']} s)"
        assert info.value.details() == r.json()["error"]["message"] + hint
    finally:
        for sid in opened:
            httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
    assert httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).status_code == 200


def test_python_client_generate_returns_one_png_per_image(server):
    from ditserve.cluster.client import Client

    with Client(f"127.0.0.1:{server.grpc_port}") as c:
        pngs = c.generate("a red fox", size="64x64", num_inference_steps=1, n=2, seed=3)
    assert isinstance(pngs, list) and len(pngs) == 2
    assert all(png_pixels(png).shape == (64, 64, 3) for png in pngs)


def test_python_client_streams_previews_and_reaches_the_replica_and_admin_calls(server):
    """The package client's streams give the previews asked for, and its replica, health and control calls
    reach the server: with the key they run, without it the server's own refusal comes back."""
    from ditserve.cluster.client import Client

    fields = dict(size="64x64", num_inference_steps=4, seed=3)
    with Client(f"127.0.0.1:{server.grpc_port}") as c:
        events = list(c.generate_stream("a red fox", partial_images=2, **fields))
        assert [e[:2] for e in events] == [(1, 4), (2, 4), (3, 4), (4, 4), (4, 4)]
        assert [e[2] is not None for e in events[:4]] == [
            False,
            True,
            True,
            False,
        ]  # the last 2 steps but one
        assert png_pixels(events[-1][2]).shape == (64, 64, 3)
        edits = list(c.edit_image_stream([events[-1][2]], "a blue fox", strength=0.5, **fields))
        assert png_pixels(edits[-1][2]).shape == (64, 64, 3) and all(e[2] is None for e in edits[:-1])
        assert c.health() == "ok"
        replicas = c.list_replicas()
        assert replicas.expected == 1 and [r.health for r in replicas.data] == ["ok"]
        with pytest.raises(grpc.RpcError) as info:
            c.update_weights("/nowhere")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=KEY) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.load_lora("style", "/no/such/adapter.safetensors")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "path" in info.value.details()
        assert c.release_memory().replicas and c.resume_memory().replicas
        assert len(c.generate("a red fox", **fields)) == 1


def test_session_ids_the_server_does_not_hold_answer_4xx_naming_session_id(server):
    """A closed session (used or closed again), a token its replica never gave, an id of a replica that is
    not serving and an id that is no session id: each a 4xx whose param is ``session_id``."""
    sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    assert httpx.delete(f"{server.base_url}/v1/sessions/{sid}").status_code == 200
    owner = sid.split(".")[0]
    calls = {
        "used after delete": (_post(server, f"/v1/sessions/{sid}/generate", {"prompt": "a fox"}), 404),
        "deleted twice": (httpx.delete(f"{server.base_url}/v1/sessions/{sid}"), 404),
        "unknown token": (_post(server, f"/v1/sessions/{owner}.feed/generate", {"prompt": "a fox"}), 404),
        "unknown replica": (_post(server, "/v1/sessions/nosuchreplica.feed/generate", {"prompt": "a fox"}), 410),
        "not a session id": (httpx.delete(f"{server.base_url}/v1/sessions/no-dot"), 404),
        # an empty id was a 307 to /v1/sessions (then a 405), or a 404 naming nothing
        "empty id, deleted": (httpx.delete(f"{server.base_url}/v1/sessions/"), 404),
        "empty id, stepped": (_post(server, "/v1/sessions//generate", {"prompt": "a fox"}), 404),
    }  # fmt: skip
    for case, (r, status) in calls.items():
        assert r.status_code == status, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == "session_id" and error["message"].startswith("session"), (case, error)


async def _close_with_a_step_waiting(
    server, session_id: str
) -> tuple[httpx.Response, httpx.Response, dict, bool]:
    """Step A over the WebSocket; once it runs, step B over HTTP (it waits for A: a session's steps run in
    order); at A's 10th of 20 steps the session is closed. The close, B's answer, A's last message, and
    whether B was answered before the close was (the progress the client reads can lag the replica: A, and
    then B, may have finished before the DELETE came)."""
    url = f"{server.base_url}/v1/sessions/{session_id}"
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream") as ws:
        async with httpx.AsyncClient(timeout=120) as http:
            await ws.send(json.dumps({"prompt": "a red fox", "num_inference_steps": 20}))
            assert json.loads(await ws.recv())["type"] == "progress"
            waiting = asyncio.create_task(http.post(f"{url}/generate", json={"prompt": "a blue fox"}))
            while (message := json.loads(await ws.recv()))["type"] == "progress" and message["step"] < 10:
                pass
            closed = await http.delete(url)
            b_first = waiting.done()
            while message["type"] == "progress":
                message = json.loads(await ws.recv())
            return closed, await waiting, message, b_first


def test_a_step_waiting_for_the_last_is_refused_once_the_session_is_closed(server):
    """DELETE answered "deleted" while a step queued behind the running one went on to run from the closed
    session's latents and answered an image (step 2 of a session that no longer existed). It is now a 404
    naming session_id; the running step finishes. Where B was answered before the DELETE (both steps done
    before it came), the scenario is tried again on a new session."""
    for _ in range(5):
        # the largest size the server takes: the slower each step, the less the progress read lags the replica
        sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "128x128"}).json()["id"]
        closed, waited, running, b_first = asyncio.run(_close_with_a_step_waiting(server, sid))
        assert closed.status_code == 200 and closed.json()["deleted"], closed.text
        if not b_first:
            break
    assert not b_first, "the queued step ended before the DELETE in every try"
    assert waited.status_code == 404, waited.text[:300]
    assert waited.json()["error"]["param"] == "session_id"
    assert running["type"] == "image" and running["step"] == 1, running
    assert _post(server, f"/v1/sessions/{sid}/generate", {"prompt": "a fox"}).status_code == 404
    http_valid(server)


@pytest.mark.parametrize("content", [None, b"{}"])
def test_session_opens_without_a_body(server, content):
    headers = {} if content is None else {"content-type": "application/json"}
    r = httpx.post(f"{server.base_url}/v1/sessions", content=content, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "64x64"  # the demo model's default
    assert httpx.delete(f"{server.base_url}/v1/sessions/{r.json()['id']}").status_code == 200


def test_json_bodies_without_a_json_content_type(server):
    """What `curl -d '{...}'` sends (application/x-www-form-urlencoded), or no type at all, is read as JSON,
    on generation, session and admin routes alike."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = b'{"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}'
    r = _post(server, GEN, content=body, headers=form)
    assert r.status_code == 200, r.text
    assert png_pixels(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (64, 64, 3)
    r = _post(server, GEN, content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/sessions", content=b'{"size": "64x64"}', headers=form)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    step = _post(
        server, f"/v1/sessions/{sid}/generate", content=b'{"prompt": "a fox", "num_inference_steps": 1}'
    )
    assert step.status_code == 200, step.text
    httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
    # An admin body is read the same way: the field's own problem is named, not the content type.
    r = _post(server, "/v1/admin/weights", content=b'{"path": ""}', headers={**ADMIN, **form})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
    # A body that is not JSON says so.
    r = _post(server, GEN, content=b"prompt=a+fox", headers=form)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    http_valid(server)


def test_replica_header_on_every_answer_a_replica_gave(server):
    replica = _replica(server)
    opened = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"})
    sid = opened.json()["id"]
    stepped = _post(server, f"/v1/sessions/{sid}/generate", {"prompt": "a fox", "num_inference_steps": 1})
    closed = httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
    unknown_adapter = _post(server, GEN, {"prompt": "a fox", "size": "64x64", "lora": {"name": "nope"}})
    for r in (opened, stepped, closed, unknown_adapter):
        assert r.headers.get("x-ditserve-replica") == replica, (r.request.url, r.status_code, r.text)
    released = _post(server, "/v1/admin/memory/release", headers=ADMIN)
    resumed = _post(server, "/v1/admin/memory/resume", headers=ADMIN)
    assert released.headers["x-ditserve-replica"] == resumed.headers["x-ditserve-replica"] == replica
    # Answers the frontend gives alone carry no replica id.
    for r in (httpx.get(f"{server.base_url}/health"), httpx.get(f"{server.base_url}/v1/models"),
              _post(server, GEN, {"prompt": ""})):  # fmt: skip
        assert "x-ditserve-replica" not in r.headers, r.request.url


def test_openapi_lists_the_routes(server):
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/images/generations", "/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content",
                 "/v1/sessions", "/v1/loras", "/v1/admin/weights"):  # fmt: skip
        assert path in paths, sorted(paths)
    assert "multipart/form-data" in paths["/v1/videos"]["post"]["requestBody"]["content"]


# -- the bad-input matrix ---------------------------------------------------------------------------------
def _post(server, path, body=None, content=None, headers=None):
    kwargs = {"json": body} if content is None else {"content": content}
    return httpx.post(f"{server.base_url}{path}", headers=headers or {}, timeout=120, **kwargs)


def _chunked(size: int):
    def gen():
        for _ in range(size // 8192 + 1):
            yield b"x" * 8192

    return gen()


GEN = "/v1/images/generations"
JSON = {"content-type": "application/json"}
ADMIN = {"authorization": f"Bearer {KEY}"}
HTTP_CASES = {
    "missing prompt": (lambda s: _post(s, GEN, {"size": "64x64"}), 400, "prompt"),
    "prompt not a string": (lambda s: _post(s, GEN, {"prompt": 7}), 400, "prompt"),
    "blank prompt": (lambda s: _post(s, GEN, {"prompt": "  "}), 400, "prompt"),
    "prompt too long": (lambda s: _post(s, GEN, {"prompt": "a" * 501}), 400, "prompt"),
    "n zero": (lambda s: _post(s, GEN, {"prompt": "a fox", "n": 0}), 400, "n"),
    "n above max": (lambda s: _post(s, GEN, {"prompt": "a fox", "n": 3}), 400, "n"),
    "n not a number": (lambda s: _post(s, GEN, {"prompt": "a fox", "n": "two"}), 400, "n"),
    "size malformed": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "big"}), 400, "size: "),
    "size not a multiple": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "65x64"}), 400, "size"),
    "size above max": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "4096x64"}), 400, "size"),
    "size far above max": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "100000x100000"}), 400, "is above the maximum 128x128"),
    "steps zero": (lambda s: _post(s, GEN, {"prompt": "a fox", "num_inference_steps": 0}), 400, "num_inference_steps"),
    "steps above max": (lambda s: _post(s, GEN, {"prompt": "a fox", "num_inference_steps": 50}), 400, "num_inference_steps"),
    "guidance negative": (lambda s: _post(s, GEN, {"prompt": "a fox", "guidance_scale": -1}), 400, "guidance_scale"),
    "seed negative": (lambda s: _post(s, GEN, {"prompt": "a fox", "seed": -5}), 400, "seed"),
    "guidance NaN": (lambda s: _post(s, GEN, content=b'{"prompt": "a fox", "guidance_scale": NaN}', headers=JSON), 400, "guidance_scale: Input should be a finite number"),
    "true CFG infinite": (lambda s: _post(s, GEN, content=b'{"prompt": "a fox", "true_cfg_scale": Infinity}', headers=JSON), 400, "true_cfg_scale: Input should be a finite number"),
    "true CFG without a negative prompt": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "true_cfg_scale": 3.0}), 400, "true_cfg_scale"),
    "adapter scale NaN": (lambda s: _post(s, GEN, content=b'{"prompt": "a fox", "lora": {"name": "style", "scale": NaN}}', headers=JSON), 400, "finite number"),
    "adapter scale not a number": (lambda s: _post(s, GEN, {"prompt": "a fox", "lora": {"name": "style", "scale": "big"}}), 400, "lora.scale: Input should be a valid number"),
    "adapter list item scale": (lambda s: _post(s, GEN, {"prompt": "a fox", "lora": [{"name": "style", "scale": "big"}]}), 400, "lora.0.scale: Input should be a valid number"),
    "cache threshold NaN": (lambda s: _post(s, GEN, content=b'{"prompt": "a fox", "cache": {"policy": "fbcache", "threshold": NaN}}', headers=JSON), 400, "finite number"),
    "unknown field": (lambda s: _post(s, GEN, {"prompt": "a fox", "colour": "red"}), 400, "colour"),
    "quality not OpenAI's": (lambda s: _post(s, GEN, {"prompt": "a fox", "quality": "ultra"}), 400, "quality: "),
    "style not OpenAI's": (lambda s: _post(s, GEN, {"prompt": "a fox", "style": "baroque"}), 400, "style: "),
    "edit quality not OpenAI's": (lambda s: httpx.post(f"{s.base_url}/v1/images/edits", data={"prompt": "a fox", "quality": "ultra"}, files={"image": ("a.png", _png(), "image/png")}, timeout=60), 400, "quality: "),
    "unknown model": (lambda s: _post(s, GEN, {"prompt": "a fox", "model": "dall-e-3"}), 400, "model"),
    "unknown adapter": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "lora": {"name": "nope"}}), 400, "lora"),
    "unknown adapter, streamed": (lambda s: _post(s, GEN, {"prompt": "a fox", "size": "64x64", "stream": True, "lora": {"name": "nope"}}), 400, "lora"),
    "url response format": (lambda s: _post(s, GEN, {"prompt": "a fox", "response_format": "url"}), 400, "response_format"),
    "malformed JSON": (lambda s: _post(s, GEN, content=b'{"prompt": ', headers={"content-type": "application/json"}), 400, "JSON"),
    "JSON array body": (lambda s: _post(s, GEN, content=b"[1]", headers={"content-type": "application/json"}), 400, "JSON object"),
    "multipart body on a JSON route": (lambda s: _post(s, GEN, content=b"--b\r\n\r\nx\r\n--b--\r\n", headers={"content-type": "multipart/form-data; boundary=b"}), 400, "JSON object"),
    "oversize body": (lambda s: _post(s, GEN, {"prompt": "a" * (LIMIT + 10)}), 413, "--max-body-bytes"),
    "oversize chunked body": (lambda s: _post(s, GEN, content=_chunked(LIMIT + 10), headers={"content-type": "application/json"}), 413, "--max-body-bytes"),
    "video on an image model": (lambda s: _post(s, "/v1/videos", {"prompt": "a fox"}), 400, "model"),
    "unknown video id": (lambda s: httpx.get(f"{s.base_url}/v1/videos/nope"), 404, "nope"),
    "unknown video on a real replica": (lambda s: httpx.get(f"{s.base_url}/v1/videos/{_replica(s)}.ffff"), 404, "does not exist"),
    "unknown session": (lambda s: _post(s, "/v1/sessions/nope/generate", {"prompt": "a fox"}), 404, "session"),
    "expired session": (lambda s: _post(s, f"/v1/sessions/{_replica(s)}.0000/generate", {"prompt": "a fox"}), 404, "does not exist"),
    "admin without key": (lambda s: _post(s, "/v1/loras", {"name": "a", "path": "/x"}), 401, "API key"),
    "admin with a wrong key": (lambda s: httpx.get(f"{s.base_url}/v1/loras", headers={"authorization": "Bearer wrong"}), 401, "API key"),
    "admin unknown adapter": (lambda s: httpx.delete(f"{s.base_url}/v1/loras/nope", headers=ADMIN), 404, "nope"),
    "admin weights without a path": (lambda s: _post(s, "/v1/admin/weights", {"path": ""}, headers=ADMIN), 400, "path"),
    "admin unknown memory action": (lambda s: _post(s, "/v1/admin/memory/nap", {}, headers=ADMIN), 404, "nap"),
    "unknown route": (lambda s: httpx.get(f"{s.base_url}/v1/nothing"), 404, "Not Found"),
}  # fmt: skip


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _replica(server) -> str:
    return httpx.get(f"{server.base_url}/v1/replicas").json()["data"][0]["replica_id"]


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_bad_input(server, case):
    call, status, needle = HTTP_CASES[case]
    r = call(server)
    assert r.status_code == status, (case, r.status_code, r.text)
    error = r.json()["error"]
    assert needle in error["message"] or needle == error.get("param"), (case, error)
    assert "Traceback" not in r.text
    http_valid(server)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = b""
    while value > 0x7F:
        out, value = out + bytes([value & 0x7F | 0x80]), value >> 7
    return out + bytes([value])


def _varint_field(number: int, value: int = 1) -> bytes:
    """Field ``number`` of wire type 0 (varint), as a client whose proto has such a field sends it."""
    return _varint(number << 3) + _varint(value)


def _nested(number: int, payload: bytes) -> bytes:
    """Field ``number`` of wire type 2: a nested message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _raw_call(server, method: str, payload: bytes):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(f"/ditserve.v1.DitServe/{method}")
        return call(payload, timeout=60)


R = pb.GenerateRequest
WRONG = [("authorization", "Bearer wrong")]
NAN, INF = float("nan"), float("inf")
GRPC_CASES = {
    "missing prompt": (lambda st, s: st.Generate(R(size="64x64")), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "size malformed": (lambda st, s: st.Generate(R(prompt="a fox", size="big")), grpc.StatusCode.INVALID_ARGUMENT, "size: "),
    "n above max": (lambda st, s: st.Generate(R(prompt="a fox", n=5)), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    "seed negative": (lambda st, s: st.Generate(R(prompt="a fox", seed=-1)), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    "steps above max, streamed": (lambda st, s: list(st.GenerateStream(R(prompt="a fox", num_inference_steps=50))), grpc.StatusCode.INVALID_ARGUMENT, "num_inference_steps"),
    "unknown model": (lambda st, s: st.Generate(R(prompt="a fox", model="sora")), grpc.StatusCode.INVALID_ARGUMENT, "model"),
    "unknown adapter": (lambda st, s: st.Generate(R(prompt="a fox", size="64x64", lora=[pb.LoRARef(name="nope")])), grpc.StatusCode.INVALID_ARGUMENT, "lora"),
    "oversize message": (lambda st, s: st.Generate(R(prompt="a" * (LIMIT + 10))), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-body-bytes"),
    "video on an image model": (lambda st, s: st.CreateVideo(pb.CreateVideoRequest(prompt="a fox")), grpc.StatusCode.INVALID_ARGUMENT, "model"),
    # a message that does not start with its field gets it in front (HTTP's param), as the others name it
    "unknown video": (lambda st, s: st.GetVideo(pb.VideoRef(id="nope")), grpc.StatusCode.NOT_FOUND, "video_id: video 'nope' does not exist"),
    "unknown session": (lambda st, s: list(st.SessionGenerateStream(pb.SessionGenerateRequest(session_id="x.y", prompt="a"))), grpc.StatusCode.NOT_FOUND, "session"),
    "malformed session id": (lambda st, s: st.SessionGenerate(pb.SessionGenerateRequest(session_id="nope", prompt="a")), grpc.StatusCode.NOT_FOUND, "session_id: session id 'nope' is not"),
    # proto3 sends an adapter's empty name as no name: refused as HTTP refuses {"name": ""}, not as missing
    "adapter with an empty name": (lambda st, s: st.Generate(R(prompt="a fox", lora=[pb.LoRARef(name="")])), grpc.StatusCode.INVALID_ARGUMENT, "lora.0.name: String should have at least 1 character"),
    "close unknown session": (lambda st, s: st.CloseSession(pb.SessionRef(id=f"{_replica(s)}.00")), grpc.StatusCode.NOT_FOUND, "does not exist"),
    "admin without key": (lambda st, s: st.ListLoRAs(pb.Empty()), grpc.StatusCode.UNAUTHENTICATED, "API key"),
    "admin with a wrong key": (lambda st, s: st.LoadLoRA(pb.LoadLoRARequest(name="a", path="/x"), metadata=WRONG), grpc.StatusCode.UNAUTHENTICATED, "API key"),
    "admin unknown adapter": (lambda st, s: st.UnloadLoRA(pb.UnloadLoRARequest(name="nope"), metadata=ADMIN.items()), grpc.StatusCode.NOT_FOUND, "name: no LoRA adapter named 'nope'"),
    "malformed protobuf": (lambda st, s: _raw_call(s, "Generate", b"\xff\xff\xff\xff"), grpc.StatusCode.UNKNOWN, "GenerateRequest"),
    # a field this server's proto lacks (a client built from another version) is refused, not ignored
    "unknown field": (lambda st, s: _raw_call(s, "Generate", R(prompt="a fox").SerializeToString() + _varint_field(99)), grpc.StatusCode.INVALID_ARGUMENT, "field 99 of ditserve.v1.GenerateRequest"),
    "unknown field in an adapter": (lambda st, s: _raw_call(s, "Generate", R(prompt="a fox").SerializeToString() + _nested(10, pb.LoRARef(name="x").SerializeToString() + _varint_field(7))), grpc.StatusCode.INVALID_ARGUMENT, "lora.0: field 7"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_bad_input(server, stub, case):
    call, code, needle = GRPC_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        call(stub, server)
    assert info.value.code() == code, (case, info.value.code(), info.value.details())
    assert needle.lower() in (info.value.details() or "").lower(), (case, info.value.details())
    assert "Traceback" not in (info.value.details() or "")
    grpc_valid(stub)


def test_grpc_empty_prompt_is_refused_as_http_refuses_it(server, stub):
    """proto3 sends an empty prompt as no field at all; the answer is HTTP's for ``{"prompt": ""}``, naming
    the prompt, not "Field required"."""
    http = _post(server, GEN, {"prompt": "", "size": "64x64"}).json()["error"]
    assert http["param"] == "prompt" and http["message"].startswith("prompt: "), http
    for call in (
        lambda: stub.Generate(R(prompt="", size="64x64"), timeout=60),
        lambda: list(stub.GenerateStream(R(size="64x64"), timeout=60)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == http["message"]
    grpc_valid(stub)


def test_grpc_empty_admin_path_names_path_as_http_does(server, stub):
    """A field called ``path`` is the field, not FastAPI's location of that name: an empty path to
    UpdateWeights or LoadLoRA is refused naming ``path``, in HTTP's words."""
    meta = list(ADMIN.items())
    for route, body, call in (
        (
            "/v1/admin/weights",
            {"path": ""},
            lambda: stub.UpdateWeights(pb.UpdateWeightsRequest(), metadata=meta),
        ),
        (
            "/v1/loras",
            {"name": "a", "path": ""},
            lambda: stub.LoadLoRA(pb.LoadLoRARequest(name="a"), metadata=meta),
        ),
    ):
        http = _post(server, route, body, headers=ADMIN).json()["error"]
        assert http["param"] == "path" and http["message"].startswith("path: "), http
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == http["message"]


def test_grpc_nan_and_infinite_numbers_are_refused_as_http_refuses_them(server, stub):
    """A double set to NaN or an infinity (top level, in an adapter, in the step cache, in a session step or
    an adapter load) is refused in HTTP's words for the same JSON, naming the field; it was "Input should be
    a valid number", as if the client had sent text."""
    session = stub.OpenSession(pb.OpenSessionRequest(size="64x64"), timeout=60).id
    meta = list(ADMIN.items())
    cases = [
        (GEN, '{"prompt": "a", "guidance_scale": NaN}', lambda: stub.Generate(R(prompt="a", guidance_scale=NAN))),
        (GEN, '{"prompt": "a", "true_cfg_scale": Infinity}', lambda: list(stub.GenerateStream(R(prompt="a", true_cfg_scale=INF)))),
        (GEN, '{"prompt": "a", "lora": [{"name": "x", "scale": -Infinity}]}', lambda: stub.Generate(R(prompt="a", lora=[pb.LoRARef(name="x", scale=-INF)]))),
        (GEN, '{"prompt": "a", "cache": {"policy": "fbcache", "threshold": NaN}}', lambda: stub.Generate(R(prompt="a", cache=pb.StepCache(policy="fbcache", threshold=NAN)))),
        (f"/v1/sessions/{session}/generate", '{"prompt": "a", "strength": NaN}', lambda: list(stub.SessionGenerateStream(pb.SessionGenerateRequest(session_id=session, prompt="a", strength=NAN)))),
        ("/v1/loras", '{"name": "a", "path": "/x", "scale": NaN}', lambda: stub.LoadLoRA(pb.LoadLoRARequest(name="a", path="/x", scale=NAN), metadata=meta)),
    ]  # fmt: skip
    for path, text, call in cases:
        http = _post(server, path, content=text.encode(), headers={**JSON, **ADMIN}).json()["error"]
        # an adapter load's scale too (it was "scale: Input should be less than or equal to 10")
        assert http["message"] == f"{http['param']}: Input should be a finite number", (text, http)
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
        assert info.value.details() == http["message"], text
    stub.CloseSession(pb.SessionRef(id=session), timeout=60)
    grpc_valid(stub)


async def _close_mid_step(server, session_id: str) -> None:
    url = f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"prompt": "a red fox", "num_inference_steps": 4}))
        assert json.loads(await ws.recv())["type"] == "progress"
    # closed mid-step: the server cancels the step; the session stays usable


async def _unknown_session(server, session_id: str) -> tuple[int, str]:
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream") as ws:
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
    return info.value.rcvd.code, info.value.rcvd.reason


async def _bad_step(server, session_id: str) -> list[dict]:
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{session_id}/stream") as ws:
        answers = []
        for message in (
            "not json",
            b"\x00 a binary frame",  # answered as text is: an error, and the socket reads on
            json.dumps({"prompt": "a fox", "strength": 3}),
            json.dumps({"prompt": "a fox", "preview": "yes"}),  # a boolean, as on /v1/images/generations
            json.dumps({"prompt": "a fox", "num_inference_steps": 1}).encode(),  # JSON in a binary frame
        ):
            await ws.send(message)
            while True:
                answer = json.loads(await ws.recv())
                if answer["type"] in ("error", "image"):
                    answers.append(answer)
                    break
        return answers


def test_websocket_bad_input(server):
    sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    asyncio.run(_close_mid_step(server, sid))
    http_valid(server)
    answers = asyncio.run(_bad_step(server, sid))  # bad messages answer errors; the socket stays open
    assert "not valid JSON" in answers[0]["error"]["message"]
    assert "not valid JSON" in answers[1]["error"]["message"]
    assert answers[2]["error"]["param"] == "strength"
    assert answers[3]["error"]["param"] == "preview", answers[3]
    assert answers[4]["type"] == "image"
    code, reason = asyncio.run(_unknown_session(server, f"{_replica(server)}.0000"))
    assert code == 4404 and "does not exist" in reason
    code, reason = asyncio.run(_unknown_session(server, ""))
    assert code == 4404 and reason.startswith("session_id"), reason
    httpx.delete(f"{server.base_url}/v1/sessions/{sid}")
    http_valid(server)


# -- property-based run over /openapi.json ----------------------------------------------------------------
def _strategy(schema: dict, spec: dict, name: str = ""):
    """A bounded hypothesis strategy for one JSON schema of the spec: mostly well-typed values (small
    numbers keep valid generations cheap), with the schema's own bounds crossed on purpose."""
    from hypothesis import strategies as st

    if "$ref" in schema:
        target = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return _strategy(target, spec, name)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_strategy(s, spec, name) for s in schema[key]])
    if "allOf" in schema:
        return _strategy(schema["allOf"][0], spec, name)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        if name == "size":
            return st.sampled_from(["64x64", "16x32", "128x128", "65x64", "0x0", "9999x9999", "x", ""])
        return st.text(max_size=12)
    if kind == "integer":
        return st.integers(-3, 24)
    if kind == "number":
        return st.floats(-5, 120, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(_strategy(schema.get("items", {}), spec, name), max_size=2)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = [k for k in schema.get("required", []) if k in props]
        optional = {k: _strategy(v, spec, k) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries({k: _strategy(props[k], spec, k) for k in required}, optional=optional)
    return st.none()


def _operations(spec: dict) -> list[tuple[str, str, dict]]:
    ops = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            content = op.get("requestBody", {}).get("content", {})
            schema = content.get("application/json", {}).get("schema")
            ops.append((method.upper(), path, schema or {}))
    return ops


def test_openapi_property_run_finds_no_5xx(server):
    """Bodies built from each operation's schema (plus broken ones and random path values), sent to the
    real server: every answer is < 500, JSON errors included."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    ops = _operations(spec)
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-3, 24) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6,
    )
    path_values = st.sampled_from(["x", "a.b", "..", "%20", "nope", "release", "resume"]) | st.text(
        st.characters(whitelist_categories=("L", "N"), whitelist_characters="-_."), min_size=1, max_size=10
    )

    @st.composite
    def requests(draw):
        method, path, schema = draw(st.sampled_from(ops))
        for part in [p for p in path.split("/") if p.startswith("{")]:
            path = path.replace(part, draw(path_values))
        body = None
        if method in ("POST", "PUT", "PATCH"):
            body = draw(_strategy(schema, spec) if schema and draw(st.integers(0, 3)) else json_values)
        return method, path, body

    statuses: list[int] = []

    @settings(
        max_examples=120,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def check(request):
        method, path, body = request
        if path == "/v1/admin/shutdown":
            return  # without the key it is 401 anyway; never stop the shared server by accident
        r = httpx.request(method, f"{server.base_url}{path}", json=body, timeout=120)
        statuses.append(r.status_code)
        assert r.status_code < 500, (method, path, body, r.status_code, r.text)
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
            assert r.json()["error"]["message"]

    check()
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), sorted(set(statuses))
    http_valid(server)
