"""`ditserve serve --address` on a Ray cluster that also serves another Serve application: gRPC clients reach
ditserve's (Serve's proxy picks one by the ``application`` metadata), and Ctrl-C removes ditserve's
application only; the other one keeps answering."""

from __future__ import annotations

import tempfile

import grpc
import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from ditserve.cluster.client import APPLICATION, Client
from ditserve.cluster.config import APP_NAME
from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from tests.helpers import ServeProcess, png_pixels


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


def test_the_client_names_the_application_ditserve_deploys():
    assert APPLICATION == APP_NAME


def test_ctrl_c_deletes_only_our_application(ray_cluster):
    proc = ServeProcess("--model", "demo-flux", "--address", ray_cluster.address)
    try:
        serve.run(Other.bind(), name="other", route_prefix="/other")
        assert set(serve.status().applications) == {"ditserve", "other"}
        assert httpx.get(f"{proc.base_url}/health", timeout=30).status_code == 200
        with Client(f"127.0.0.1:{proc.grpc_port}", timeout_s=120) as client:
            assert [m.id for m in client.list_models().data] == ["demo-flux"]
            image = png_pixels(client.generate("a fox", size="64x64", num_inference_steps=1)[0])
            assert image.shape == (64, 64, 3)
        # A stub of one's own sends no application: with two applications, Serve cannot pick one.
        with grpc.insecure_channel(f"127.0.0.1:{proc.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.DitServeStub(channel).ListModels(pb.Empty(), timeout=60)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
        assert "application" in info.value.details().lower()
    finally:
        assert proc.stop() == 0, proc.output()
    apps = serve.status().applications
    assert "ditserve" not in apps and apps["other"].status == "RUNNING", apps
    r = httpx.get(f"{proc.base_url}/other", timeout=30)
    assert r.status_code == 200 and r.text == "the other application"
