"""Latency the HTTP path (Serve's proxy, the frontend, the session/round-robin router) adds over a direct
handle call, and the balance across replicas (CPU; local Ray).

    python benchmarks/serving/router_overhead.py [--dp-size 3] [--requests 1000] [--rounds 5] [--proxy-grpc]
        [--direct-ingress] [--out DIR]

The engine deployment runs with a trivial engine (``engine_cls`` injection: answers each request at once
with a 1×1 PNG), so what is timed is the serving path alone. Paths, one keep-alive httpx client, one
request at a time, interleaved in ``--rounds`` rounds so a load change on a shared machine hits every
path alike:

- direct: ``handle.generate.remote(params)`` from this driver (Serve router + replica, no HTTP): the
  baseline;
- http: ``POST /v1/images/generations`` through Serve's proxy → Frontend (validation, its own handle and
  router) → replica;
- models: ``GET /v1/models`` (proxy → Frontend, no body, no engine call): the floor of an HTTP request;
- session: ``POST /v1/sessions/{id}/generate`` on sessions opened round-robin (proxy → Frontend → the
  owner replica);
- with ``--direct-ingress`` (``ditserve serve --direct-ingress``): the same three HTTP paths sent to the
  Frontend replica's own port (``--port`` + 1; Serve's proxy stays on ``--port``), without the proxy hop.

Balance = max/min requests per replica (the ``x-ditserve-replica`` header) over the http path, and over a
mixed run where each image is followed by a varying number of ``GET /v1/models``.
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


def balance_of(served: Counter, dp_size: int) -> float:
    return max(served.values()) / min(served.values()) if len(served) == dp_size else float("inf")


PROXY_PATHS = ("direct", "http", "models", "session")
DIRECT_INGRESS_PATHS = ("di_http", "di_models", "di_session")
LABELS = {
    "direct": "direct handle call (baseline)",
    "http": "HTTP image: proxy → frontend → router → replica",
    "models": "HTTP GET /v1/models: proxy → frontend (no engine)",
    "session": "HTTP session step: proxy → frontend → owner replica",
    "di_http": "HTTP image, direct ingress: frontend → router → replica",
    "di_models": "HTTP GET /v1/models, direct ingress: frontend (no engine)",
    "di_session": "HTTP session step, direct ingress: frontend → owner replica",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-size", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per path")
    parser.add_argument("--warmup", type=int, default=100, help="untimed requests per path")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the paths are interleaved in")
    parser.add_argument("--mixed", type=int, default=300, help="images in the mixed-traffic balance run")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument(
        "--proxy-grpc",
        action="store_true",
        help="Serve's proxy talks to replicas over gRPC (RAY_SERVE_PROXY_USE_GRPC=1) instead of Ray actor calls",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="the Frontend replica also takes HTTP itself on --port + 1 (Serve's direct ingress): its paths "
        "are timed beside the proxy's, interleaved in the same rounds",
    )
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ns = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ns.proxy_grpc:  # read by the proxy when it starts (in the cluster ray.init starts below)
        os.environ["RAY_SERVE_PROXY_USE_GRPC"] = "1"
    if ns.direct_ingress:  # read by the controller and the replicas (workers of the cluster ray.init starts)
        from ditserve.cluster.ingress import direct_ingress_env

        os.environ.update(direct_ingress_env(ns.port + 1, 0))
    PATHS = PROXY_PATHS + (DIRECT_INGRESS_PATHS if ns.direct_ingress else ())
    import httpx
    import ray
    from ray import serve

    from ditserve.cluster.app import APP_NAME, build_app_with_engine

    # Always a fresh local cluster: never one that happens to run on this machine already.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": ns.port})
    args = {"model": "demo-flux", "dp_size": ns.dp_size, "max_queue": 64, "max_sessions_per_replica": 64}
    if ns.direct_ingress:  # as `ditserve serve --direct-ingress --port PORT+1`, Serve's proxy still on PORT
        args |= {"direct_ingress": True, "port": ns.port + 1, "grpc_port": 0}
    serve.run(build_app_with_engine(args, engine_cls=TrivialEngine), name=APP_NAME, route_prefix="/")
    handle = serve.get_deployment_handle("DiffusionEngine", APP_NAME)
    params = GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=2, seed=1)
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 1}
    base = f"http://127.0.0.1:{ns.port}"
    di_base = f"http://127.0.0.1:{ns.port + 1}"
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    served, mixed = Counter(), Counter()
    try:
        with httpx.Client(timeout=30) as client:
            # One session per replica (opened round-robin), stepped in turn.
            sessions = [client.post(f"{base}/v1/sessions", json={"size": "64x64"}).json()["id"]
                        for _ in range(ns.dp_size)]  # fmt: skip
            step = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 1}
            turn = iter(range(1 << 62))

            def session_step(url: str) -> httpx.Response:
                sid = sessions[next(turn) % len(sessions)]
                return client.post(f"{url}/v1/sessions/{sid}/generate", json=step)

            calls = {
                "direct": lambda: handle.generate.remote(params).result(),
                "http": lambda: client.post(f"{base}/v1/images/generations", json=body),
                "models": lambda: client.get(f"{base}/v1/models"),
                "session": lambda: session_step(base),
                "di_http": lambda: client.post(f"{di_base}/v1/images/generations", json=body),
                "di_models": lambda: client.get(f"{di_base}/v1/models"),
                "di_session": lambda: session_step(di_base),
            }
            for path in PATHS:
                for _ in range(ns.warmup):
                    calls[path]()
            per_round = max(1, ns.requests // ns.rounds)
            for _ in range(ns.rounds):
                for path in PATHS:
                    for _ in range(per_round):
                        t0 = time.perf_counter()
                        answer = calls[path]()
                        samples[path].append(time.perf_counter() - t0)
                        if isinstance(answer, httpx.Response):
                            answer.raise_for_status()
                            if path in ("http", "di_http"):
                                served[answer.headers["x-ditserve-replica"]] += 1
            # Mixed traffic: each image followed by 0..3 status requests (as a client polling a job).
            mixed_base = di_base if ns.direct_ingress else base
            for i in range(ns.mixed):
                r = client.post(f"{mixed_base}/v1/images/generations", json=body)
                r.raise_for_status()
                mixed[r.headers["x-ditserve-replica"]] += 1
                for _ in range(i % 4):
                    client.get(f"{mixed_base}/v1/models").raise_for_status()
    finally:
        serve.shutdown()
        ray.shutdown()

    stats = {path: percentiles(samples[path]) for path in PATHS}
    d = stats["direct"]
    balance, mixed_balance = balance_of(served, ns.dp_size), balance_of(mixed, ns.dp_size)
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}, commit {commit}"
    )
    rows = [
        "| path | p50 ms | p90 ms | p99 ms | mean ms | p50 / direct p50 | added p50 ms | added p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in PATHS:
        s = stats[path]
        rows.append(
            f"| {LABELS[path]} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} "
            f"| {s['p50'] / d['p50']:.2f}× | {s['p50'] - d['p50']:.2f} | {s['p99'] - d['p99']:.2f} |"
        )
    summary = (
        f"{len(samples['direct'])} timed requests per path in {ns.rounds} interleaved rounds after "
        f"{ns.warmup} warm-up each, dp_size {ns.dp_size}, proxy → replica over "
        f"{'gRPC' if ns.proxy_grpc else 'Ray actor calls'}. Image requests per replica {sorted(served.values())}, "
        f"max/min {balance:.3f}; mixed traffic ({ns.mixed} images, 0–3 GETs after each) "
        f"{sorted(mixed.values())}, max/min {mixed_balance:.3f}. Machine: {machine}"
    )
    table = "\n".join(rows) + "\n\n" + summary
    print(table)
    payload = {
        "paths": stats,
        "ratio_p50": {p: stats[p]["p50"] / d["p50"] for p in PATHS},
        "served": dict(served),
        "balance": balance,
        "mixed_served": dict(mixed),
        "mixed_balance": mixed_balance,
    }
    write_results("router_overhead", table, payload | {"machine": machine}, out=ns.out,
                  baseline="direct handle calls")  # fmt: skip


if __name__ == "__main__":
    main()
