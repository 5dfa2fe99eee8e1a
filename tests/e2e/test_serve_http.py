"""`ditserve serve` as a user runs it: the official openai client, httpx, bad input, Ctrl-C."""

import base64
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import BadRequestError, NotFoundError, OpenAI

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from tests.helpers import ServeProcess, png_pixels


@pytest.fixture(scope="module")
def server():
    # The default model (demo-scenes), as the README's quickstart starts it.
    proc = ServeProcess("--max-n", "2", "--max-width", "256", "--max-height", "256")
    children = psutil.Process(proc.proc.pid).children(recursive=True)
    yield proc
    assert proc.stop() == 0, proc.output()
    # Ctrl-C leaves no Ray processes behind.
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.info if hasattr(p, "info") else p for p in alive]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def valid(client, seed=1):
    return client.images.generate(
        model="demo-scenes",
        prompt="a red circle on a blue background",
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": 3},
    )


def test_openai_client_gets_a_64x64_png(client):
    result = valid(client)
    data = base64.b64decode(result.data[0].b64_json)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_pixels(data).shape == (64, 64, 3)


def test_start_logs_no_false_notice_about_http_options(server, client):
    """serve.start applies --host/--port; serve.run's "New http_options ... will not be applied" is false."""
    valid(client)
    output = server.output()
    assert "ditserve: serving demo-scenes at" in output and "will not be applied" not in output


def test_same_seed_same_image_through_serve_and_generate(client, tmp_path):
    served = png_pixels(base64.b64decode(valid(client, seed=5).data[0].b64_json))
    assert np.array_equal(served, png_pixels(base64.b64decode(valid(client, seed=5).data[0].b64_json)))
    out = tmp_path / "g.png"
    cmd = [
        sys.executable,
        "-m",
        "ditserve.cluster.cli",
        "generate",
        "a red circle on a blue background",
        "--width",
        "64",
        "--height",
        "64",
        "--num-inference-steps",
        "3",
        "--seed",
        "5",
        "-o",
        str(out),
    ]
    # On a CPU, float sums depend on torch's intra-op thread count (a 64x64 demo image: 2 pixels differ by 1
    # between 1 and 2 threads); Ray starts the replica, which holds a fraction of a CPU, on one thread.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, env=env)
    assert np.array_equal(served, png_pixels(out.read_bytes()))


def test_models_health_and_replica_header(server, client):
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["demo-scenes"]
    assert httpx.get(f"{server.base_url}/v1/models/").json() == models  # was a 307 redirect
    # OpenAI's models.retrieve (GET /v1/models/{model}) was a bare 404 of an unknown path
    card = client.models.retrieve("demo-scenes")
    assert card.id == "demo-scenes" and card.object == "model"
    assert httpx.get(f"{server.base_url}/v1/models/demo-scenes").json() == models["data"][0]
    for name in ("dall-e-3", "org/name"):  # the client sends org%2Fname
        with pytest.raises(NotFoundError) as info:
            client.models.retrieve(name)
        assert info.value.body["param"] == "model" and repr(name) in info.value.message, info.value.body
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    r = httpx.post(
        f"{server.base_url}/v1/images/generations",
        json={"prompt": "a fox", "size": "64x64", "num_inference_steps": 2},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-ditserve-replica"]


BAD_BODIES = [
    ({"prompt": "a fox", "size": "64"}, "size"),
    ({"prompt": "a fox", "size": "64x65"}, "size"),
    ({"prompt": "a fox", "size": "1024x1024"}, "size"),
    ({"prompt": "a fox", "size": "64x64", "n": 0}, "n"),
    ({"prompt": "a fox", "size": "64x64", "n": 3}, "n"),
    ({"prompt": "", "size": "64x64"}, "prompt"),
    ({"prompt": "   ", "size": "64x64"}, "prompt"),
    ({"size": "64x64"}, "prompt"),
    ({"prompt": "a fox", "model": "dall-e-3"}, "model"),
    ({"prompt": 42, "size": "64x64"}, "prompt"),
    ({"prompt": "a fox", "n": "two"}, "n"),
    ({"prompt": "a fox", "num_inference_steps": 1000}, "num_inference_steps"),
    ({"prompt": "a fox", "response_format": "url"}, "response_format"),
    ({"prompt": "a fox", "colour": "red"}, "colour"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES)
def test_bad_input_names_the_field_and_server_keeps_serving(server, client, body, param):
    r = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=60)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"
    assert valid(client).data  # a valid request right after still succeeds


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_body_that_is_not_a_json_object(server, client, content):
    r = httpx.post(
        f"{server.base_url}/v1/images/generations",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"]
    assert valid(client).data


def test_openai_client_raises_bad_request_with_message(client):
    with pytest.raises(BadRequestError, match="multiples of 16"):
        client.images.generate(model="demo-scenes", prompt="a fox", size="100x100")


def test_empty_names_in_admin_paths_answer_404_naming_the_field(server):
    """DELETE /v1/loras/ was FastAPI's 307 redirect to /v1/loras (a client following it got a 405), and POST
    /v1/admin/memory/ a bare 404 naming nothing: an empty name is a 404 naming name / action, as an unknown
    one is. /v1/loras/ lists and loads as /v1/loras does, /v1/replicas/ lists (they were 307s too)."""
    base = server.base_url
    for method, path, param in (
        ("DELETE", "/v1/loras/", "name"),
        ("DELETE", "/v1/loras/nope", "name"),
        ("POST", "/v1/admin/memory/", "action"),
        ("POST", "/v1/admin/memory/nap", "action"),
    ):
        r = httpx.request(method, f"{base}{path}", timeout=60)
        assert r.status_code == 404, (method, path, r.status_code, r.headers)
        error = r.json()["error"]
        assert error["param"] == param and ("empty" in error["message"]) == path.endswith("/"), (path, error)
    for path, key in (("/v1/loras", "name"), ("/v1/replicas", "replica_id")):
        listed = httpx.get(f"{base}{path}/", timeout=60)
        plain = httpx.get(f"{base}{path}", timeout=60).json()
        assert listed.status_code == 200 and listed.json()["object"] == "list", (path, listed.text)
        assert [d[key] for d in listed.json()["data"]] == [d[key] for d in plain["data"]], path
    loaded = httpx.post(f"{base}/v1/loras/", json={"name": "a", "path": "/no/such.safetensors"}, timeout=60)
    assert loaded.status_code == 400 and loaded.json()["error"]["param"] == "path", loaded.text


def test_served_images_draw_the_held_out_prompts(client):
    from PIL import Image

    from ditserve.replica.models.scenes import held_out_scenes
    from ditserve.replica.models.scorer import score_scene

    scenes = held_out_scenes()[:16]
    wrong = []
    for i, scene in enumerate(scenes):  # the server's defaults: 20 steps, the model's recommended CFG
        result = client.images.generate(
            model="demo-scenes", prompt=scene.caption, size="64x64", extra_body={"seed": 1000 + i}
        )
        image = Image.fromarray(png_pixels(base64.b64decode(result.data[0].b64_json)))
        if score_scene(image) != (scene.background, scene.colour):
            wrong.append((scene.caption, score_scene(image)))
    assert len(wrong) <= 1, wrong


def test_a_true_cfg_scale_alone_guides_against_the_recommended_negative_prompt(client):
    """demo-scenes recommends true CFG 3 against the empty negative prompt. A request raising the scale and
    giving no negative prompt guides at its scale against that one (two forwards a step, the image of
    negative_prompt "" at that scale); it was drawn without guidance, as true_cfg_scale 1 draws."""
    steps = 3

    def generate(**extra):
        result = client.images.generate(
            model="demo-scenes",
            prompt="a red circle on a blue background",
            size="64x64",
            extra_body={"seed": 2, "num_inference_steps": steps, "cache": {"policy": "none"}, **extra},
        )
        return png_pixels(base64.b64decode(result.data[0].b64_json)), result.usage.transformer_forwards

    alone, alone_forwards = generate(true_cfg_scale=5.0)
    given, given_forwards = generate(true_cfg_scale=5.0, negative_prompt="")
    off, off_forwards = generate(true_cfg_scale=1.0)
    assert (alone_forwards, given_forwards, off_forwards) == (2 * steps, 2 * steps, steps)
    assert np.array_equal(alone, given) and not np.array_equal(alone, off)


def test_shutdown_turns_health_and_generation_to_503(server):
    """Last in this module: it shuts the module's server down for good, here through gRPC's Shutdown (POST
    /v1/admin/shutdown is the README's last block, run by tests/e2e/test_docs.py); gRPC's Health answers as
    GET /health does, and so does the standard grpc.health.v1 service (SERVING, then NOT_SERVING; it was
    UNIMPLEMENTED, so grpc_health_probe and Kubernetes' gRPC probes could not ask)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = pb_grpc.DitServeStub(channel)
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert stub.Health(pb.Empty(), timeout=60).status == "ok"
    standard = health_pb2_grpc.HealthStub(channel)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", "ditserve.v1.DitServe"):
        assert standard.Check(health_pb2.HealthCheckRequest(service=service), timeout=60).status == serving
    with pytest.raises(grpc.RpcError) as info:
        standard.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details().startswith("service: ")
    watch = standard.Watch(health_pb2.HealthCheckRequest(service="ditserve.v1.DitServe"), timeout=120)
    assert next(watch).status == serving
    long = {"prompt": "a fox", "size": "256x256", "num_inference_steps": 100}
    with ThreadPoolExecutor(1) as pool:  # a request running when the shutdown comes
        running = pool.submit(httpx.post, f"{server.base_url}/v1/images/generations", json=long, timeout=120)
        while not any(
            r["stats"]["running"] for r in httpx.get(f"{server.base_url}/v1/replicas").json()["data"]
        ):
            assert not running.done(), running.result().text
            time.sleep(0.05)
        assert stub.Shutdown(pb.Empty(), timeout=120).replicas
        ended = running.result()
    # It ends as requests after the shutdown do (it was a 500 "see the server log").
    assert ended.status_code == 503 and "shut down" in ended.json()["error"]["message"], ended.text
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503, health.text
    error = health.json()["error"]
    assert "shut down" in error["message"] and error["type"] == "service_unavailable_error"
    for call in (
        lambda: stub.Health(pb.Empty(), timeout=60),
        lambda: stub.Generate(pb.GenerateRequest(prompt="a fox", size="64x64"), timeout=60),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in info.value.details()
        assert "/v1/" not in info.value.details(), info.value.details()  # the RPC, not HTTP's route
    assert next(watch).status == not_serving  # the watch tells the change
    watch.cancel()
    assert standard.Check(health_pb2.HealthCheckRequest(), timeout=60).status == not_serving
    with pytest.raises(grpc.RpcError) as info:  # a control op after it: refused, naming the RPC as well
        stub.ReleaseMemory(pb.Empty(), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down by Shutdown" in info.value.details(), info.value.details()
    channel.close()
    generated = httpx.post(
        f"{server.base_url}/v1/images/generations",
        json={"prompt": "a fox", "size": "64x64", "num_inference_steps": 1},
        timeout=120,
    )
    assert generated.status_code == 503, generated.text
    # Control ops find no engine to converge: answered at once, not after the broadcast's timeout, and not
    # recorded (the desired state's version stays: the cluster was not told to resume).
    version = httpx.get(f"{server.base_url}/v1/replicas", timeout=60).json()["desired_version"]
    for path in ("/v1/admin/memory/resume", "/v1/admin/memory/release"):
        refused = httpx.post(f"{server.base_url}{path}", timeout=60)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 503 and "shut down" in message and "restart" in message, refused.text
    after = httpx.get(f"{server.base_url}/v1/replicas", timeout=60).json()["desired_version"]
    assert after == version
