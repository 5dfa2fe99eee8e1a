"""A full engine queue answers 429 with Retry-After; the requests it accepted still finish."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import ServeProcess


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--model", "demo-flux", "--max-queue", "1", "--max-batch-size", "1")
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
