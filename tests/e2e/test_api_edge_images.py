"""The images API when the model itself fails a request: a Z-Image folder whose VAE config has no
``shift_factor`` loads, but every image's decode raises (as diffusers' ``ZImagePipeline`` raises on it).
The client gets the one error shape with a 500 (unary and streamed, as gRPC tells it), and the server
keeps answering."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.families.harness import served, single_thread  # noqa: F401 (a fixture, used by pytestmark)
from tests.families.zimage import build_folder

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_failing_model_answers_in_the_error_shape(tmp_path):
    folder = build_folder(tmp_path / "Z-Image-no-shift")
    vae = folder / "vae" / "config.json"
    vae.write_text(json.dumps(json.loads(vae.read_text()) | {"shift_factor": None}))
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}
    with served("--model", str(folder), "--max-width", "64", "--max-height", "64") as server:
        url = f"{server.base_url}/v1/images/generations"
        r = httpx.post(url, json=body, timeout=120)
        # it was Starlette's plain-text "Internal Server Error"
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == 500
        assert "see the server log" in error["message"], error
        # streamed, the same error ends the events (it was a 503 "retry" error, as if a replica were lost)
        stream = httpx.post(url, json=body | {"stream": True}, timeout=120).text
        event = json.loads(stream.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])["error"]
        assert event["type"] == "server_error" and event["code"] == 500, event
        bad = httpx.post(url, json=body | {"size": "17x17"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"
        assert httpx.get(f"{server.base_url}/health", timeout=30).json() == {"status": "ok"}
