"""A bounded soak of the whole cluster on CPU: mixed traffic for ``--minutes``, one replica killed midway.

    python benchmarks/serving/soak.py --minutes 10 --out DIR

A local Ray cluster of 3 simulated hosts (``ray.cluster_utils.Cluster``, a custom resource per host), then
two phases on it, each a real ``ditserve serve --address`` (working directory: the repository root):

1. images (70 % of the time): ``demo-flux``, ``--dp-size 3``; loops of plain images (some with an
   adapter), SSE streams (read to ``[DONE]``), image sessions (open, refine three times, close), and the
   adapter loaded and unloaded through the admin API; one replica process killed with SIGKILL at the
   phase's midpoint.
2. videos (30 %): ``demo-wan``, ``--dp-size 2``; video jobs created, polled and downloaded; one replica
   killed midway.

Every request goes to 127.0.0.1, each loop stops at its deadline and after ``--max-requests``. An answer
counts as expected when it is 200, or a retryable error in the API's JSON shape (429/503 with
Retry-After, 410 for a session whose replica died, a video that ``failed`` with a reason): anything else,
a client timeout (a hang) or a connection error (a lost request) is counted against the run. Memory: the
RSS of every Ray and server process after warm-up and at the end of each phase (processes alive at both),
growth in %. Writes DIR/soak_cpu_<yyyymm>_<sha>.md and .json.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import write_results  # noqa: E402

KEY = "soak-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
CLIENT_TIMEOUT_S = 120.0


class Tally:
    """Outcomes per kind of request, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.unexpected: list[str] = []

    def add(self, kind: str, outcome: str, seconds: float, expected: bool, detail: str = "") -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1
            self.latency[kind].append(seconds)
            if not expected:
                self.unexpected.append(f"{kind}: {outcome} {detail[:200]}")


def expected_error(r: httpx.Response) -> bool:
    """A retryable error a client can act on: the JSON error shape, and Retry-After where it is a 429/503."""
    try:
        error = r.json()["error"]
    except Exception:
        return False
    if r.status_code in (429, 503):
        return bool(error.get("message")) and "retry-after" in r.headers
    return r.status_code == 410 and bool(error.get("message"))


def timed(tally: Tally, kind: str, call) -> httpx.Response | None:
    t0 = time.monotonic()
    try:
        r = call()
    except httpx.TimeoutException as exc:
        tally.add(kind, "hang", time.monotonic() - t0, False, repr(exc))
        return None
    except httpx.HTTPError as exc:
        tally.add(kind, "lost", time.monotonic() - t0, False, repr(exc))
        return None
    ok = r.status_code == 200 or expected_error(r)
    tally.add(kind, str(r.status_code), time.monotonic() - t0, ok, r.text)
    return r


def serve(*args: str, port: int) -> subprocess.Popen:
    log = open(Path(tempfile.gettempdir()) / f"soak-serve-{port}.log", "w")
    cmd = [str(Path(sys.executable).with_name("ditserve")), "serve", "--port", str(port), "--grpc-port", "0"]
    proc = subprocess.Popen(
        [*cmd, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if "ditserve: serving" in Path(log.name).read_text(errors="replace"):
            return proc
        if proc.poll() is not None:
            raise RuntimeError(Path(log.name).read_text(errors="replace")[-3000:])
        time.sleep(0.5)
    raise TimeoutError("ditserve serve did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/v1/replicas", headers=ADMIN, timeout=60).json()["data"]


def wait_replicas(base: str, n: int, timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rs = replicas(base)
        if len(rs) == n and all(r["health"] == "ok" for r in rs):
            return rs
        time.sleep(1)
    raise TimeoutError(f"{n} healthy replicas not within {timeout_s}s")


def rss_by_pid() -> dict[int, tuple[str, int]]:
    """RSS of Ray's and the servers' processes (by command line)."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        line = " ".join(p.info["cmdline"] or [])
        if any(k in line for k in ("ray::", "raylet", "gcs_server", "ditserve serve", "dashboard")):
            found[p.info["pid"]] = (line[:60], p.info["memory_info"].rss)
    return found


def growth(before: dict, after: dict) -> list[dict]:
    rows = []
    for pid, (name, rss0) in before.items():
        if pid in after and rss0 > 0:
            rows.append({"pid": pid, "process": name, "mib_warm": rss0 / 2**20, "mib_end": after[pid][1] / 2**20,
                         "growth_pct": 100 * (after[pid][1] - rss0) / rss0})  # fmt: skip
    return sorted(rows, key=lambda r: -r["growth_pct"])


def loop(deadline: float, max_requests: int, body) -> None:
    for _ in range(max_requests):
        if time.monotonic() >= deadline:
            return
        body()


def image_phase(base: str, seconds: float, args, tally: Tally, adapter: Path) -> dict:
    rng = random.Random(0)
    client = httpx.Client(timeout=CLIENT_TIMEOUT_S)
    wait_replicas(base, 3)
    small = {"prompt": "a red circle on a blue background", "size": "64x64", "num_inference_steps": 3}
    loaded = threading.Event()
    deadline = time.monotonic() + seconds

    def image():
        extra = {"lora": [{"name": "soak"}]} if loaded.is_set() and rng.random() < 0.3 else {}
        timed(tally, "image", lambda: client.post(f"{base}/v1/images/generations",
                                                   json={**small, "seed": rng.randrange(1000), **extra}))  # fmt: skip

    def stream():
        r = timed(
            tally, "sse", lambda: client.post(f"{base}/v1/images/generations", json={**small, "stream": True})
        )
        if r is not None and r.status_code == 200 and not r.text.rstrip().endswith("data: [DONE]"):
            tally.add("sse", "truncated", 0.0, False, r.text[-200:])

    def session():
        opened = timed(tally, "session", lambda: client.post(f"{base}/v1/sessions", json={"size": "64x64"}))
        if opened is None or opened.status_code != 200:
            return
        sid = opened.json()["id"]
        for prompt in ("a red circle", "a red circle on green", "a blue square on green"):
            r = timed(tally, "session", lambda p=prompt: client.post(
                f"{base}/v1/sessions/{sid}/generate", json={"prompt": p, "num_inference_steps": 3}))  # fmt: skip
            if r is None or r.status_code != 200:
                return
        timed(tally, "session", lambda: client.delete(f"{base}/v1/sessions/{sid}"))

    def lora():
        if loaded.is_set():
            timed(tally, "lora", lambda: client.delete(f"{base}/v1/loras/soak", headers=ADMIN))
            loaded.clear()
        else:
            r = timed(tally, "lora", lambda: client.post(
                f"{base}/v1/loras", headers=ADMIN, json={"name": "soak", "path": str(adapter)}))  # fmt: skip
            if r is not None and r.status_code == 200:
                loaded.set()
        time.sleep(10)  # an operator's pace, not a race

    return drive("images", base, [image, image, stream, session, lora], deadline, warm_s=min(60, seconds / 4),
                 replicas_n=3, args=args)  # fmt: skip


def video_phase(base: str, seconds: float, args, tally: Tally) -> dict:
    client = httpx.Client(timeout=CLIENT_TIMEOUT_S)
    wait_replicas(base, 2)
    deadline = time.monotonic() + seconds

    def job():
        body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 3}
        created = timed(tally, "video", lambda: client.post(f"{base}/v1/videos", json=body))
        if created is not None and created.status_code == 429:  # a client that honours Retry-After
            time.sleep(
                min(float(created.headers.get("retry-after", 1)), max(0.0, deadline - time.monotonic()))
            )
        if created is None or created.status_code != 200:
            return
        vid = created.json()["id"]
        while time.monotonic() < deadline + 60:
            r = timed(tally, "video_poll", lambda: client.get(f"{base}/v1/videos/{vid}"))
            if r is None or r.status_code != 200:
                return
            status = r.json()["status"]
            if status == "failed":  # expected only with a reason (its replica died)
                ok = bool((r.json().get("error") or {}).get("message"))
                tally.add("video", "failed_with_reason" if ok else "failed_silently", 0.0, ok, r.text)
                return
            if status == "completed":
                timed(tally, "video_content", lambda: client.get(f"{base}/v1/videos/{vid}/content"))
                return
            time.sleep(0.2)
        tally.add("video", "never_finished", 0.0, False, vid)

    return drive("videos", base, [job] * 3, deadline, warm_s=min(30, seconds / 4), replicas_n=2, args=args)


def drive(
    phase: str, base: str, bodies: list, deadline: float, *, warm_s: float, replicas_n: int, args
) -> dict:
    """Each body in a bounded loop of its own until ``deadline``; every process's memory after ``warm_s`` and
    at the end; one replica process killed at the midpoint; then the replacement awaited."""
    start = time.monotonic()
    loops = [threading.Thread(target=loop, args=(deadline, args.max_requests, body)) for body in bodies]
    for t in loops:
        t.start()
    time.sleep(max(0.0, start + warm_s - time.monotonic()))
    warm = rss_by_pid()
    time.sleep(max(0.0, (start + deadline) / 2 - time.monotonic()))
    victim = replicas(base)[0]
    os.kill(victim["ranks"][0]["pid"], signal.SIGKILL)
    killed = {"phase": phase, "replica": victim["replica_id"], "at_s": round(time.monotonic() - start)}
    for t in loops:
        t.join()
    end = rss_by_pid()
    wait_replicas(base, replicas_n)
    return {"killed": killed, "memory": growth(warm, end)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-requests", type=int, default=2000, help="per loop")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("DITSERVE_HOME", tempfile.mkdtemp(prefix="ditserve-soak-"))
    import ray
    import torch
    from diffusers import FluxTransformer2DModel
    from ray.cluster_utils import Cluster
    from safetensors.torch import save_file

    from ditserve.replica.models.registry import resolve_model

    # An adapter for demo-flux: rank 4 on the first double block's q/k/v.
    transformer = FluxTransformer2DModel.from_pretrained(
        resolve_model("demo-flux").path, subfolder="transformer"
    )
    tensors = {}
    for name in ("to_q", "to_k", "to_v"):
        linear = getattr(transformer.transformer_blocks[0].attn, name)
        tensors[f"transformer.transformer_blocks.0.attn.{name}.lora_A.weight"] = torch.randn(
            4, linear.in_features
        )
        tensors[f"transformer.transformer_blocks.0.attn.{name}.lora_B.weight"] = torch.randn(
            linear.out_features, 4
        )
    adapter = Path(os.environ["DITSERVE_HOME"]) / "soak.safetensors"
    save_file(tensors, str(adapter))

    temp_dir = tempfile.mkdtemp(prefix="rsk", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"host0": 1},
                                                            "temp_dir": temp_dir})  # fmt: skip
    for i in (1, 2):
        cluster.add_node(num_cpus=1, resources={f"host{i}": 1}, temp_dir=temp_dir)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    tally, phases = Tally(), []
    total = args.minutes * 60
    port = 28731
    base = f"http://127.0.0.1:{port}"
    common = ["--address", cluster.address, "--api-key", KEY, "--max-queue", "16"]
    runs = [
        ("images", ["--model", "demo-flux", "--dp-size", "3"], lambda: image_phase(base, 0.7 * total, args, tally, adapter)),
        ("videos", ["--model", "demo-wan", "--dp-size", "2", "--max-width", "64", "--max-height", "64"],
         lambda: video_phase(base, 0.3 * total, args, tally)),
    ]  # fmt: skip
    try:
        for name, flags, phase in runs:
            proc = serve(*flags, *common, port=port)
            try:
                phases.append(phase())
            except Exception as exc:  # the report says what broke, with what was counted until then
                phases.append({"killed": {"phase": name, "replica": "-", "at_s": "-"}, "memory": [],
                               "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
            finally:
                stop(proc)
    finally:
        ray.shutdown()
        cluster.shutdown()
    write_report(args.out, args, tally, phases)


def write_report(out: str | None, args, tally: Tally, phases: list[dict]) -> None:
    lines = [f"{args.minutes:g} minutes of mixed traffic on 3 simulated hosts (CPU, {os.cpu_count()} cores), "
             "one replica killed per phase.", "", "| requests | answers | p50 s | p95 s |", "|---|---|---|---|"]  # fmt: skip
    for kind, outcomes in sorted(tally.outcomes.items()):
        lat = sorted(tally.latency[kind])
        p95 = lat[min(len(lat) - 1, int(0.95 * (len(lat) - 1)))]
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
        lines.append(f"| {kind} | {answers} | {statistics.median(lat):.2f} | {p95:.2f} |")
    lines += ["", f"Unexpected answers, hangs or lost requests: {len(tally.unexpected)}"]
    lines += [f"- {u}" for u in tally.unexpected[:20]]
    for phase in phases:
        worst = phase["memory"][:5]
        lines += ["", f"Phase {phase['killed']['phase']}: replica {phase['killed']['replica']} killed at "
                  f"{phase['killed']['at_s']} s. Memory of {len(phase['memory'])} processes alive after warm-up "
                  f"and at the end; largest growth:", "", "| process | MiB after warm-up | MiB at end | growth |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['process']} | {r['mib_warm']:.0f} | {r['mib_end']:.0f} | {r['growth_pct']:+.1f} % |"
                  for r in worst]  # fmt: skip
        if "error" in phase:
            lines += ["", f"The phase failed: {phase['error']}"]
    data = {"outcomes": {k: dict(v) for k, v in tally.outcomes.items()}, "unexpected": tally.unexpected,
            "phases": phases}  # fmt: skip
    write_results("soak", "\n".join(lines), data, out=out, baseline="each process's memory after warm-up")


if __name__ == "__main__":
    main()
