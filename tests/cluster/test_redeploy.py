"""The desired control state belongs to one deployed application: a redeploy of a changed config (what
``serve deploy`` and a KubeRay update do: the same application updated in place) starts from its own config,
never from an old ``shutdown`` or stale adapters; a replica restart within one deploy still converges."""

from __future__ import annotations

import tempfile
import time

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ditserve.cluster.app import APP_NAME, build_app
from tests.helpers import free_port

KEY = "redeploy-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="rrd", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "temp_dir": temp_dir})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from tests.unit.test_lora_engine import weights, write_kohya

    folder = tmp_path_factory.mktemp("loras")
    return {name: write_kohya(folder / f"{name}.safetensors", weights(i)) for i, name in enumerate("ab")}


def deploy(base: str, **args) -> None:
    config = {"model": "demo-flux", "api_key": KEY, "grpc_port": 0, "replica_num_cpus": 0.2, **args}
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if serve.status().applications[APP_NAME].status == "RUNNING":
            return
        time.sleep(0.5)
    raise AssertionError(f"not RUNNING: {serve.status().applications[APP_NAME]}")


def image(base: str) -> httpx.Response:
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 1}
    return httpx.post(f"{base}/v1/images/generations", json=body, timeout=120)


def loras(base: str) -> set[str]:
    r = httpx.get(f"{base}/v1/loras", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return {a["name"] for a in r.json()["data"]}


def test_a_changed_config_starts_from_its_own_state(cluster, adapters):
    base = cluster
    deploy(base, lora_path=[f"a={adapters['a']}"], max_queue=8)
    assert image(base).status_code == 200 and loras(base) == {"a"}
    assert httpx.post(f"{base}/v1/admin/shutdown", headers=ADMIN, timeout=120).status_code == 200
    assert image(base).status_code == 503

    # The operator ships a changed config: it serves, with its own adapters only.
    deploy(base, lora_path=[f"b={adapters['b']}"], max_queue=9)
    r = image(base)
    assert r.status_code == 200, r.text
    assert loras(base) == {"b"}
