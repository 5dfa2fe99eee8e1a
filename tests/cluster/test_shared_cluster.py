"""`ditserve serve --address` on a Ray cluster that also serves another Serve application: Ctrl-C removes
ditserve's application only; the other one keeps answering."""

from __future__ import annotations

import tempfile

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from tests.helpers import ServeProcess


@pytest.fixture(scope="module")
def ray_cluster():
    temp_dir = tempfile.mkdtemp(prefix="rsh", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "temp_dir": temp_dir})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Other:
    async def __call__(self, request) -> str:
        return "the other application"


def test_ctrl_c_deletes_only_our_application(ray_cluster):
    proc = ServeProcess("--model", "demo-flux", "--address", ray_cluster.address)
    try:
        serve.run(Other.bind(), name="other", route_prefix="/other")
        assert set(serve.status().applications) == {"ditserve", "other"}
        assert httpx.get(f"{proc.base_url}/health", timeout=30).status_code == 200
    finally:
        assert proc.stop() == 0, proc.output()
    apps = serve.status().applications
    assert "ditserve" not in apps and apps["other"].status == "RUNNING", apps
    r = httpx.get(f"{proc.base_url}/other", timeout=30)
    assert r.status_code == 200 and r.text == "the other application"
