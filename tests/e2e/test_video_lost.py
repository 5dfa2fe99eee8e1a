"""A video job whose replica dies answers ``failed`` with the reason, never a 404 for an id the server issued:
the replica process is killed while the job runs; Serve starts a replacement, which serves new jobs."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from openai import OpenAI

from tests.helpers import ServeProcess


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess("--model", "demo-wan", "--max-frames", "9", "--max-width", "64", "--max-height", "64")
    yield proc
    proc.stop()


def test_job_of_a_dead_replica_is_failed_with_the_reason(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    (replica,) = httpx.get(f"{server.base_url}/v1/replicas", timeout=60).json()["data"]
    job = client.videos.create(
        prompt="waves on a beach", model="demo-wan", size="64x64",
        extra_body={"num_frames": 5, "num_inference_steps": 100, "seed": 3},
    )  # fmt: skip
    assert job.id.startswith(replica["replica_id"] + ".")
    os.kill(replica["ranks"][0]["pid"], signal.SIGKILL)  # the replica process (its one rank runs inside)

    deadline, seen = time.monotonic() + 300, []  # polled: the replacement starts on a loaded machine
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.base_url}/v1/videos/{job.id}", timeout=60)
        seen.append(r.status_code)
        assert r.status_code in (200, 503), r.text  # 503 while no replica runs; never 404
        if r.status_code == 200 and r.json()["status"] == "failed":
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the job never answered failed: {seen}")
    lost = r.json()
    assert lost["id"] == job.id and lost["error"]["code"] == "replica_gone", lost
    assert "gone" in client.videos.retrieve(job.id).error.message
    content = httpx.get(f"{server.base_url}/v1/videos/{job.id}/content", timeout=60)
    assert content.status_code == 409 and "replica" in content.json()["error"]["message"]
    # The replacement serves new jobs.
    fresh = client.videos.create(
        prompt="waves on a beach", model="demo-wan", size="64x64",
        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3},
    )  # fmt: skip
    assert not fresh.id.startswith(replica["replica_id"] + ".")
    done = client.videos.retrieve(fresh.id)
    while done.status not in ("completed", "failed"):
        time.sleep(0.2)
        done = client.videos.retrieve(fresh.id)
    assert done.status == "completed", done
