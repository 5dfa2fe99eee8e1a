"""The checked-in CPU demo Serve config under `serve run`, and the replica metrics on Ray's metrics port.

One local Ray (started here, with a metrics export port) for the module; the application is deployed
by Ray's own `serve run deploy/cpu-demo/serve-config.yaml` (ports moved to free ones), exactly as an
operator would, and served images are fetched over HTTP. Then the Prometheus endpoint is scraped.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray.serve import status as serve_status

from ditserve.cluster.metrics import EXPORTED, HISTOGRAMS
from tests.helpers import free_port, png_pixels

ROOT = Path(__file__).resolve().parents[2]
CPU_DEMO = ROOT / "deploy" / "cpu-demo" / "serve-config.yaml"
METRICS = [name + "_count" if name in HISTOGRAMS else name for name in EXPORTED]


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port()
    # address="local": a private cluster even when another local one is running (no RAY_ADDRESS pickup)
    # Metrics reach the export port every second (Ray's default, 10 s, is most of the scrape test's time).
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    yield port
    ray.shutdown()


@pytest.fixture(scope="module")
def served(metrics_port, tmp_path_factory):
    """`serve run` of the CPU demo config against the module's Ray; yields the HTTP base URL."""
    config = yaml.safe_load(CPU_DEMO.read_text())
    http_port = free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = free_port()
    path = tmp_path_factory.mktemp("serve") / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = path.with_suffix(".log")
    address = ray.get_runtime_context().gcs_address
    serve = Path(sys.executable).with_name("serve")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(serve), "run", "--address", address, str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ.copy(),
            # Ctrl-C must reach it: a test run started in the background by a shell without job control
            # (`pytest &` in a script, CI) ignores SIGINT, and that is inherited; `serve run` never sets a
            # handler of its own, so it would ignore the SIGINT below and be killed after the timeout.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    base_url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"serve run did not come up:\n{log.read_text()}"
            app = serve_status().applications.get("ditserve")
            assert app is None or app.status != "DEPLOY_FAILED", app.message
            if app is not None and app.status == "RUNNING":  # every replica is up
                break
            time.sleep(1)
        yield base_url
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # serve run shuts the app down on Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"serve run did not stop within 60 s of Ctrl-C:\n{log.read_text()[-4000:]}")


def test_serve_run_of_the_cpu_demo_config_serves_an_image(served):
    body = {"model": "demo-flux", "prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 3}
    r = httpx.post(f"{served}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert png_pixels(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (64, 64, 3)
    # the config's layout is what runs: 2 replicas of 2 ranks (ulysses 2)
    replicas = httpx.get(f"{served}/v1/replicas", timeout=60).json()["data"]
    assert len(replicas) == 2
    assert all(r["layout"]["world_size"] == 2 and r["layout"]["ulysses"] == 2 for r in replicas)


def _samples(text: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_ditserve_\w+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m:
            found.setdefault(m.group(1), []).append(float(m.group(3)))
    return found


def test_every_replica_metric_is_exported(served, metrics_port):
    for seed in range(4):  # requests and steps on both replicas (round-robin)
        body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2, "seed": seed}
        if seed % 2:  # step-cache counters too (one forecast forward each)
            body["cache"] = {"policy": "taylorseer", "warmup": 1, "interval": 2}
        assert httpx.post(f"{served}/v1/images/generations", json=body, timeout=120).status_code == 200
    session = httpx.post(f"{served}/v1/sessions", json={"size": "64x64"}, timeout=60)
    assert session.status_code == 200, session.text
    deadline, samples = time.monotonic() + 90, {}
    while time.monotonic() < deadline:  # Ray exports metrics every second (metrics_port)
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        samples = _samples(text)
        # each replica flushes on its own schedule: wait until every replica's counts have arrived
        if (
            all(name in samples for name in METRICS)
            and sum(samples["ray_ditserve_active_sessions"]) >= 1
            and sum(samples["ray_ditserve_requests_total"]) >= 4
            and sum(samples["ray_ditserve_step_latency_seconds_count"]) >= 8
        ):
            break
        time.sleep(0.5)
    missing = [name for name in METRICS if name not in samples]
    assert not missing, f"not exported: {missing}; found {sorted(samples)}"
    assert sum(samples["ray_ditserve_requests_total"]) >= 4
    assert sum(samples["ray_ditserve_steps_total"]) >= 8
    assert sum(samples["ray_ditserve_step_latency_seconds_count"]) >= 8
    assert sum(samples["ray_ditserve_active_sessions"]) == 1
    assert min(samples["ray_ditserve_device_memory_bytes"]) > 0
    assert set(samples["ray_ditserve_lora_slots"]) == {8.0}
