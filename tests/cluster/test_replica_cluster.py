"""The replica cluster as users see it: `ditserve serve --address` on a local Ray cluster of 3 simulated
hosts (one custom resource per host), real HTTP, the real demo engine.

One Ray cluster for the module; one `ditserve serve` per test class (classes run one after the other,
since both deploy the app "ditserve"). Tests within a class share the server and run in file order: the
replica-kill test comes last in its class.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from tests.helpers import ServeProcess, png_pixels, psnr

NUM_HOSTS = 3
API_KEY = "test-key"
ADMIN = {"Authorization": f"Bearer {API_KEY}"}
SMALL = {"size": "64x64", "num_inference_steps": 2}
# The sharded server's --session-idle-timeout-s: long enough that the five opens of the cap test are all
# answered before the first session could expire, on a slow machine too (with 3 s the fifth could find a
# slot freed by an expired first session and answer 200 instead of 429).
IDLE_S = 6


@pytest.fixture(scope="module")
def ray_cluster():
    # A private temp dir: processes that look for a local cluster (ray.init("auto")) do not join this one.
    temp_dir = tempfile.mkdtemp(prefix="rdt", dir="/tmp")
    head = {"num_cpus": 1, "resources": {"host0": 1}, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for i in range(1, NUM_HOSTS):
        cluster.add_node(num_cpus=1, resources={f"host{i}": 1}, temp_dir=temp_dir)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def host_of(node_id: str) -> str:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return next(k for k in node["Resources"] if k.startswith("host"))
    raise KeyError(node_id)


def generate(base_url: str, seed: int = 1, **extra) -> httpx.Response:
    body = {"prompt": "a red fox", "seed": seed, **SMALL, **extra}
    return httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=120)


def image_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return png_pixels(base64.b64decode(response.json()["data"][0]["b64_json"]))


def replicas(base_url: str) -> list[dict]:
    r = httpx.get(f"{base_url}/v1/replicas", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_more_cpus_than_the_cluster_has_fails_at_start(ray_cluster):
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "serve", "--model", "demo-flux"]
    cmd += ["--address", ray_cluster.address, "--dp-size", "8", "--replica-num-cpus", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "need 8 CPU" in done.stderr and "has 3" in done.stderr, done.stderr


def test_a_serve_config_builds_on_a_cluster_whose_nodes_have_not_joined_yet(ray_cluster):
    """serve run / serve deploy / KubeRay call the builder in the cluster as soon as they are asked (KubeRay:
    once the head pod is ready, before its worker pods join). A builder that refused a cluster too small
    *now* failed the deploy for good (DEPLOY_FAILED; it is not built again when the workers join); Serve
    waits for the nodes instead. `ditserve serve` still refuses at once (the test above)."""
    from ray.serve import Application

    from ditserve.cluster.app import build_app

    app = build_app({"model": "demo-flux", "dp_size": 8, "replica_num_cpus": 1})  # 8 CPUs; the cluster has 3
    assert isinstance(app, Application)


@pytest.fixture(scope="class")
def weights_dir(tmp_path_factory):
    """A second checkpoint of demo-flux: the same transformer with perturbed weights."""
    import torch
    from diffusers import FluxTransformer2DModel

    from ditserve.replica.models.registry import resolve_model

    model = FluxTransformer2DModel.from_pretrained(f"{resolve_model('demo-flux').path}/transformer")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    out = tmp_path_factory.mktemp("weights")
    model.save_pretrained(out / "transformer")
    return str(out)


class TestThreeReplicas:
    @pytest.fixture(scope="class")
    def server(self, ray_cluster):
        proc = ServeProcess(
            "--model", "demo-flux", "--dp-size", "3", "--address", ray_cluster.address,
            "--api-key", API_KEY,
            timeout_s=300,
        )  # fmt: skip
        yield proc
        assert proc.stop() == 0, proc.output()

    def test_replicas_sit_on_distinct_hosts(self, server):
        listed = replicas(server.base_url)
        assert len(listed) == 3
        assert len({host_of(r["node_id"]) for r in listed}) == NUM_HOSTS
        for r in listed:
            assert r["health"] == "ok" and r["layout"]["world_size"] == 1 and r["node_ip"]
            assert r["control_version"] == 0

    def test_round_robin_balances_30_requests(self, server):
        served = Counter(generate(server.base_url, seed=i).headers["x-ditserve-replica"] for i in range(30))
        assert len(served) == 3 and all(9 <= n <= 11 for n in served.values()), served

    def test_session_steps_stay_on_the_owner_and_refine(self, server):
        url = f"{server.base_url}/v1/sessions"
        opened = httpx.post(url, json={"size": "64x64"}, timeout=60)
        assert opened.status_code == 200, opened.text
        sid, owner = opened.json()["id"], opened.headers["x-ditserve-replica"]
        assert sid.startswith(owner + ".")
        images = []
        for step, prompt in enumerate(["a fox", "a red fox", "a red fox, snow", "fox at night", "owl"], 1):
            body = {"prompt": prompt, "strength": 0.5, "num_inference_steps": 4, "seed": 7}
            r = httpx.post(f"{url}/{sid}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-ditserve-replica"] == owner and r.json()["step"] == step
            images.append(image_of(r))
        # A step refines the previous image: it stays closer to it than a fresh image of the prompt.
        fresh = image_of(generate(server.base_url, seed=7, prompt="owl", num_inference_steps=4))
        assert psnr(images[-1], images[-2]) > psnr(fresh, images[-2])
        assert httpx.delete(f"{url}/{sid}", timeout=30).status_code == 200
        gone = httpx.post(f"{url}/{sid}/generate", json={"prompt": "x"}, timeout=30)
        assert gone.status_code == 404 and "closed or expired" in gone.json()["error"]["message"]

    def test_admin_ops_need_the_api_key(self, server):
        for path in ["/v1/admin/weights", "/v1/admin/memory/release", "/v1/admin/shutdown"]:
            r = httpx.post(f"{server.base_url}{path}", json={"path": "/x"}, timeout=30)
            assert r.status_code == 401, (path, r.text)
        assert httpx.get(f"{server.base_url}/v1/loras", timeout=30).status_code == 401

    def test_memory_release_refuses_generation_until_resumed(self, server):
        before = image_of(generate(server.base_url, seed=3))
        r = httpx.post(f"{server.base_url}/v1/admin/memory/release", headers=ADMIN, timeout=120)
        assert r.status_code == 200 and r.json()["answered"] == 3, r.text
        assert {x["health"] for x in replicas(server.base_url)} == {"released"}
        refused = generate(server.base_url, seed=3)
        assert refused.status_code == 503 and "released" in refused.json()["error"]["message"]
        r = httpx.post(f"{server.base_url}/v1/admin/memory/resume", headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        assert np.array_equal(image_of(generate(server.base_url, seed=3)), before)

    def test_weights_update_is_all_or_nothing(self, server, weights_dir):
        before = image_of(generate(server.base_url, seed=4))
        bad = httpx.post(
            f"{server.base_url}/v1/admin/weights", json={"path": "/no/such/dir"}, headers=ADMIN, timeout=120
        )
        assert bad.status_code == 400 and "/no/such/dir" in bad.json()["error"]["message"]
        assert all(r["control_state"]["weights"]["version"] == 0 for r in replicas(server.base_url))
        assert np.array_equal(image_of(generate(server.base_url, seed=4)), before)
        r = httpx.post(
            f"{server.base_url}/v1/admin/weights", json={"path": weights_dir}, headers=ADMIN, timeout=300
        )
        assert r.status_code == 200, r.text
        assert r.json()["answered"] == 3 and r.json()["missing"] == 0
        listed = replicas(server.base_url)
        assert {x["control_state"]["weights"]["path"] for x in listed} == {weights_dir}
        # Every replica now draws with the new weights (3 requests: one per replica).
        after = [image_of(generate(server.base_url, seed=4)) for _ in range(3)]
        assert all(np.array_equal(a, after[0]) for a in after) and not np.array_equal(after[0], before)

    def test_lora_load_reaches_every_replica(self, server, tmp_path_factory):
        from tests.unit.test_lora_engine import weights, write_kohya

        path = write_kohya(tmp_path_factory.mktemp("lora") / "style.safetensors", weights(1))
        before = image_of(generate(server.base_url, seed=6))
        r = httpx.post(
            f"{server.base_url}/v1/loras",
            json={"name": "style", "path": str(path)},
            headers=ADMIN,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["answered"] == 3 and r.json()["missing"] == 0
        listed = replicas(server.base_url)
        assert all("style" in x["control_state"]["loras"] for x in listed)
        # one request per replica, each with the adapter: the same new picture everywhere
        styled = [generate(server.base_url, seed=6, lora={"name": "style"}) for _ in range(3)]
        assert {s.headers["x-ditserve-replica"] for s in styled} == {x["replica_id"] for x in listed}
        pictures = [image_of(s) for s in styled]
        assert all(np.array_equal(p, pictures[0]) for p in pictures)
        assert psnr(pictures[0], before) < 35
        unknown = generate(server.base_url, seed=6, lora={"name": "nope"})
        assert unknown.status_code == 400 and "'nope'" in unknown.json()["error"]["message"]

    def test_killed_replica_restarts_with_the_state_and_its_sessions_answer_410(self, server):
        base = server.base_url
        listed = replicas(base)
        desired = listed[0]["control_version"]
        url = f"{base}/v1/sessions"
        sessions = [httpx.post(url, json={}, timeout=60) for _ in range(3)]
        owners = {s.headers["x-ditserve-replica"]: s.json()["id"] for s in sessions}
        victim = listed[0]["replica_id"]
        assert set(owners) == {r["replica_id"] for r in listed}

        # Long requests in flight on every replica, then kill one replica's actor. The load lasts until the
        # kill (six workers sending 50-step requests back to back): six requests sent once could all end
        # between two looks at the victim on a slow machine, and the kill then hit an idle replica.
        stop = threading.Event()

        def load(worker: int) -> list[httpx.Response]:
            answers = []
            while not stop.is_set():
                answers.append(generate(base, worker, num_inference_steps=50))
            return answers

        pool = cf.ThreadPoolExecutor(6)
        inflight = [pool.submit(load, i) for i in range(6)]
        try:
            deadline = time.monotonic() + 120
            running = False
            while not running and time.monotonic() < deadline:  # kill while the victim is running a request
                time.sleep(0.2)
                running = next(r["stats"] for r in replicas(base) if r["replica_id"] == victim)["running"]
            assert running, "the victim replica was never seen running a request"
        finally:
            stop.set()  # no request starts after the kill: the ones in flight then are those it may fail
        named = ray.util.list_named_actors(all_namespaces=True)
        name = next((a for a in named if a["name"].endswith(f"#{victim}")), None)
        assert name is not None, (victim, named)
        t0 = time.monotonic()
        ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
        per_worker = [f.result(timeout=180) for f in inflight]
        pool.shutdown()
        results = [r for answers in per_worker for r in answers]
        statuses = Counter(r.status_code for r in results)
        # Requests on the victim fail fast with 503; none failed before the kill: a failure is only ever
        # the last answer of its worker (its request in flight when the victim died).
        assert set(statuses) <= {200, 503} and statuses[503] >= 1, statuses
        for answers in per_worker:
            assert all(r.status_code == 200 for r in answers[:-1]), [r.status_code for r in answers]
        for r in results:
            if r.status_code == 503:
                assert "replica serving this request failed" in r.json()["error"]["message"]
            else:  # the survivors served theirs, the victim those it finished before the kill
                assert r.headers["x-ditserve-replica"] in owners, r.headers
        assert time.monotonic() - t0 < 60

        gone = httpx.post(f"{url}/{owners[victim]}/generate", json={"prompt": "x"}, timeout=60)
        assert gone.status_code == 410, gone.text
        assert "lost" in gone.json()["error"]["message"]
        for owner, sid in owners.items():
            if owner != victim:
                body = {"prompt": "x", "num_inference_steps": 2}
                ok = httpx.post(f"{url}/{sid}/generate", json=body, timeout=60)
                assert ok.status_code == 200 and ok.headers["x-ditserve-replica"] == owner

        # Serve starts a replacement; it reports the converged state before serving anything.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            now = replicas(base)
            fresh = [r for r in now if r["replica_id"] not in owners]
            if len(now) == 3 and fresh:
                break
            time.sleep(1)
        assert len(fresh) == 1, now
        assert fresh[0]["control_version"] == desired and fresh[0]["stats"]["steps_run"] == 0
        assert fresh[0]["control_state"] == listed[0]["control_state"]  # e.g. the weights loaded above
        # the replacement serves the adapter loaded before the kill (it converged before taking traffic)
        answers = [generate(base, seed=i, lora={"name": "style"}) for i in range(6)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        served = Counter(a.headers["x-ditserve-replica"] for a in answers)
        assert served[fresh[0]["replica_id"]] == 2, served


class TestShardedReplicas:
    @pytest.fixture(scope="class")
    def server(self, ray_cluster):
        proc = ServeProcess(
            "--model", "demo-flux", "--dp-size", "2", "--num-gpus", "4", "--ulysses-degree", "2",
            "--address", ray_cluster.address, "--max-sessions-per-replica", "2",
            "--session-idle-timeout-s", str(IDLE_S), timeout_s=300,
        )  # fmt: skip
        yield proc
        assert proc.stop() == 0, proc.output()

    def test_two_replicas_of_two_ranks_match_one_rank(self, server):
        from ditserve.replica.config import EngineConfig
        from ditserve.replica.engine import Engine
        from ditserve.replica.request import GenerationParams

        listed = replicas(server.base_url)
        assert len(listed) == 2
        for r in listed:
            assert r["layout"]["world_size"] == 2 and r["layout"]["ulysses"] == 2
            assert len(r["ranks"]) == 2 and {x["node_id"] for x in r["ranks"]} == {r["node_id"]}
        engine = Engine(EngineConfig(model="demo-flux", device="cpu")).start()
        try:
            params = GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=2, seed=9)
            reference = png_pixels(engine.generate(params, timeout=120).outputs[0])
        finally:
            engine.shutdown()
        served = Counter()
        for _ in range(4):
            r = generate(server.base_url, seed=9)
            served[r.headers["x-ditserve-replica"]] += 1
            assert psnr(image_of(r), reference) >= 40
        assert len(served) == 2

    def test_session_cap_answers_429_and_idle_sessions_expire(self, server):
        url = f"{server.base_url}/v1/sessions"
        answers = [httpx.post(url, json={}, timeout=60) for _ in range(5)]
        assert [a.status_code for a in answers].count(200) == 4
        assert answers[-1].status_code == 429 and "maximum" in answers[-1].json()["error"]["message"]
        # Once idle past --session-idle-timeout-s, the sessions expire and free their slots: an open
        # succeeds again (polled: how long past the timeout the expiry is seen depends on the machine).
        deadline = time.monotonic() + 120
        reopened = httpx.post(url, json={}, timeout=60)
        while reopened.status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.5)
            reopened = httpx.post(url, json={}, timeout=60)
        assert reopened.status_code == 200, reopened.text
        expired = answers[0].json()["id"]
        r = httpx.post(f"{url}/{expired}/generate", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 404
        for session_id in [a.json()["id"] for a in answers[:4]] + [reopened.json()["id"]]:
            assert httpx.delete(f"{url}/{session_id}", timeout=30).status_code in (200, 404)

    def test_a_session_opens_on_a_replica_with_room(self, server):
        """Two replicas of 2 sessions each, all taken; one closed: the next open gets its slot whichever
        replica round-robin asks first (it asks the full one first for one of two opens in a row)."""
        url = f"{server.base_url}/v1/sessions"
        held: dict[str, list[str]] = {}
        sent: dict[str, float] = {}  # session id -> when its open was sent (its idle clock starts later)
        for _ in range(4):
            t = time.monotonic()
            r = httpx.post(url, json={}, timeout=60)
            assert r.status_code == 200, r.text
            held.setdefault(r.headers["x-ditserve-replica"], []).append(r.json()["id"])
            sent[r.json()["id"]] = t
        assert sorted(len(ids) for ids in held.values()) == [2, 2]
        roomy, full = sorted(held)
        for _ in range(2):
            closed = httpx.delete(f"{url}/{held[roomy].pop()}", timeout=30)
            assert closed.status_code in (200, 404), closed.text  # 404: it expired (idle) meanwhile
            t = time.monotonic()
            r = httpx.post(url, json={}, timeout=60)
            assert r.status_code == 200, r.text
            # The full replica had no room unless one of its sessions sat idle past the timeout before
            # this open was answered (a slow machine); only then may the open land there.
            if time.monotonic() - min(sent[s] for s in held[full]) < IDLE_S:
                assert r.headers["x-ditserve-replica"] == roomy
            held[r.headers["x-ditserve-replica"]].append(r.json()["id"])
            sent[r.json()["id"]] = t
        for ids in held.values():
            for session_id in ids:
                httpx.delete(f"{url}/{session_id}", timeout=30)

    def test_shutdown_stops_every_replica_and_a_replacement_stays_shut_down(self, server):
        base = server.base_url
        done = httpx.post(f"{base}/v1/admin/shutdown", timeout=120)
        assert done.status_code == 200, done.text
        listed = replicas(base)
        assert {r["health"] for r in listed} == {"shutdown"}
        refused = generate(base, seed=3)
        assert refused.status_code == 503 and "shut down" in refused.json()["error"]["message"]

        # Serve replaces a replica that dies; the replacement reads the desired state and stays shut down.
        victim = listed[0]["replica_id"]
        named = ray.util.list_named_actors(all_namespaces=True)
        name = next(a for a in named if a["name"].endswith(f"#{victim}"))
        ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
        deadline = time.monotonic() + 180
        fresh = []
        while time.monotonic() < deadline and not fresh:
            time.sleep(1)
            now = replicas(base)
            fresh = [r for r in now if r["replica_id"] not in {x["replica_id"] for x in listed}]
        assert fresh, now
        assert fresh[0]["health"] == "shutdown" and fresh[0]["control_state"]["shutdown"] is True
        assert fresh[0]["ranks"] == []  # it started no ranks: the model is not loaded only to be stopped
        for seed in range(4):  # round-robin reaches the replacement too
            r = generate(base, seed=seed)
            assert r.status_code == 503 and "shut down" in r.json()["error"]["message"], r.text
