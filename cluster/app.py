"""The Serve application builder: ``ditserve.cluster.app:build_app``.

The same dict of arguments works from ``ditserve serve``, from a ``serve run`` / ``serve deploy`` YAML
(``import_path: ditserve.cluster.app:build_app`` with ``args:``) and from KubeRay's ``serveConfigV2``.
"""

from __future__ import annotations

import uuid
from typing import Any

from ray.serve import Application

from ditserve.replica.engine import default_cache, validate_layout
from ditserve.replica.models.registry import resolve_model

from .config import APP_NAME as APP_NAME  # the CLI, tests and benchmarks import it from here
from .config import SHUTDOWN_WAIT_LOOP_S, AppArgs
from .engine_deployment import EngineReplica
from .frontend import Frontend
from .ingress import FRONTEND_ENV, HEAD_NODE_RESOURCE, check_direct_ingress_env
from .router import ROUTER_PATH


def rank_bundles(args: AppArgs) -> list[dict[str, float]]:
    """One placement-group bundle per rank of one replica; the replica actor shares bundle 0."""
    config = args.engine_config()
    world = config.parallel.world_size
    if config.device == "cuda":
        return [{"GPU": 1, "CPU": 1}] + [{"GPU": 1}] * (world - 1)
    return [{"CPU": args.replica_num_cpus}] * world


def cluster_fit(args: AppArgs, nodes: list[dict[str, float]] | None) -> tuple[str, str | None]:
    """(placement strategy, error): STRICT_PACK when one node can hold a replica's bundles, else PACK;
    an error message when the whole cluster cannot hold ``dp_size`` replicas (a clear failure at start
    instead of replicas that wait forever for resources). ``nodes``: each alive node's total resources."""
    bundles = rank_bundles(args)
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    if nodes is None:
        return "PACK", None
    fits_node = any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes)
    total = {k: sum(node.get(k, 0.0) for node in nodes) for k in need}
    for key, value in need.items():
        wanted = value * args.dp_size
        if total[key] + 1e-9 < wanted:
            unit = "GPUs" if key == "GPU" else f"{key}"
            return "PACK", (
                f"--dp-size {args.dp_size} × {len(bundles)} ranks need {wanted:g} {unit}, "
                f"but the Ray cluster has {total[key]:g}; lower --num-gpus/--dp-size"
                + (" or --replica-num-cpus" if key == "CPU" else "")
                + " or add nodes"
            )
    return ("STRICT_PACK" if fits_node else "PACK"), None


def alive_nodes() -> list[dict[str, float]] | None:
    import ray

    if not ray.is_initialized():
        return None
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def engine_max_ongoing(args: AppArgs) -> int:
    """Requests one engine replica takes at once: headroom above what the engine admits, so a full engine
    queue answers 429 (Retry-After) at once instead of requests waiting unseen in Serve's router; control and
    info calls use the rest."""
    return (
        2
        * (args.max_queue + args.max_batch_size + args.max_sessions_per_replica + args.max_realtime_sessions)
        + 16
    )


def frontend_max_ongoing(args: AppArgs) -> int:
    """Requests the Frontend takes at once: all that the engine replicas take, and room for the info, admin
    and refused ones. A WebSocket (a realtime video or step session) is one request for its whole life:
    under Serve's default (5), five open sockets would keep every other request, HTTP ones too, waiting in
    Serve's queue."""
    return args.dp_size * engine_max_ongoing(args) + 16


def engine_deployment_options(args: AppArgs, strategy: str = "PACK") -> dict[str, Any]:
    """Serve options of the engine deployment: dp_size replicas, one placement group per replica."""
    from ray.serve.config import RequestRouterConfig

    config = args.engine_config()
    world = config.parallel.world_size
    if config.device == "cuda":
        actor = {"num_cpus": 1, "num_gpus": 1 if world == 1 else 0}
    else:
        # World 1: the rank runs in the replica process, which takes the whole bundle.
        actor = {"num_cpus": args.replica_num_cpus if world == 1 else args.replica_num_cpus / 2}
    return {
        "num_replicas": args.dp_size,
        "ray_actor_options": actor,
        "placement_group_bundles": rank_bundles(args),
        "placement_group_strategy": strategy,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_PATH),
        "max_ongoing_requests": engine_max_ongoing(args),
        "health_check_period_s": 2,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 20,
        # A stopping replica checks for requests still running this often; it first waits one period even
        # when idle, and Serve stops the Frontend before the engine replicas, so Serve's 2 s added 4 s to
        # every Ctrl-C, redeploy and scale-down.
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
    }


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (raises ValueError naming the flag) and bind the deployments.

    Serve requires a builder of exactly one parameter; ``build_app_with_engine`` injects an engine."""
    return build_app_with_engine(args, None)


def build_app_with_engine(args: dict[str, Any], engine_cls: type | None) -> Application:
    """``build_app`` with another engine class (benchmarks of the serving path use a trivial one)."""
    app_args = AppArgs(**args)
    if app_args.api_key_for_generation and app_args.api_key is None:
        raise ValueError(
            "--api-key-for-generation: no key is set (--api-key, or DITSERVE_API_KEY where the app is built), "
            "so generation would be open to everyone; set one"
        )
    config = app_args.engine_config()  # auto values resolved, final values validated
    spec = resolve_model(config.model)
    validate_layout(config, spec)  # the layout against the model's heads
    default_cache(config, spec)  # --cache-policy against the model's family
    # A folder saved without a component its pipeline needs: said before any start. The check imports
    # diffusers (about 3 s of a CPU-demo `serve` start); the embedded models are built here with every
    # component (tests/unit/test_registry.py), and each replica checks again before it loads.
    if engine_cls is None and not spec.embedded:
        from ditserve.replica.worker import refuse_missing_components  # imports torch

        refuse_missing_components(spec)
    # Only the strategy: Serve builds as soon as it is asked to (KubeRay: once the head pod is ready, before
    # the GPU workers have joined; an autoscaler adds nodes later), and a build that fails is not retried
    # once nodes join, so too few nodes now is no error here (`ditserve serve` checks that on its own).
    strategy, _ = cluster_fit(app_args, alive_nodes())
    plain = app_args.model_dump(mode="json")
    # One id per build: Serve builds on a first deploy and on a redeploy of changed arguments, and restarts
    # replicas with the arguments bound here, so the desired control state is scoped to this deploy.
    deploy_id = uuid.uuid4().hex[:12]
    extra = {} if engine_cls is None else {"engine_cls": engine_cls}
    engine = (
        serve_deployment(EngineReplica)
        .options(**engine_deployment_options(app_args, strategy))
        .bind(plain, deploy_id=deploy_id, **extra)
    )
    frontend = Frontend.options(max_ongoing_requests=frontend_max_ongoing(app_args))
    if app_args.direct_ingress:
        check_direct_ingress_env(app_args.port, app_args.grpc_port)
        # The API's port is where the proxy listened: on the head node (the port range is per node). No CPU
        # asked, as Serve's proxy there: a KubeRay head starts with num-cpus 0 so that no engine lands on it.
        frontend = frontend.options(
            ray_actor_options={
                "num_cpus": 0,
                "resources": {HEAD_NODE_RESOURCE: 0.001},
                "runtime_env": {"env_vars": FRONTEND_ENV},  # read by Serve when the replica starts
            }
        )
    return frontend.bind(engine, plain, deploy_id)


def serve_deployment(cls):
    from ray import serve

    return serve.deployment(name="DiffusionEngine")(cls)
