"""`ditserve serve --direct-ingress` on a local Ray cluster of 2 simulated hosts: the Frontend replica itself
listens on --port and --grpc-port (no Serve proxy actor in between) and the API behaves as through the proxy:
its headers, SSE, WebSockets, gRPC, round-robin, pinned sessions, and the 503 with Retry-After for a request
in flight on a replica that dies.

The nodes are started with the environment ``direct_ingress_env`` names (Serve reads the mode from the Ray
nodes, not from the application); tests run in file order, the replica kill last.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import msgpack
import psutil
import pytest
import ray
import websockets
from openai import OpenAI
from ray.cluster_utils import Cluster

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from ditserve.cluster.ingress import direct_ingress_env
from tests.helpers import ServeProcess, free_port, png_pixels

SMALL = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2}


def test_joined_cluster_without_the_variables_is_refused_naming_them():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    cmd = [str(Path(sys.executable).with_name("ditserve")), "serve", "--model", "demo-flux"]
    cmd += ["--address", "127.0.0.1:1", "--direct-ingress", "--port", "8765"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" in done.stderr + done.stdout
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8765" in done.stderr + done.stdout


@pytest.fixture(scope="module")
def ports():
    return free_port(), free_port()


@pytest.fixture(scope="module")
def ray_cluster(ports):
    saved = dict(os.environ)
    os.environ.update(direct_ingress_env(*ports))  # the nodes started below (and ditserve serve) read them
    temp_dir = tempfile.mkdtemp(prefix="rdi", dir="/tmp")  # private: ray.init("auto") elsewhere won't join
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": temp_dir})
    cluster.add_node(num_cpus=1, temp_dir=temp_dir)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def server(ray_cluster, ports):
    http_port, grpc_port = ports
    proc = ServeProcess(
        "--model", "demo-flux", "--dp-size", "2", "--address", ray_cluster.address, "--direct-ingress",
        "--port", str(http_port), "--grpc-port", str(grpc_port),
        timeout_s=300, attempts=1,
    )  # fmt: skip
    proc.grpc_port = grpc_port
    yield proc
    assert proc.stop() == 0, proc.output()


def listener_of(port: int) -> str:
    """The command line of the process listening on ``port`` (Ray sets worker titles such as
    ``ray::ServeReplica:ditserve:Frontend``)."""
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return " ".join(psutil.Process(conn.pid).cmdline())
    return ""


def test_the_frontend_replica_answers_on_the_api_ports(server):
    for port in (server.port, server.grpc_port):
        owner = listener_of(port)
        assert "ServeReplica:ditserve:Frontend" in owner and "ProxyActor" not in owner, (port, owner)
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "demo-flux"
    assert f"serving demo-flux at http://127.0.0.1:{server.port}/v1" in server.output()


def test_openai_client_image_and_round_robin_headers(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.images.with_raw_response.generate(
        model="demo-flux", prompt="a red fox", size="64x64", response_format="b64_json",
        extra_body={"seed": 1, "num_inference_steps": 2},
    )  # fmt: skip
    assert png_pixels(base64.b64decode(raw.parse().data[0].b64_json)).shape == (64, 64, 3)
    assert raw.headers["x-ditserve-replica"]
    served = Counter(
        httpx.post(
            f"{server.base_url}/v1/images/generations", json={**SMALL, "seed": i}, timeout=120
        ).headers["x-ditserve-replica"]
        for i in range(6)
    )
    assert sorted(served.values()) == [3, 3], served


def test_sse_stream_sends_steps_then_done(server):
    body = {**SMALL, "seed": 9, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/images/generations", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event:")]
    assert names.count("image_generation.progress") == 2 and lines[-1] == "data: [DONE]", lines[:4]


def test_sessions_stay_on_their_owner_over_http_and_websocket(server):
    opened = [
        httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}, timeout=60) for _ in range(2)
    ]
    owners = {r.json()["id"]: r.headers["x-ditserve-replica"] for r in opened}
    assert len(set(owners.values())) == 2, owners
    for sid, owner in owners.items():
        for _ in range(2):
            body = {"prompt": "a red fox", "num_inference_steps": 2}
            step = httpx.post(f"{server.base_url}/v1/sessions/{sid}/generate", json=body, timeout=60)
            assert step.status_code == 200 and step.headers["x-ditserve-replica"] == owner

    async def over_websocket(sid: str) -> dict:
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/sessions/{sid}/stream") as ws:
            await ws.send(json.dumps({"prompt": "a blue fox", "num_inference_steps": 2, "seed": 2}))
            while (message := json.loads(await ws.recv()))["type"] != "image":
                pass
            return message

    for sid, owner in owners.items():
        assert asyncio.run(over_websocket(sid))["replica"] == owner


def test_realtime_websocket_route_answers(server):
    async def init() -> dict:
        url = f"ws://127.0.0.1:{server.port}/v1/realtime_video/generate"
        async with websockets.connect(url) as ws:
            await ws.send(msgpack.packb({"type": "init", "prompt": "a fox"}))  # msgpack maps, both ways
            return msgpack.unpackb(await ws.recv())

    answer = asyncio.run(init())  # demo-flux makes images: the route itself answers why it cannot stream
    assert answer["type"] == "error" and "demo-flux" in answer["content"], answer


def test_grpc_on_the_grpc_port(server):
    """Unary and streamed calls, an error's code and message, and the standard health service, as through
    the proxy."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.DitServeStub(channel)
        checked = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        request = pb.GenerateRequest(prompt="a red fox", size="64x64", num_inference_steps=2, seed=4)
        reply = stub.Generate(request)
        events = list(stub.GenerateStream(pb.GenerateRequest(preview=True, **_set(request))))
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(prompt="a red fox", size="64x65"))
    assert png_pixels(reply.images[0]).shape == (64, 64, 3)
    assert [e.WhichOneof("event") for e in events] == ["progress", "progress", "result"]
    assert events[0].progress.preview[:4] == b"\x89PNG" and events[-1].result.images[0] == reply.images[0]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("size: ")
    assert checked.status == health_pb2.HealthCheckResponse.SERVING


def _set(message) -> dict:
    return {f.name: v for f, v in message.ListFields()}


def test_request_on_a_dying_replica_gets_503_with_retry_after(server):
    base = server.base_url
    listed = httpx.get(f"{base}/v1/replicas", timeout=60).json()["data"]
    victim = listed[0]["replica_id"]
    # Found before the requests start: finding it takes a GCS round trip (a second on a loaded machine), as
    # long as the requests themselves, and the kill must land while the victim runs one.
    named = ray.util.list_named_actors(all_namespaces=True)
    actor = next(a for a in named if a["name"].endswith(f"#{victim}"))
    victim_actor = ray.get_actor(actor["name"], namespace=actor["namespace"])
    # Long requests (a second or more each), and the load lasts until the kill: four workers send them back to
    # back, so the victim is running one whenever it is looked at (four requests sent once could all end
    # between two looks on a slow machine, and the kill then found the victim idle: no 503).
    body = {**SMALL, "size": "128x128", "num_inference_steps": 100}
    stop = threading.Event()

    def load(worker: int) -> list[httpx.Response]:
        answers = []
        while not stop.is_set():
            url = f"{base}/v1/images/generations"
            answers.append(httpx.post(url, json={**body, "seed": worker}, timeout=120))
        return answers

    pool = cf.ThreadPoolExecutor(4)
    inflight = [pool.submit(load, i) for i in range(4)]
    try:
        deadline, running = time.monotonic() + 120, False
        while not running and time.monotonic() < deadline:  # kill while the victim runs a request
            time.sleep(0.2)
            now = httpx.get(f"{base}/v1/replicas", timeout=60).json()["data"]
            running = next(r["stats"]["running"] for r in now if r["replica_id"] == victim)
        assert running, "the victim replica was never seen running a request"
    finally:
        stop.set()  # no request starts after the kill: the ones in flight then are those it may fail
    ray.kill(victim_actor, no_restart=True)
    per_worker = [f.result(timeout=180) for f in inflight]
    pool.shutdown()
    # a failure is only ever a worker's request in flight at the kill
    for answers in per_worker:
        assert all(r.status_code == 200 for r in answers[:-1]), [r.status_code for r in answers]
    results = [r for answers in per_worker for r in answers]
    statuses = Counter(r.status_code for r in results)
    assert set(statuses) <= {200, 503} and statuses[503] >= 1, statuses
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
            assert "replica serving this request failed" in r.json()["error"]["message"]
    # The other replica keeps answering on the same port.
    assert httpx.post(f"{base}/v1/images/generations", json=SMALL, timeout=120).status_code == 200
