"""Direct ingress: the Frontend replica takes HTTP (and gRPC) on the API's ports itself.

Default path: client → Serve's proxy actor → Frontend replica → engine replica (two actor hops). With
Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``) an ingress replica runs its own HTTP and gRPC
servers and the proxy hop is gone; the Frontend and everything it answers (the 503 with Retry-After for a
replica that died mid-request, the 503 of a control op no replica answered) stay as they are.

What Serve 2.60 does in that mode, and what this module sets because of it:

- Serve reads the flag from the environment of the controller and of the replicas, i.e. of the Ray nodes
  (the raylet's environment, which its workers inherit): it is not an application option. ``ditserve
  serve`` sets it before it starts its local cluster; a joined cluster (``--address``, KubeRay) must have
  been started with :func:`direct_ingress_env`'s variables.
- Each ingress replica takes a port from a per-node range (default HTTP 30000-31000, gRPC 40000-41000). The
  range is narrowed to exactly ``--port`` / ``--grpc-port``, so the API answers where it always did, and the
  Frontend is pinned to the head node, where the proxy listened (one Frontend, one port on one node).
- The controller still starts a proxy on the head node, on ``http_options.port``; it is moved to spare
  ports (:func:`proxy_ports`) so it does not hold the API's.
- A released port is held out of the range for minutes (for HAProxy, not run here), and a stopping ingress
  replica keeps serving 30 s (for an external load balancer to drop it, none here): both would keep a
  restarted Frontend off its only port, or hold up a shutdown, so both are set short.
"""

from __future__ import annotations

import os
import random
import socket

FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


def direct_ingress_env(port: int, grpc_port: int) -> dict[str, str]:
    """The environment the Ray nodes need for the Frontend to listen on ``port`` / ``grpc_port`` itself."""
    env = {
        FLAG: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # the range is [min, max)
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }
    if grpc_port:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"] = str(grpc_port)
        env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] = str(grpc_port + 1)
    return env


def check_direct_ingress_env(port: int, grpc_port: int) -> None:
    """Raise ValueError naming the variables when this process's environment (that of the Ray nodes, where
    Serve builds the app) would not make the Frontend listen on ``port`` / ``grpc_port``."""
    wanted = direct_ingress_env(port, grpc_port)
    # The flag and the ports are required; the quarantine and draining times only make restarts quicker.
    wrong = [k for k, v in wanted.items() if (k == FLAG or k.endswith("_PORT")) and os.environ.get(k) != v]
    if wrong:
        assignments = " ".join(f"{k}={v}" for k, v in wanted.items())
        raise ValueError(
            f"--direct-ingress: Serve reads it from the Ray nodes' environment, and {', '.join(sorted(wrong))} "
            f"{'is' if len(wrong) == 1 else 'are'} not set as the API's ports need; start the Ray nodes "
            f"(ray start, or the KubeRay pod's env) and this command with {assignments}"
        )


def spare_port(host: str) -> int:
    """A port free on ``host`` now, from a range Ray's workers and the kernel's ephemeral ports leave alone."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port on {host} between 20000 and 30000")


def proxy_ports(host: str, grpc_port: int) -> tuple[int, int]:
    """(HTTP, gRPC) ports for the proxy Serve starts on the head node even with direct ingress; gRPC 0 when
    the API has none."""
    return spare_port(host), (spare_port("0.0.0.0") if grpc_port else 0)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource (amount 1)

# The Frontend replica's own environment under direct ingress. Serve runs a replica's user code on an event
# loop of its own thread and a handle's router on a third, so each request crossed threads four times (HTTP
# server → routes → router → routes → HTTP server), each a wake-up and a GIL hand-off. One loop for all
# three is measurably quicker (router_overhead, BENCHMARKS.md). It is safe because no route blocks its loop:
# the routes await their engine calls, and the control-state handle is looked up once (Frontend).
FRONTEND_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
