"""The served OpenAPI schema is a contract the API keeps: schemathesis generates requests from
``/openapi.json`` of a real ``ditserve serve`` (demo model, small limits, an admin key) and checks every
answer against it (``--checks all``: status codes and bodies documented, schema-valid requests taken,
invalid ones refused, 405 with ``Allow``, no 5xx), stateful phase included. The server's small limits
also show a default every API caps alike (a session step's steps)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import websockets

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from tests.helpers import ServeProcess

KEY = "contract-key"

# What a schema cannot tell from a request's shape, each with its reason:
CONFIG = """
[checks.positive_data_acceptance]
# 410: a well-formed session id whose replica is gone (or never existed) is "gone", not "not found".
expected-statuses = ["2xx", "401", "403", "404", "409", "410", "429", "5xx"]

[[operations]]
# path names a file on the server's disk; a generated path is one that is not there (400 naming path).
include-name = "POST /v1/loras"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429", "5xx"]

[[operations]]
# The demo model makes images: this server answers POST /v1/videos with 400 naming model (as documented).
include-name = "POST /v1/videos"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429", "5xx"]

[[operations]]
# image must be a PNG/JPEG/WebP that decodes (a generated binary is not; 400 naming image), lora and cache
# JSON text (400 naming them otherwise).
include-name = "POST /v1/images/edits"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429", "5xx"]

[[operations]]
# lora names adapters loaded at run time (GET /v1/loras); a generated name is not loaded (400 naming lora).
include-name = "POST /v1/images/generations"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429", "5xx"]

[[operations]]
# The same for a session step's lora.
include-name = "POST /v1/sessions/{session_id}/generate"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "410", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(
        "--model", "demo-flux", "--api-key", KEY,
        "--max-steps", "2", "--max-width", "64", "--max-height", "64", "--max-n", "1",
        "--max-prompt-chars", "200", "--max-body-bytes", "65536",
    )  # fmt: skip
    yield proc
    proc.stop()


def test_session_steps_default_to_what_the_server_allows(server):
    """A session step that leaves num_inference_steps out runs the default (4) capped by --max-steps (2
    here), over gRPC and the WebSocket as over POST /v1/sessions/{id}/generate; those two refused it as
    above the maximum."""
    session = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    r = httpx.post(f"{server.base_url}/v1/sessions/{session}/generate", json={"prompt": "a fox"})
    assert r.status_code == 200 and r.json()["usage"]["transformer_forwards"] <= 2, r.text
    assert r.json()["size"] == "64x64", r.text  # as the WebSocket's image and gRPC's result say
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        request = pb.SessionGenerateRequest(session_id=session, prompt="a fox", strength=1.0)
        stub = pb_grpc.DitServeStub(channel)
        events = list(stub.SessionGenerateStream(request, timeout=120))
    assert [(e.progress.step, e.progress.total) for e in events[:-1]] == [(1, 2), (2, 2)]
    assert events[-1].HasField("result") and events[-1].result.size == "64x64"

    async def socket_step() -> list[dict]:
        url = f"ws://127.0.0.1:{server.port}/v1/sessions/{session}/stream"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"prompt": "a fox", "strength": 1.0}))
            messages = [json.loads(await ws.recv())]
            while messages[-1]["type"] == "progress":
                messages.append(json.loads(await ws.recv()))
        return messages

    messages = asyncio.run(socket_step())
    assert [(m["type"], m.get("total")) for m in messages] == [
        ("progress", 2),
        ("progress", 2),
        ("image", None),
    ]
    assert messages[-1]["size"] == r.json()["size"] == "64x64"


async def _socket_of_a_deleted_session(server, session: str) -> tuple[dict, int, str]:
    """A step over the WebSocket, then, while the socket waits for the next, DELETE of its session: the
    step's image and the socket's close (code, reason)."""
    async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{session}/stream") as ws:
        await ws.send(json.dumps({"prompt": "a fox", "num_inference_steps": 1}))
        while (image := json.loads(await ws.recv()))["type"] == "progress":
            pass
        async with httpx.AsyncClient(timeout=60) as http:
            deleted = await http.delete(f"{server.base_url}/v1/sessions/{session}")
        assert deleted.status_code == 200, deleted.text
        with pytest.raises(websockets.ConnectionClosed) as info:
            # a guard only: without the close the socket would wait out the idle timeout (300 s here)
            await asyncio.wait_for(ws.recv(), timeout=120)
    return image, info.value.rcvd.code, info.value.rcvd.reason


def test_a_session_socket_is_closed_when_its_session_is_deleted(server):
    """A WebSocket waiting for its client's next step heard nothing of a DELETE of its session: it learnt
    of it at its next step (4404), or was closed as idle minutes later. It is closed at once now, 4404
    naming session_id, as that next step would be."""
    session = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    image, code, reason = asyncio.run(_socket_of_a_deleted_session(server, session))
    assert image["type"] == "image", image
    assert code == 4404 and reason.startswith("session_id") and "does not exist" in reason, (code, reason)
    again = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}).json()["id"]
    r = httpx.post(f"{server.base_url}/v1/sessions/{again}/generate", json={"prompt": "a fox"})
    assert r.status_code == 200, r.text
    httpx.delete(f"{server.base_url}/v1/sessions/{again}")


def test_schemathesis_finds_no_contract_failure(server, tmp_path: Path):
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    cmd = [
        st, "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{server.base_url}/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        # The same cases every run (deterministic generation), few per operation, a time budget.
        "--max-examples", "5", "--generation-deterministic",
        "--max-time", "40", "--request-timeout", "20", "--workers", "1",
        "-H", f"Authorization: Bearer {KEY}",
        # Ends the service for good: every later request would answer 503 (tests/e2e/test_serve_http.py
        # covers it). The WebSocket stream route is not in an OpenAPI schema.
        "--exclude-path", "/v1/admin/shutdown",
        # Loads a transformer checkpoint from a folder; a generated path is never one, and a real one
        # takes minutes (tests/cluster covers weight updates).
        "--exclude-path", "/v1/admin/weights",
        "--no-color",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-12000:]
    assert "✅ Stateful" in out, out[-4000:]  # the stateful phase ran (links between operations) and passed
    assert re.search(r"(\d+) generated, \1 passed", out), out[-4000:]
