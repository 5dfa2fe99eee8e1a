"""A small server: a full engine queue answers 429 with Retry-After; adapters given at start are served."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import ServeProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.unit.test_lora_engine import weights, write_kohya

    lora = write_kohya(tmp_path_factory.mktemp("lora") / "style.safetensors", weights(1))
    proc = ServeProcess(
        "--model",
        "demo-flux",
        "--max-queue",
        "1",
        "--max-batch-size",
        "1",
        "--lora-path",
        f"style={lora}:0.8",
    )
    yield proc
    proc.stop()


def test_queue_full_is_429_with_retry_after(server):
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 60}

    def post(_):
        return httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=300)

    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and 429 in codes, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "queue full" in refused.json()["error"]["message"]
    ok = httpx.post(
        f"{server.base_url}/v1/images/generations", json={**body, "num_inference_steps": 2}, timeout=120
    )
    assert ok.status_code == 200


def test_adapter_given_at_start_is_loaded_and_applied(server):
    def image(**extra):
        body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2, "seed": 3, **extra}
        r = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["b64_json"]

    listed = httpx.get(f"{server.base_url}/v1/loras", timeout=60).json()
    assert "style" in str(listed)
    assert image(lora={"name": "style"}) != image()
