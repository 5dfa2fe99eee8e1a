"""``ditserve deploy``: KubeRay RayService manifests and Serve config YAML from the same flags as ``serve``.

The application flags are :class:`AppArgs` fields, validated by AppArgs itself, so a manifest can only hold
arguments ``build_app`` accepts. Only the flags given (and different from the default) go into ``args:``.
The deploy-only flags (:class:`DeployArgs`) shape the Kubernetes side: image, pod sizes, GPU nodes.

Pod layout: one head pod (no GPUs; runs the HTTP/gRPC proxy, ``proxy_location: HeadOnly``) and one worker
group whose replicas are the engine replicas. A replica's GPUs sit in one pod when they fit a node
(``--gpus-per-node``); otherwise the replica spans ``world / gpus_per_node`` pods (``numOfHosts``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ditserve.replica.families import families

from .config import APP_NAME, AppArgs, add_model_arguments, model_kwargs
from .ingress import direct_ingress_env
from .usage import fail as _fail
from .usage import validation_message as _validation_message

IMPORT_PATH = "ditserve.cluster.app:build_app"
RAY_VERSION = "2.60.0"
HTTP_PORT = 8000
METRICS_PORT = 8080
MODELS_MOUNT = "/models"
# The gRPC servicers Serve's gRPC proxy registers (the API of cluster/grpc_service.py, and the standard
# grpc.health.v1 health service it answers too).
GRPC_SERVICER_FUNCTIONS: list[str] = [
    "ditserve.cluster.grpc_gen.ditserve_pb2_grpc.add_DitServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
# AppArgs fields that are process- or Serve-level, not builder arguments (or secrets: never in a manifest).
NOT_BUILDER_ARGS = ("host", "port", "grpc_port", "address", "api_key")
# Ports the head pod already uses (GCS, dashboard, client, metrics): Serve's proxy is never moved onto one.
HEAD_PORTS = {
    6379: "Ray's GCS",
    8265: "the Ray dashboard",
    10001: "the Ray client server",
    METRICS_PORT: "metrics",
}


def _kind_heads() -> dict[str, int]:
    """Attention heads by model family, for models that exist only inside the image (layout checks)."""
    return {name: family.typical_heads for name, family in families().items()}


def _known_folders() -> list[tuple[re.Pattern, str, int]]:
    """Public checkpoint folder names → (family, heads), from the family declarations."""
    return [
        (re.compile(pattern, re.IGNORECASE), name, heads)
        for name, family in families().items()
        for pattern, heads in family.checkpoints
    ]


ModelKind = Literal[("auto", *sorted(families()))]  # type: ignore[valid-type]
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 47  # KubeRay appends suffixes (-raycluster-xxxxx-head-svc) to the RayService name


def _package_version() -> str:
    try:
        return version("ditserve")
    except PackageNotFoundError:
        return "0.1.0"


class DeployArgs(BaseModel):
    """Kubernetes-side flags of ``ditserve deploy kuberay``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="ditserve", description="RayService name (DNS-1035, at most 47 characters).")
    namespace: str | None = Field(default=None, description="Namespace written into the manifest.")
    image: str = Field(
        default=f"ditserve:{_package_version()}",
        description="Container image (built from deploy/Dockerfile).",
    )
    model_kind: ModelKind = Field(
        default="auto",
        description="Model family when --model is a folder that exists only in the image (auto: embedded "
        "names and folders on this machine are read; other paths by their name, as the families' public "
        "checkpoints are called: FLUX.1-dev, Qwen-Image, Wan2.2-TI2V-5B, ...).",
    )
    num_attention_heads: int | None = Field(
        default=None, ge=1, description="Heads of the model for layout checks (default: by --model-kind)."
    )
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs of one Kubernetes GPU node.")
    cpus_per_gpu: int = Field(default=8, ge=1, description="CPUs per GPU in a GPU worker pod.")
    memory_per_gpu_gib: int = Field(default=64, ge=1, description="Memory (GiB) per GPU in a GPU worker pod.")
    cpu_worker_cpus: int = Field(default=2, ge=1, description="CPUs per worker pod on CPU (--device cpu).")
    cpu_worker_memory_gib: int = Field(default=4, ge=1, description="Memory (GiB) per worker pod on CPU.")
    head_cpus: int = Field(default=4, ge=1, description="CPUs of the head pod (proxy, controller).")
    head_memory_gib: int = Field(default=16, ge=1, description="Memory (GiB) of the head pod.")
    models_pvc: str | None = Field(
        default=None, description=f"PersistentVolumeClaim with model folders, mounted at {MODELS_MOUNT}."
    )
    api_key_secret: str = Field(
        default="ditserve-api-key",
        description="Secret whose key 'api-key' becomes DITSERVE_API_KEY (optional: absent → no admin key; "
        "required with --api-key-for-generation).",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if len(name) > MAX_NAME:
            raise ValueError(
                f"{name!r} is {len(name)} characters; KubeRay needs at most {MAX_NAME} (it appends suffixes)"
            )
        if not DNS_1035.match(name):
            raise ValueError(
                f"{name!r} is not a DNS-1035 label: lower-case letters, digits and '-', starting with a "
                "letter and ending with a letter or digit"
            )
        return name

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, namespace: str | None) -> str | None:
        if namespace is not None and (len(namespace) > 63 or not DNS_1123_LABEL.match(namespace)):
            raise ValueError(
                f"{namespace!r} is not a namespace name (DNS-1123 label): at most 63 lower-case letters, "
                "digits and '-', starting and ending with a letter or digit"
            )
        return namespace

    @field_validator("models_pvc", "api_key_secret")
    @classmethod
    def _check_object_name(cls, name: str | None) -> str | None:
        # The names of the claim and the Secret the pods refer to; the API server refuses the pods otherwise.
        parts = (name or "").split(".")
        if name is not None and (len(name) > 253 or not all(DNS_1123_LABEL.match(part) for part in parts)):
            raise ValueError(
                f"{name!r} is not a Kubernetes object name (DNS-1123 subdomain): lower-case letters, digits, "
                "'-' and '.', starting and ending with a letter or digit"
            )
        return name


class Plan(BaseModel):
    """What a manifest is made of: the validated app args and the derived pod layout."""

    model_config = ConfigDict(frozen=True)

    app: AppArgs
    deploy: DeployArgs
    builder_args: dict[str, Any]
    device: Literal["cpu", "cuda"]
    world_size: int
    gpus_per_pod: int
    pods_per_replica: int
    notes: tuple[str, ...] = ()  # said to the operator on stderr; the manifest is still written


def folder_kind(model: str) -> tuple[str, int] | None:
    """(family, attention heads) of a public checkpoint folder, read from its name; None if unknown."""
    name = Path(model).name
    for pattern, family, heads in _known_folders():
        if pattern.search(name):
            return family, heads
    return None


def _local_model(app: AppArgs, deploy: DeployArgs):
    """The model's ModelSpec when it is on this machine (an embedded model or a folder here), else None."""
    from ditserve.replica.models.registry import embedded_model_names, resolve_model

    if app.model not in embedded_model_names() and not Path(app.model).expanduser().exists():
        return None
    spec = resolve_model(app.model)
    if deploy.model_kind not in ("auto", spec.family):
        raise ValueError(f"--model-kind {deploy.model_kind}: {app.model!r} is a {spec.family} model")
    return spec


def _num_heads(app: AppArgs, deploy: DeployArgs) -> tuple[int | None, str | None]:
    """(heads of the model or None, a note for the operator), for a model not on this machine: a folder
    inside the image, whose family comes from --model-kind, else from its name; when neither tells, the heads
    are checked on the cluster at start."""
    if deploy.num_attention_heads is not None:
        return deploy.num_attention_heads, None
    if deploy.model_kind != "auto":
        return _kind_heads()[deploy.model_kind], None
    if (known := folder_kind(app.model)) is not None:
        return known[1], None
    return None, (
        f"--model {app.model} is not on this machine, taken as a folder inside the image; its family is not "
        f"known from its name, so the layout's heads are checked on the cluster at start (pass --model-kind "
        f"{{{', '.join(_kind_heads())}}} or --num-attention-heads to check them here)"
    )


def _check_lora_paths(app: AppArgs) -> None:
    """A relative ``--lora-path`` file without ``--lora-root`` has no meaning on the cluster (``ditserve
    serve`` makes it absolute from the working directory; the replicas' working directory is Ray's)."""
    from ditserve.replica.lora.loader import parse_lora_spec

    for spec in app.lora_path:
        name, path, _ = parse_lora_spec(spec, flag="--lora-path")
        if not app.lora_root and not Path(path).is_absolute():
            raise ValueError(
                f"--lora-path {name}={path}: a relative path is read on the cluster, where no working "
                "directory of yours applies; give the path inside the pods (/models/...), or --lora-root DIR "
                "to read it under DIR"
            )


def plan(app_kwargs: dict[str, Any], deploy_kwargs: dict[str, Any]) -> Plan:
    """Validate both flag sets and derive the layout; raises ValidationError / ValueError naming the flag."""
    app = AppArgs(**app_kwargs)
    deploy = DeployArgs(**deploy_kwargs)
    _check_lora_paths(app)
    # The pods have GPUs unless --device cpu: auto values resolve for them, not for this machine.
    config = app.engine_config(device="cuda")
    spec = _local_model(app, deploy) if deploy.num_attention_heads is None else None
    if spec is not None:  # on this machine: the whole layout check serve runs (heads, TP's feature dims, ...)
        from ditserve.replica.engine import validate_layout

        world, note = validate_layout(config, spec), None
    else:
        heads, note = _num_heads(app, deploy)
        world = config.parallel.dims(num_heads=heads).world_size
    device = config.device
    if device == "cuda" and world > deploy.gpus_per_node:
        if world % deploy.gpus_per_node:
            raise ValueError(
                f"a replica has {world} GPUs, more than --gpus-per-node {deploy.gpus_per_node} and not a "
                f"multiple of it; use a layout whose GPUs per replica is ≤ {deploy.gpus_per_node} or a "
                f"multiple of it"
            )
        gpus_per_pod, pods = deploy.gpus_per_node, world // deploy.gpus_per_node
    else:
        gpus_per_pod, pods = (world if device == "cuda" else 0), 1
    dumped = app.model_dump(mode="json")
    defaults = AppArgs.model_fields
    builder_args = {
        k: dumped[k]
        for k in AppArgs.model_fields  # field order, whatever the order of the flags
        if k in app_kwargs
        and k not in NOT_BUILDER_ARGS
        and dumped[k] != _json_default(defaults[k].get_default(call_default_factory=True))
    }
    # The builder may run on a pod without GPUs (the head): the device is written, not left to a probe there.
    builder_args = {"model": app.model, "device": device, **builder_args}
    if app.direct_ingress:  # the builder checks the nodes' variables against the ports the Frontend takes
        builder_args |= {"port": app.port, "grpc_port": app.grpc_port}
    return Plan(
        app=app,
        deploy=deploy,
        builder_args=builder_args,
        device=device,
        world_size=world,
        gpus_per_pod=gpus_per_pod,
        pods_per_replica=pods,
        notes=() if note is None else (note,),
    )


def _json_default(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# -- documents ------------------------------------------------------------------------------------------
def proxy_ports(app: AppArgs) -> tuple[int, int]:
    """(HTTP, gRPC) ports of Serve's proxy on the head node. With --direct-ingress the Frontend replica
    listens on --port / --grpc-port there itself, and the proxy Serve still starts moves to the next ports
    above them that no head process uses (below them for the top ports)."""
    if not app.direct_ingress:
        return app.port, app.grpc_port
    taken = {*HEAD_PORTS, app.port, app.grpc_port}

    def spare(above: int) -> int:
        order = [*range(above + 1, 65536), *range(above - 1, 1023, -1)]
        port = next(port for port in order if port not in taken)
        taken.add(port)
        return port

    http = spare(app.port)
    return http, (spare(app.grpc_port) if app.grpc_port else 0)


def serve_config(p: Plan) -> dict[str, Any]:
    """The Serve config (``serve run`` / ``serve deploy`` / ``serveConfigV2``)."""
    http_port, grpc_port = proxy_ports(p.app)
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": dict(p.builder_args),
            }
        ],
    }


def _container(p: Plan, name: str, resources: dict[str, Any], ports: list[dict[str, Any]]) -> dict[str, Any]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if p.deploy.models_pvc:
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    env = [
        {
            "name": "DITSERVE_API_KEY",
            "valueFrom": {
                # Required when generation needs the key too: without it the pods do not start (the
                # builder would refuse the app), and `kubectl describe pod` names the Secret.
                "secretKeyRef": {
                    "name": p.deploy.api_key_secret,
                    "key": "api-key",
                    "optional": not p.app.api_key_for_generation,
                }
            },
        }
    ]
    if p.app.direct_ingress:  # Serve reads direct ingress from every node: the controller and the replicas
        env += [{"name": k, "value": v} for k, v in direct_ingress_env(p.app.port, p.app.grpc_port).items()]
    return {
        "name": name,
        "image": p.deploy.image,
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "resources": {"limits": resources, "requests": resources},
        "ports": ports,
        "volumeMounts": mounts,
    }


def _volumes(p: Plan) -> list[dict[str, Any]]:
    # NCCL and torch.multiprocessing share tensors through /dev/shm; the container default is 64 MiB.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if p.deploy.models_pvc:
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": p.deploy.models_pvc, "readOnly": True}}
        )
    return volumes


def _worker_group(p: Plan) -> dict[str, Any]:
    d = p.deploy
    metrics = [{"name": "metrics", "containerPort": METRICS_PORT}]
    if p.device == "cuda":
        g = p.gpus_per_pod
        resources = {
            "cpu": str(d.cpus_per_gpu * g),
            "memory": f"{d.memory_per_gpu_gib * g}Gi",
            "nvidia.com/gpu": str(g),
        }
        group_name = f"gpu-{p.world_size}x"
        spec_extra: dict[str, Any] = {
            # Placeholders: match the taints and labels of your GPU node pool.
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    else:
        resources = {"cpu": str(d.cpu_worker_cpus), "memory": f"{d.cpu_worker_memory_gib}Gi"}
        group_name = "cpu"
        spec_extra = {}
    replicas = p.app.dp_size
    group: dict[str, Any] = {
        "groupName": group_name,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": {
            "spec": {
                "containers": [_container(p, "ray-worker", resources, metrics)],
                "volumes": _volumes(p),
                **spec_extra,
            }
        },
    }
    if p.pods_per_replica > 1:
        group["numOfHosts"] = p.pods_per_replica
    return group


def check_head_ports(app: AppArgs) -> None:
    """The API's ports are taken on the head pod, beside Ray's own there: ValueError naming the flag."""
    for flag, port in (("--port", app.port), ("--grpc-port", app.grpc_port)):
        if port in HEAD_PORTS:
            raise ValueError(
                f"{flag} {port} is taken on the head pod by {HEAD_PORTS[port]}; choose another {flag} (the "
                f"head pod uses {', '.join(map(str, HEAD_PORTS))})"
            )


def rayservice(p: Plan) -> dict[str, Any]:
    """The RayService manifest (ray.io/v1)."""
    check_head_ports(p.app)
    d = p.deploy
    head_ports = [
        {"name": "gcs-server", "containerPort": 6379},
        {"name": "dashboard", "containerPort": 8265},
        {"name": "client", "containerPort": 10001},
        {"name": "serve", "containerPort": p.app.port},
        *([{"name": "grpc", "containerPort": p.app.grpc_port}] if p.app.grpc_port else []),  # 0: gRPC off
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    head_resources = {"cpu": str(d.head_cpus), "memory": f"{d.head_memory_gib}Gi"}
    metadata: dict[str, Any] = {"name": d.name, "labels": {"app.kubernetes.io/name": "ditserve"}}
    if d.namespace:
        metadata["namespace"] = d.namespace
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata,
        "spec": {
            "serveConfigV2": dump_yaml(serve_config(p)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {
                    # num-cpus 0: no replicas on the head, it only runs the controller and the proxy.
                    "rayStartParams": {
                        "num-cpus": "0",
                        "dashboard-host": "0.0.0.0",
                        "metrics-export-port": str(METRICS_PORT),
                    },
                    "template": {
                        "spec": {
                            "containers": [_container(p, "ray-head", head_resources, head_ports)],
                            "volumes": _volumes(p),
                        }
                    },
                },
                "workerGroupSpecs": [_worker_group(p)],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: manifests are read by people
        return True


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump_yaml(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


def header(argv: list[str]) -> str:
    text = f"# Generated by: ditserve deploy {shlex.join(argv)}\n# Edit the command, not this file.\n"
    if argv[0] == "serve-config":  # without --address, serve run joins the last cluster `ray start` recorded
        text += "# Run: serve run --address local FILE (a new local Ray), or serve deploy FILE --address http://HEAD:8265\n"
    return text


# -- checked-in examples --------------------------------------------------------------------------------
_CPU_DEMO = ["--name", "ditserve-cpu-demo", "--model", "demo-flux", "--device", "cpu", "--dp-size", "2"]
_CPU_DEMO += ["--num-gpus", "4", "--ulysses-degree", "2", "--max-width", "512", "--max-height", "512"]
_FLUX = ["--name", "ditserve-flux", "--model", f"{MODELS_MOUNT}/FLUX.1-dev"]
_FLUX += ["--models-pvc", "ditserve-models", "--dp-size", "2", "--num-gpus", "8", "--ulysses-degree", "4"]
_WAN = [
    "--name",
    "ditserve-wan",
    "--model",
    f"{MODELS_MOUNT}/Wan2.1-T2V-14B-Diffusers",
]
_WAN += ["--models-pvc", "ditserve-models", "--dp-size", "2", "--num-gpus", "16", "--cfg-parallel-size", "2"]
_WAN += ["--ulysses-degree", "4"]
EXAMPLES: dict[str, list[str]] = {
    "cpu-demo/serve-config.yaml": ["serve-config", *_CPU_DEMO],
    "cpu-demo/rayservice.yaml": ["kuberay", *_CPU_DEMO],
    "flux/serve-config.yaml": ["serve-config", *_FLUX],
    "flux/rayservice.yaml": ["kuberay", *_FLUX],
    "wan/serve-config.yaml": ["serve-config", *_WAN],
    "wan/rayservice.yaml": ["kuberay", *_WAN],
}


def render(argv: list[str]) -> str:
    """The text ``ditserve deploy <argv>`` prints (raises ValidationError / ValueError on bad flags)."""
    return _render(build_deploy_parser().parse_args(argv))[0]


def _command_of(ns: argparse.Namespace) -> list[str]:
    """The flags given, in field order: the header records them so a file says how to remake it."""
    argv = [ns.deploy_command]
    given = vars(ns)
    for name in [*AppArgs.model_fields, *DeployArgs.model_fields]:
        if name not in given:
            continue
        flag, value = "--" + name.replace("_", "-"), given[name]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def _render(ns: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """(the document, notes for the operator)."""
    p = plan(model_kwargs(ns, AppArgs), model_kwargs(ns, DeployArgs))
    doc = rayservice(p) if ns.deploy_command == "kuberay" else serve_config(p)
    notes = p.notes
    if p.app.direct_ingress and ns.deploy_command != "kuberay":  # the manifest sets them on its pods
        assignments = " ".join(f"{k}={v}" for k, v in direct_ingress_env(p.app.port, p.app.grpc_port).items())
        notes += (f"--direct-ingress: start every Ray node (ray start) with {assignments}",)
    return header(_command_of(ns)) + dump_yaml(doc), notes


def write_examples(out_dir: Path, check: bool = False) -> list[str]:
    """Write (or with ``check`` compare) every example; returns the paths that differ."""
    stale = []
    for rel, argv in EXAMPLES.items():
        text, path = render(argv), out_dir / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return stale


# -- argparse -------------------------------------------------------------------------------------------
DEPLOY_HELP = """\
Print a KubeRay RayService manifest or a Serve config from the flags of `ditserve serve`.

--model is read where the application runs. An embedded model or a folder on this machine is read here
too; any other path is taken as a folder inside the image (or on --models-pvc, mounted at /models) and
is not needed here: its family comes from --model-kind, else from its name as each family's public
checkpoints are called (FLUX.1-dev, FLUX.2-klein-4B, Qwen-Image, stable-diffusion-3.5-large, Z-Image-Turbo,
Wan2.2-TI2V-5B-Diffusers, HunyuanVideo-1.5-..., ...), and the layout is checked against that family's
attention heads. When neither tells, the manifest is written anyway and the heads are checked on the
cluster at start (a note on stderr says so).

Auto values (--device, --dtype, --cuda-graphs, --fused-epilogues) are resolved for GPU pods unless
--device cpu, and the resolved configuration is validated as `ditserve serve` would on those pods.
The Serve config starts its own proxies (host 0.0.0.0): run it with `serve run --address local
CONFIG` for a new local Ray, or `serve deploy CONFIG --address http://HEAD:8265` on a running cluster.
"""


def _add_generators(sub) -> None:
    helps = {
        "kuberay": "Print a KubeRay RayService manifest.",
        "serve-config": "Print a Serve config YAML (serve run / serve deploy).",
    }
    for name, text in helps.items():
        # The flags are serve's, but --model and the auto values mean what DEPLOY_HELP says: a deploy runs elsewhere.
        p = sub.add_parser(
            name,
            help=text,
            description=f"{text}\n\n{DEPLOY_HELP.split(chr(10), 2)[2]}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_model_arguments(p, AppArgs, skip=("host", "address", "api_key"))
        add_model_arguments(p, DeployArgs)
        p.add_argument("-o", "--output", default=None, help="Write to this file instead of stdout.")
    p = sub.add_parser("examples", help="Regenerate the examples in deploy/ (or check them with --check).")
    p.add_argument("--output-dir", default="deploy", help="Folder of the examples (default: deploy).")
    p.add_argument("--check", action="store_true", help="Only report stale files; exit 1 if any.")


def add_deploy_parser(subparsers) -> None:
    """Add ``deploy`` with its ``kuberay`` / ``serve-config`` / ``examples`` subcommands."""
    p = subparsers.add_parser(
        "deploy",
        help="Print KubeRay manifests and Serve configs.",
        description=DEPLOY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_generators(p.add_subparsers(dest="deploy_command", required=True))


def build_deploy_parser() -> argparse.ArgumentParser:
    """A parser of ``ditserve deploy``'s own arguments (``render`` and tests)."""
    parser = argparse.ArgumentParser(
        prog="ditserve deploy", description=DEPLOY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_generators(parser.add_subparsers(dest="deploy_command", required=True))
    return parser


def run_deploy(ns: argparse.Namespace) -> int:
    if ns.deploy_command == "examples":
        stale = write_examples(Path(ns.output_dir), check=ns.check)
        verb = "stale" if ns.check else "wrote"
        for rel in stale:
            print(f"{verb} {Path(ns.output_dir) / rel}")
        return 1 if (ns.check and stale) else 0
    try:
        text, notes = _render(ns)
    except ValidationError as exc:
        return _fail(_validation_message(exc))
    except ValueError as exc:
        return _fail(str(exc))
    for note in notes:
        print(f"ditserve: note: {note}", file=sys.stderr)
    if ns.output:
        Path(ns.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
