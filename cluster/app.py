"""The Serve application builder: ``ditserve.cluster.app:build_app``.

The same dict of arguments works from ``ditserve serve``, from a ``serve run`` / ``serve deploy`` YAML
(``import_path: ditserve.cluster.app:build_app`` with ``args:``) and from KubeRay's ``serveConfigV2``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from ditserve.replica.engine import validate_layout
from ditserve.replica.models.registry import resolve_model

from .config import AppArgs
from .engine_deployment import EngineReplica
from .frontend import Frontend

APP_NAME = "ditserve"


def engine_deployment_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of the engine deployment: dp_size replicas, resources for one replica's ranks."""
    config = args.engine_config()
    world = config.parallel.world_size
    if config.device == "cuda":
        actor = {"num_cpus": 1, "num_gpus": world}
    else:
        actor = {"num_cpus": args.replica_num_cpus * world}
    return {
        "num_replicas": args.dp_size,
        "ray_actor_options": actor,
        "max_ongoing_requests": args.max_queue + args.max_batch_size,
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 20,
    }


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (raises ValueError naming the flag) and bind the deployments."""
    app_args = AppArgs(**args)
    config = app_args.engine_config()
    validate_layout(config, resolve_model(config.model))
    plain = app_args.model_dump(mode="json")
    engine = serve_deployment(EngineReplica).options(**engine_deployment_options(app_args)).bind(plain)
    return Frontend.bind(engine, plain)


def serve_deployment(cls):
    from ray import serve

    return serve.deployment(name="DiffusionEngine")(cls)
