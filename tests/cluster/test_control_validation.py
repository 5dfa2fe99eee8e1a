"""A bad control request never poisons the cluster: it is refused (4xx naming the field, or 503 when no
replica can answer) before it enters the desired state, and a replica that cannot apply an item of the
desired state (an adapter file deleted after a good load, one given at start with --lora-path too) refuses
that item and serves the rest.

CPU, real Ray, ``ditserve serve --dp-size 2 --lora-root ROOT``, one server for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from ditserve.replica.models.demo import ensure_demo_model
from tests.helpers import ServeProcess

KEY = "control-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from tests.unit.test_lora_engine import weights, write_kohya

    root = tmp_path_factory.mktemp("loras")
    write_kohya(root / "good.safetensors", weights(1))
    write_kohya(root / "at_start.safetensors", weights(2))  # --lora-path, deleted by a test below
    (root / "notes.safetensors").write_text("not a safetensors file\n")
    (root / "empty").mkdir()
    # A valid LoRA layout whose shapes fit no module of the model.
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 7),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(5, 4),
        },
        str(root / "wrong_shapes.safetensors"),
    )
    no_model = root / "no-model"
    no_model.mkdir()
    (no_model / "readme.txt").write_text("no model here")
    # The served transformer's folder with one tensor NaN, left out, or of another shape.
    served = ensure_demo_model("demo-flux") / "transformer"
    for name, change in (("nan-weights", "nan"), ("lacking-weights", "drop"), ("shape-weights", "shape")):
        shutil.copytree(served, root / name)
        for file in (root / name).glob("*.safetensors"):
            tensors = load_file(file)
            if change == "nan":
                tensors["norm_out.linear.weight"] = torch.full_like(
                    tensors["norm_out.linear.weight"], torch.nan
                )
            elif change == "shape":
                tensors["norm_out.linear.weight"] = torch.zeros(257, 129)
            else:
                del tensors["norm_out.linear.weight"]
            save_file(tensors, str(file))
    return root


@pytest.fixture(scope="module")
def server(root):
    proc = ServeProcess(
        "--model", "demo-flux", "--dp-size", "2", "--api-key", KEY, "--lora-root", str(root),
        "--lora-path", "at_start=at_start.safetensors", timeout_s=300,
    )  # fmt: skip
    yield proc
    proc.stop()


def loras(url: str) -> dict:
    r = httpx.get(f"{url}/v1/loras", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return {a["name"]: a for a in r.json()["data"]}


def replicas(url: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/replicas", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def both_serve(url: str, **extra) -> set[str]:
    served = set()
    for seed in range(4):
        body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": seed, **extra}
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-ditserve-replica"])
    return served


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def bad_requests(root) -> dict[str, tuple[str, dict]]:
    lora = "/v1/loras"
    return {
        "not safetensors": (lora, {"name": "x", "path": str(root / "notes.safetensors")}),
        "missing file": (lora, {"name": "x", "path": str(root / "gone.safetensors")}),
        "wrong shapes": (lora, {"name": "x", "path": str(root / "wrong_shapes.safetensors")}),
        "directory": (lora, {"name": "x", "path": str(root / "empty")}),
        "system file": (lora, {"name": "x", "path": "/etc/passwd"}),
        "outside the root": (lora, {"name": "x", "path": "/tmp/../etc/hostname"}),
        "weights without a model": ("/v1/admin/weights", {"path": str(root / "no-model")}),
        # Names the OS refuses: over its length limit (a 500 before), with a NUL (no field was named).
        "a name too long": (lora, {"name": "x", "path": "x" * 5000}),
        "weights under a name too long": ("/v1/admin/weights", {"path": "/" + "x" * 5000}),
        "a NUL character": (lora, {"name": "x", "path": "good.safetensors\x00"}),
        "weights with a NUL character": ("/v1/admin/weights", {"path": str(root) + "\x00"}),
    }


def test_bad_control_requests_are_refused_and_change_nothing(server, root):
    url = server.base_url
    wait_for(lambda: len(replicas(url)) == 2, 120, "two replicas")
    before = loras(url)
    for case, (route, body) in bad_requests(root).items():
        r = httpx.post(f"{url}{route}", json=body, headers=ADMIN, timeout=120)
        assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == "path" and "path" in error["message"], (case, error)
        assert os.getcwd() not in error["message"] or str(root).startswith(os.getcwd()), (case, error)
        assert loras(url) == before, case
    assert len(both_serve(url)) == 2
    assert all(r["control_state"]["weights"]["version"] == 0 for r in replicas(url))


def test_weights_with_nan_a_tensor_left_out_or_of_another_shape_are_refused_naming_it(server, root):
    """NaN weights were committed (every image black afterwards); a folder lacking a tensor was refused with
    torch's 'Cannot copy out of meta tensor'. These and a tensor of another shape answer 400 (HTTP) and
    INVALID_ARGUMENT (gRPC) naming path and the tensor, and the served weights stay."""
    url = server.base_url
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.DitServeStub(channel)
    cases = {
        "nan-weights": "holds NaN or infinite weights (norm_out.linear.weight)",
        "lacking-weights": "lacks the transformer's tensor norm_out.linear.weight",
        # diffusers' own words advised from_pretrained arguments no client can pass
        "shape-weights": "holds norm_out.linear.weight of shape [257, 129]; the served model's is [256, 128]",
    }
    for folder, words in cases.items():
        path = str(root / folder)
        r = httpx.post(f"{url}/v1/admin/weights", json={"path": path}, headers=ADMIN, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "path" and f"{path} {words}" in error["message"], error
        assert error["message"].count(path) == 1, error  # not "could not load weights from PATH: path: PATH"
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(
                pb.UpdateWeightsRequest(path=path), metadata=[("authorization", f"Bearer {KEY}")], timeout=120
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert f"{path} {words}" in info.value.details()
    channel.close()
    assert all(r["control_state"]["weights"]["version"] == 0 for r in replicas(url))
    assert len(both_serve(url)) == 2


def test_a_request_running_during_a_weights_update_ends_503_and_the_next_is_served(server):
    """A request part-way through its steps when new weights are committed is not finished on a mix of both
    (it was: an image drawn with each, like neither's): it ends with a retryable 503 naming the update, over
    HTTP (an SSE error event) and gRPC (UNAVAILABLE, naming the RPC); the next request is served."""
    url = server.base_url
    served = str(ensure_demo_model("demo-flux"))
    long = {"prompt": "a red fox", "size": "512x512", "num_inference_steps": 100, "seed": 1}

    def update() -> None:
        r = httpx.post(f"{url}/v1/admin/weights", json={"path": served}, headers=ADMIN, timeout=300)
        assert r.status_code == 200, r.text

    events, data = [], None
    with httpx.stream(
        "POST", f"{url}/v1/images/generations", json={**long, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event:"):
                events.append(line.removeprefix("event:").strip())
                if events == ["image_generation.progress"]:
                    update()  # after its first step
            elif line.startswith("data:") and events[-1:] == ["error"] and data is None:
                data = line.removeprefix("data:").strip()
        assert events[-1] == "error" and "image_generation.completed" not in events, events
    error = json.loads(data)["error"]
    assert error["type"] == "service_unavailable_error", error
    assert f"the served weights were replaced (POST /v1/admin/weights, {served})" in error["message"]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = pb_grpc.DitServeStub(channel)
    stream = stub.GenerateStream(pb.GenerateRequest(**long), timeout=300)
    assert next(stream).WhichOneof("event") == "progress"
    update()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    channel.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert f"the served weights were replaced (UpdateWeights, {served})" in info.value.details()
    assert len(both_serve(url)) == 2


def test_without_the_key_every_admin_route_answers_401_whatever_the_body(server):
    """The key is checked before the body: a caller without it is not told which fields a route takes."""
    url = server.base_url
    routes = [("POST", "/v1/admin/weights", {}), ("POST", "/v1/loras", {"name": 5}),
              ("POST", "/v1/admin/memory/release", {}), ("POST", "/v1/admin/shutdown", {}),
              ("GET", "/v1/loras", None), ("DELETE", "/v1/loras/nope", None)]  # fmt: skip
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, route, body in routes:
            r = httpx.request(method, f"{url}{route}", json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (method, route, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert all(x["health"] == "ok" for x in replicas(url))


def test_a_relative_path_is_read_under_the_root(server):
    url = server.base_url
    r = httpx.post(
        f"{url}/v1/loras", json={"name": "rel", "path": "good.safetensors"}, headers=ADMIN, timeout=120
    )
    assert r.status_code == 200, r.text
    assert "rel" in loras(url)
    r = httpx.delete(f"{url}/v1/loras/rel", headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text


def test_loading_a_name_whose_adapter_still_drains_is_409_and_changes_nothing(server):
    """An unload waits for the requests that use the adapter; loading that name meanwhile is a conflict to
    retry (409; gRPC ABORTED, which tells a client to retry, where FAILED_PRECONDITION told it to fix the
    state first), not bad input (it was 400); the accepted requests are served, and the retry succeeds."""
    url = server.base_url

    def load():
        body = {"name": "busy", "path": "good.safetensors"}
        return httpx.post(f"{url}/v1/loras", json=body, headers=ADMIN, timeout=120)

    assert load().status_code == 200
    # long enough (seconds each on the torch path) that the requests still run while the unload and the load
    # below are answered
    body = {"prompt": "a red fox", "size": "256x256", "num_inference_steps": 100, "lora": {"name": "busy"}}
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.DitServeStub(channel)
    with channel, ThreadPoolExecutor(4) as pool:
        answers = [
            pool.submit(httpx.post, f"{url}/v1/images/generations", json={**body, "seed": s}, timeout=300)
            for s in range(4)
        ]
        wait_for(
            lambda: all(r["stats"]["queue_depth"] + r["stats"]["running"] > 0 for r in replicas(url)),
            60,
            "requests queued or running on both replicas",
        )
        assert httpx.delete(f"{url}/v1/loras/busy", headers=ADMIN, timeout=120).status_code == 200
        refused = load()
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["param"] == "name" and "retry" in refused.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as info:
            stub.LoadLoRA(
                pb.LoadLoRARequest(name="busy", path="good.safetensors"),
                metadata=[("authorization", f"Bearer {KEY}")],
                timeout=120,
            )
        assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
        # the same message, led by the field (a gRPC status has no param beside its details)
        assert info.value.details() == "name: " + refused.json()["error"]["message"]
        assert "busy" not in loras(url)
        assert all(a.result().status_code == 200 for a in answers)
    assert wait_for(lambda: load().status_code == 200, 60, "the load once the requests are done")
    assert httpx.delete(f"{url}/v1/loras/busy", headers=ADMIN, timeout=120).status_code == 200


def test_an_op_no_replica_answers_is_503_and_not_recorded(server, root):
    url = server.base_url
    before = loras(url)
    for replica in replicas(url):
        os.kill(replica["ranks"][0]["pid"], signal.SIGKILL)
    r = httpx.post(
        f"{url}/v1/loras",
        json={"name": "late", "path": str(root / "good.safetensors")},
        headers=ADMIN,
        timeout=120,
    )
    assert r.status_code == 503, r.text
    assert "retry" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
    assert loras(url) == before
    wait_for(
        lambda: len(rs := replicas(url)) == 2 and all(x["health"] == "ok" for x in rs), 150, "replacements"
    )
    assert len(both_serve(url)) == 2


def test_a_deleted_adapter_file_does_not_crash_loop_its_replacement(server, root, tmp_path):
    url = server.base_url
    path = root / "doomed.safetensors"
    path.write_bytes((root / "good.safetensors").read_bytes())
    r = httpx.post(f"{url}/v1/loras", json={"name": "doomed", "path": str(path)}, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    path.unlink()  # the shared volume changed
    (root / "at_start.safetensors").unlink()  # the adapter given at start too: no crash loop either
    victim = replicas(url)[0]
    os.kill(victim["ranks"][0]["pid"], signal.SIGKILL)

    def replaced():
        rs = replicas(url)
        fresh = [x for x in rs if x["replica_id"] != victim["replica_id"]]
        return len(rs) == 2 and len(fresh) == 2 and all(x["health"] == "ok" for x in rs) and rs

    now = wait_for(replaced, 120, "the replacement serving within two minutes")
    new = next(
        x for x in now if x["replica_id"] not in {victim["replica_id"]} and "lora:doomed" in x["refused"]
    )
    assert "does not exist" in new["refused"]["lora:doomed"]
    assert "does not exist" in new["refused"]["lora:at_start"]
    assert len(both_serve(url)) == 2
