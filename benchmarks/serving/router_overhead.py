"""Latency the HTTP frontend + session/round-robin router add over a direct handle call, and the balance
across replicas (CPU; local Ray).

    python benchmarks/serving/router_overhead.py [--dp-size 3] [--requests 1000] [--out DIR]

The engine deployment runs with a trivial engine (``engine_cls`` injection: answers each request at once
with a 1×1 PNG), so what is timed is the serving path alone:

- direct: ``handle.generate.remote(params)`` from this driver (Serve router + replica, no HTTP);
- http: ``POST /v1/images/generations`` through Serve's proxy → Frontend (validation, its own handle and
  router) → replica, with one keep-alive httpx client, one request at a time.

Added latency = http − direct at each percentile. Balance = max/min requests per replica over the HTTP
run (from the ``x-ditserve-replica`` header).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from report import write_results  # noqa: E402

from ditserve.replica.media import encode_png
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.request import GenerationParams, GenerationResult


class TrivialEngine:
    """The Engine interface EngineReplica uses, answering at once: no ranks, no model."""

    def __init__(self, config, launcher=None):
        import numpy as np

        self.config = config
        self.spec = resolve_model(config.model)
        self.world_size = 1
        self.running = False
        self.png = encode_png(np.zeros((1, 1, 3), dtype="uint8"))
        self.step_listeners: list = []

    def start(self) -> TrivialEngine:
        self.running = True
        return self

    def shutdown(self) -> None:
        self.running = False

    def submit(self, params: GenerationParams, on_progress=None) -> Future:
        fut: Future = Future()
        fut.set_result(
            GenerationResult(
                outputs=[self.png], media_type="image/png", seed=params.seed, width=params.width,
                height=params.height,
            )
        )  # fmt: skip
        return fut

    def run_control(self, fn) -> Future:
        fut: Future = Future()
        fut.set_result(fn())
        return fut

    def call_ranks(self, method: str, *args: Any) -> Any:
        return None

    def abort_all(self, exc: BaseException, drop: bool = False) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"queue_depth": 0, "running": 0, "last_batch_size": 0, "steps_run": 0}


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": statistics.median(ms), "p90": q[89], "p99": q[98], "mean": statistics.fmean(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-size", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ns = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import httpx
    import ray
    from ray import serve

    from ditserve.cluster.app import APP_NAME, build_app_with_engine

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": ns.port})
    args = {"model": "demo-flux", "dp_size": ns.dp_size, "max_queue": 64}
    serve.run(build_app_with_engine(args, engine_cls=TrivialEngine), name=APP_NAME, route_prefix="/")
    handle = serve.get_deployment_handle("DiffusionEngine", APP_NAME)
    params = GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=2, seed=1)
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 1}
    try:
        for _ in range(ns.warmup):
            handle.generate.remote(params).result()
        direct = []
        for _ in range(ns.requests):
            t0 = time.perf_counter()
            handle.generate.remote(params).result()
            direct.append(time.perf_counter() - t0)

        url = f"http://127.0.0.1:{ns.port}/v1/images/generations"
        with httpx.Client(timeout=30) as client:
            for _ in range(ns.warmup):
                client.post(url, json=body).raise_for_status()
            http, served = [], Counter()
            for _ in range(ns.requests):
                t0 = time.perf_counter()
                r = client.post(url, json=body)
                http.append(time.perf_counter() - t0)
                r.raise_for_status()
                served[r.headers["x-ditserve-replica"]] += 1
    finally:
        serve.shutdown()
        ray.shutdown()

    d, h = percentiles(direct), percentiles(http)
    added = {k: h[k] - d[k] for k in ("p50", "p90", "p99")}
    balance = max(served.values()) / min(served.values()) if len(served) == ns.dp_size else float("inf")
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}, commit {commit}"
    )
    rows = [
        "| path | p50 ms | p90 ms | p99 ms | mean ms |",
        "|---|---|---|---|---|",
        f"| direct handle call | {d['p50']:.2f} | {d['p90']:.2f} | {d['p99']:.2f} | {d['mean']:.2f} |",
        f"| HTTP → frontend → router → replica | {h['p50']:.2f} | {h['p90']:.2f} | {h['p99']:.2f} "
        f"| {h['mean']:.2f} |",
        f"| **added by frontend + router** | **{added['p50']:.2f}** | {added['p90']:.2f} "
        f"| **{added['p99']:.2f}** | |",
    ]
    summary = (
        f"{ns.requests} sequential requests per path after {ns.warmup} warm-up, dp_size {ns.dp_size}; "
        f"requests per replica {sorted(served.values())}, max/min {balance:.3f}; machine: {machine}"
    )
    table = "\n".join(rows) + "\n\n" + summary
    print(table)
    payload = {"direct": d, "http": h, "added": added, "served": dict(served), "balance": balance}
    write_results("router_overhead", table, payload | {"machine": machine}, out=ns.out,
                  baseline="direct handle calls")  # fmt: skip


if __name__ == "__main__":
    main()
