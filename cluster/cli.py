"""``ditserve`` command line: serve, generate, train-demo, deploy."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from pydantic import ValidationError

from .config import AppArgs, EngineArgs, add_model_arguments, model_kwargs
from .deploy import GRPC_SERVICER_FUNCTIONS, run_deploy
from .deploy import add_deploy_parser as _add_deploy
from .ingress import direct_ingress_env, proxy_ports
from .usage import fail as _fail
from .usage import validation_message as _validation_message


# -- generate -------------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="Generate images or videos locally (no Ray).")
    p.add_argument(
        "prompt",
        nargs="+",
        help="What to draw; several prompts run as one batch, prompt k with seed --seed + k "
        "(files get a suffix).",
    )
    p.add_argument(
        "-o",
        "--output",
        default="out.png",
        help="Output file: .png, .jpg or .webp (image) or .mp4 (video; without --model, the default video model "
        "demo-scenes-video).",
    )
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help="Width in pixels (default: 64 on the demo models, else the family pipeline's own default, e.g. "
        "1024 for the image families and 832x480 for Wan; image-to-video as its pipeline sizes the first frame).",
    )
    p.add_argument("--height", type=int, default=None, help="Height in pixels (default: as for --width).")
    p.add_argument("--num-inference-steps", type=int, default=20)
    p.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="The pipeline's guidance_scale: distilled guidance (FLUX.1, FLUX.2 dev), else CFG "
        "(SD3, Z-Image, FLUX.2 Klein, Wan, HunyuanVideo 1.5); default: the pipeline's.",
    )
    p.add_argument(
        "--guidance-scale-2",
        type=float,
        default=None,
        help="Wan 2.2 A14B: the low-noise expert's CFG (default: --guidance-scale).",
    )
    p.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help="True CFG with --negative-prompt (FLUX.1, Qwen-Image).",
    )
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="Number of outputs (files get a suffix).")
    p.add_argument("--num-frames", type=int, default=None, help="Video frames (video models; default 9).")
    p.add_argument(
        "--fps",
        type=int,
        default=None,
        help="Video frame rate (default: the model's, 16 for Wan 2.1 / 2.2 A14B, 24 for Wan 2.2 TI2V-5B and "
        "HunyuanVideo 1.5).",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        help="Adapter NAME[@TARGET]=PATH[:SCALE] (repeatable); @transformer_2 loads the file into Wan 2.2 A14B's "
        "second (low-noise) expert, as diffusers' load_into_transformer_2=True.",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="Input image file (PNG/JPEG/WebP; repeatable): an edit model's reference, else image-to-image "
        "from it (size: what the model's diffusers pipeline draws from it without height and width, unless "
        "--width/--height).",
    )
    p.add_argument(
        "--strength", type=float, default=None, help="Image-to-image: 1 = from noise, small = keep (0.6)."
    )
    p.add_argument(
        "--mask",
        default=None,
        help="Inpainting mask for the --image start image, of its shape: transparent pixels are repainted "
        "(or, without transparency, white ones).",
    )
    add_model_arguments(p, EngineArgs, skip=("dp_size",))  # one engine in this process: no replicas


GENERATE_FIELDS = {  # request fields that are generate's flags of the same name
    "negative_prompt",
    "num_inference_steps",
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "seed",
    "n",
    "num_frames",
    "fps",
    "strength",
}

# The engine's messages name request fields (as the API's do); generate says the flag that was typed.
FIELD_FLAGS = {
    "size": "--width/--height",
    "input_reference": "--image",
    "image": "--image",
    "images": "--image",
    "lora": "--lora",
    "mask": "--mask",
}


def _as_flags(message: str) -> str:
    """``num_frames: must be 4·k + 1`` → ``--num-frames: must be 4·k + 1``; other messages unchanged."""
    field, sep, rest = message.partition(": ")
    if not sep or not field.isidentifier():
        return message
    flag = FIELD_FLAGS.get(field)
    if flag is None and field in GENERATE_FIELDS:
        flag = "--" + field.replace("_", "-")
    return f"{flag}: {rest}" if flag else message


def _read_images(paths: list[str], engine, flag: str = "--image") -> tuple[bytes, ...]:
    """--image (or --mask) files, each checked as the API checks uploads (ValueError naming the flag)."""
    from ditserve.replica.media import check_image

    images = []
    limits = engine.config.limits
    for path in paths:
        try:
            data = Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
        try:
            check_image(data, "image", max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels)
        except ValueError as exc:
            raise ValueError(f"{flag} {path}: {str(exc).removeprefix('image: ')}") from None
        images.append(data)
    return tuple(images)


# -o's suffix → the image format written (the API's output_format values)
IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def _output_paths(output: str, n: int, prompts: int = 1) -> list[Path]:
    """Files for ``n`` outputs of each of ``prompts`` prompts: OUT, OUT-<i>, OUT-<k> or OUT-<k>-<i>."""
    path = Path(output)
    if prompts == 1:
        names = [""] if n == 1 else [f"-{i}" for i in range(n)]
    else:
        names = [f"-{k}" if n == 1 else f"-{k}-{i}" for k in range(prompts) for i in range(n)]
    return [path.with_name(f"{path.stem}{name}{path.suffix}") for name in names]


def _check_local_gpus(config) -> None:
    """Generate runs its ranks on this machine: each needs a GPU here (ValueError naming the flags)."""
    if config.device != "cuda":
        return
    import torch

    ranks, gpus = config.parallel.dims().world_size, torch.cuda.device_count()
    if not torch.cuda.is_available() or ranks > gpus:
        raise ValueError(
            f"--device cuda: {ranks} rank(s) need {ranks} GPU(s), torch sees {gpus} here; "
            "use --device cpu (or auto), or lower --num-gpus and the degrees"
        )


def run_generate(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ditserve.replica.engine import Engine
    from ditserve.replica.lora.loader import inspect_adapter, parse_lora_spec
    from ditserve.replica.request import GenerationParams, LoRARef

    if "model" not in vars(ns) and Path(ns.output).suffix.lower() == ".mp4":
        from ditserve.replica.models.registry import video_model_hint

        ns.model = video_model_hint()  # no --model and a video file asked for: the default video model
    try:
        config = EngineArgs(**model_kwargs(ns, EngineArgs)).engine_config()
        _check_local_gpus(config)
        for name, path, _ in [parse_lora_spec(spec) for spec in ns.lora]:  # before the model loads
            if not config.lora_roots:
                path = str(Path(path).expanduser().absolute())
            try:
                inspect_adapter(path, config.lora_roots, config.max_lora_rank)
            except ValueError as exc:
                raise ValueError(f"--lora {name}: {str(exc).removeprefix('path: ')}") from None
        engine = Engine(config)
    except ValidationError as exc:
        return _fail(_validation_message(exc))
    except ValueError as exc:
        return _fail(str(exc))
    video = engine.spec.kind == "video"
    suffix = Path(ns.output).suffix.lower()
    image_format = IMAGE_SUFFIXES.get(suffix)
    if (suffix != ".mp4") if video else (image_format is None):
        kinds = "videos (.mp4)" if video else "images (.png, .jpg, .webp)"
        return _fail(f"-o {ns.output}: {engine.spec.name} makes {kinds}")
    if not video:  # a video's settings would be dropped: the image made as without them
        for flag, value in (("--num-frames", ns.num_frames), ("--fps", ns.fps)):
            if value is not None:
                return _fail(f"{flag}: {engine.spec.name} makes images; {flag} is a video model's")
    negative, true_cfg = engine.spec.guidance_defaults(ns.negative_prompt, ns.true_cfg_scale)
    from ditserve.replica.media import image_size

    try:
        images = _read_images(ns.image, engine)
        mask = None if ns.mask is None else _read_images([ns.mask], engine, "--mask")[0]
    except ValueError as exc:
        return _fail(str(exc))
    if mask is not None and not images:
        return _fail("--mask: inpainting needs the start image it masks (--image FILE)")
    if mask is not None:
        from .api_edits import mask_shape_refusal

        if (refused := mask_shape_refusal(image_size(mask), image_size(images[0]))) is not None:
            return _fail(f"--mask {ns.mask}: {refused}")
    # the model's own default size (the pipeline's; by the first frame where it sizes image-to-video so),
    # scaled down to --max-width/--max-height
    limits = config.limits
    first_frame = image_size(images[0]) if images and video else None
    size = engine.spec.fitted_size(limits.max_width, limits.max_height, first_frame)
    width = size[0] if ns.width is None else ns.width
    height = size[1] if ns.height is None else ns.height
    # a side the user did not give is the pipeline's default, under the bound with a small target size or VAE
    # (sized from the images below where both are left out of an image edit)
    defaulted = [side for side, given in zip(size, (ns.width, ns.height), strict=True) if given is None]
    from_images = images and not video and len(defaulted) == 2
    least = GenerationParams.model_fields["width"].metadata[0].ge
    if defaulted and not from_images and min(defaulted) < least:
        return _fail(
            f"{engine.spec.name}'s own default size {size[0]}x{size[1]} (its pipeline's) is under {least} "
            "pixels on a side; give --width and --height"
        )
    if images and not video and ns.width is None and ns.height is None:  # from the images, as the API
        from ditserve.replica.families import fit_size

        multiple = engine.spec.size_multiple
        # the edit, img2img or inpaint pipeline's own choice from the images (ModelSpec.edit_request_size)
        first = engine.spec.edit_request_size([image_size(data) for data in images], mask is not None)
        # scaled down to --max-width/--max-height as the API scales it
        first = fit_size(first, limits.max_width, limits.max_height, 1)
        width, height = first[0] // multiple * multiple, first[1] // multiple * multiple
        least = max(multiple, GenerationParams.model_fields["width"].metadata[0].ge)  # as the API's MIN_SIDE
        if min(width, height) < least:  # the image's own sides, not the pipeline's choice from them
            shown = ", ".join(f"{w}x{h}" for w, h in (image_size(data) for data in images))
            return _fail(
                f"--image: the image ({shown}) fitted within {limits.max_width}x{limits.max_height} is under "
                f"{least} pixels on a side; give --width and --height"
            )
    if ns.strength is not None and video:  # it would be dropped: a video's --image is its first frame, kept
        return _fail(
            f"--strength: {engine.spec.name} makes videos; strength is image-to-image's (an image-to-video "
            "model starts from --image as its first frame)"
        )
    if ns.strength is not None and not images:  # it would be dropped: no start image to keep
        return _fail("--strength: image-to-image needs the start image (--image FILE)")
    if ns.strength is not None and engine.spec.edits and mask is None:  # it would be dropped: references
        return _fail(
            f"--strength: {engine.spec.name} takes --image as a reference and does not noise it"
            + (" (with --mask it inpaints, and takes --strength)" if engine.spec.inpaints else "")
        )
    extra = {} if ns.strength is None else {"strength": ns.strength}
    takes_strength = not engine.spec.edits or (mask is not None and engine.spec.inpaints)
    if images and not video and ns.strength is None and takes_strength:
        from .schemas import DEFAULT_STRENGTH

        # the img2img pipelines' default, or the (edit) family's inpaint pipeline's with a mask
        extra["strength"] = engine.spec.default_strength(mask is not None, DEFAULT_STRENGTH)
    try:
        params = GenerationParams(
            prompt=ns.prompt[0],
            negative_prompt=negative,
            width=width,
            height=height,
            num_frames=(9 if ns.num_frames is None else ns.num_frames) if video else 1,
            num_inference_steps=ns.num_inference_steps,
            guidance_scale=ns.guidance_scale,
            guidance_scale_2=ns.guidance_scale_2,
            true_cfg_scale=true_cfg,
            seed=ns.seed,
            n=ns.n,
            fps=engine.spec.fps if ns.fps is None else ns.fps,
            images=images,
            mask=mask,
            **extra,
        )
        jobs = [params.model_copy(update={"prompt": p, "seed": ns.seed + k}) for k, p in enumerate(ns.prompt)]
        for job in jobs:
            engine.check(job)
    except ValidationError as exc:
        return _fail(_validation_message(exc))
    except ValueError as exc:
        return _fail(_as_flags(str(exc)))
    try:
        adapters = [parse_lora_spec(spec, with_target=True) for spec in ns.lora]
    except ValueError as exc:
        return _fail(str(exc))
    from ditserve.replica.lora.loader import second_expert_refusal

    for name, _, _, target in adapters:  # before the model loads
        if target == "transformer_2" and not engine.spec.two_experts:
            return _fail(f"--lora {name}: {second_expert_refusal(engine.spec.name)}")
    # A path typed here is relative to where it is typed (with --lora-root: to the roots, as served).
    roots = engine.config.lora_roots
    adapters = [
        (n, path if roots else str(Path(path).expanduser().absolute()), s, t) for n, path, s, t in adapters
    ]
    try:
        engine.start()
    except ValueError as exc:  # what the ranks found loading the folder
        return _fail(str(exc))
    try:
        for name, path, _, target in adapters:
            try:
                engine.load_lora(name, path, target=target)
            except ValueError as exc:  # the loader names the API's field, path (or target)
                raise ValueError(f"--lora {name}: {str(exc).removeprefix('path: ')}") from None
        if adapters:
            refs = tuple(LoRARef(name=name, scale=scale) for name, _, scale, _ in adapters)
            jobs = [job.model_copy(update={"lora": refs}) for job in jobs]
        steps = [0] * len(jobs)
        with tqdm(total=params.num_inference_steps * len(jobs), desc="denoising", unit="step") as bar:

            def progress(k: int, done: int) -> None:
                steps[k] = done
                bar.update(sum(steps) - bar.n)

            futures = [
                engine.submit(job, on_progress=lambda done, total, k=k: progress(k, done))
                for k, job in enumerate(jobs)
            ]
            results = [future.result() for future in futures]
    except ValueError as exc:
        return _fail(_as_flags(str(exc)))
    finally:
        engine.shutdown()
    outputs = [(data, result) for result in results for data in result.outputs]
    for path, (data, result) in zip(_output_paths(ns.output, params.n, len(jobs)), outputs, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not video and image_format != "png":
            from .api_edits import encode_output

            data = encode_output(data, image_format, None)  # quality 100, as the API's default
        path.write_bytes(data)
        print(f"wrote {path} ({result.width}x{result.height}, seed {result.seed})")
    return 0


# -- serve ----------------------------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="Start (or join) a Ray cluster and serve the HTTP/gRPC API.")
    add_model_arguments(p, AppArgs)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` is taken or forbidden now, or None. The proxies bind later, inside Ray, where a
    taken port surfaces as a long Ray traceback; checking first gives the user one line naming the flag.
    Other failures (no IPv6 here, a host name that does not resolve) are left to the proxies."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((host, port))
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            return exc.strerror or str(exc)
    return None


def host_unusable(host: str) -> str | None:
    """Why this machine cannot listen on ``host`` at all (a name that does not resolve, an address that is
    not this machine's), or None. Serve's proxy fails on it after Ray has started, with a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((host, 0))
    except socket.gaierror as exc:
        return f"the name does not resolve: {exc.strerror}"
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            return "not an address of this machine"
        if exc.errno == errno.EAFNOSUPPORT:
            return exc.strerror or str(exc)
    return None


def gcs_unreachable(address: str) -> str | None:
    """Why ``--address HOST:PORT`` cannot be reached now (refused, no such host, no answer in 5 s), or None;
    Ray itself retries for a minute or more before it says so. Other forms (auto, ray://) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in address:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except socket.gaierror as exc:
        return f"the name does not resolve: {exc.strerror}"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def _drop_reconnect_notice(record: logging.LogRecord) -> bool:
    return "will not be applied" not in record.getMessage()


# Seconds between two reads of the deploy's status (Serve tells no event); one read costs the controller ~20 ms.
DEPLOY_POLL_S = 0.2


def _deploy(app, app_name: str, stop: threading.Event) -> str | None:
    """Deploy ``app`` and return once it serves (None), at Ctrl-C (None, ``stop`` set), or at the first
    replica that refused to start with a ValueError (its message): such a refusal (an adapter file of
    --lora-path the model cannot load) is the same on every try, and Serve tries each replica 3 times, a
    model load each, before it gives up. RuntimeError when the deploy failed otherwise (as ``serve.run``)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    serve._run(app, name=app_name, route_prefix="/", _blocking=False)  # serve.run, without its wait
    while not stop.is_set():
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return None
        if (reason := _replica_error(app_name, status)) is not None:
            return reason
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"Deploying application {app_name} failed: {status.message}")
        stop.wait(DEPLOY_POLL_S)
    return None


def _replica_error(app_name: str, app=None) -> str | None:
    """The ``ValueError`` a replica of ``app_name`` failed to start with (a model folder it cannot load), from
    Serve's deployment status (``app``: that application's, when already read); None when it failed
    otherwise."""
    from ray import serve

    if app is None:
        app = serve.status().applications.get(app_name)
    for deployment in app.deployments.values() if app else ():
        found = [line for line in deployment.message.splitlines() if line.startswith("ValueError: ")]
        if found:
            return found[-1].removeprefix("ValueError: ")
    return None


def _serve_http_address(host: str, port: int) -> tuple[str, int]:
    """Where Serve's HTTP proxies listen: the controller's options (a cluster joined with --address may have
    started Serve with its own before us; serve.start then keeps those)."""
    try:
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        return config.host, int(config.port)
    except Exception:  # no client API in this Ray version: what we asked for
        return host, port


def _absolute_lora_paths(specs: list[str] | None, roots: list[str] | None) -> list[str] | None:
    """``--lora-path NAME[@TARGET]=PATH[:SCALE]`` typed at the prompt: a relative PATH is the user's, from the
    working directory (replicas on other hosts never see it); with --lora-root it is read under the roots."""
    if not specs or roots:
        return specs
    from ditserve.replica.lora.loader import format_lora_spec, parse_lora_spec

    out = []
    for spec in specs:
        name, path, scale, target = parse_lora_spec(spec, flag="--lora-path", with_target=True)
        out.append(format_lora_spec(name, str(Path(path).expanduser().absolute()), scale, target))
    return out


def _check_lora_paths(specs: tuple[str, ...], roots: tuple[str, ...], max_rank: int) -> None:
    """What can be checked of the ``--lora-path`` files before anything starts (that they exist, are
    adapters, their rank), as the API checks a runtime load; ValueError naming the entry. Their contents
    against the model are checked by the replicas, which refuse to start on a file they cannot load."""
    from ditserve.replica.lora.loader import inspect_adapter, parse_lora_spec

    for spec in specs:
        name, path, _ = parse_lora_spec(spec, flag="--lora-path")
        try:
            inspect_adapter(path, roots, max_rank)
        except ValueError as exc:
            raise ValueError(f"--lora-path {name}={path}: {str(exc).removeprefix('path: ')}") from None


def run_serve(ns: argparse.Namespace) -> int:
    try:
        if getattr(ns, "lora_path", None):
            ns.lora_path = _absolute_lora_paths(ns.lora_path, getattr(ns, "lora_root", None))
        args = AppArgs(**model_kwargs(ns, AppArgs))
        _check_lora_paths(args.lora_path, args.lora_root, args.max_lora_rank)
        from .app import APP_NAME, alive_nodes, build_app, cluster_fit

        if args.direct_ingress and not args.address:
            os.environ.update(direct_ingress_env(args.port, args.grpc_port))  # what build_app checks
        build_app(args.model_dump(mode="json"))  # validate the layout before starting anything
    except ValidationError as exc:
        return _fail(_validation_message(exc))
    except ValueError as exc:
        return _fail(str(exc))

    if args.address and (why := gcs_unreachable(args.address)) is not None:
        return _fail(
            f"--address {args.address}: no Ray cluster answers there ({why}); give its head's GCS "
            "address (HOST:6379, as `ray start --head` prints it)"
        )
    # The proxies of a fresh local cluster listen on --host here (a joined cluster's head may be elsewhere).
    if not args.address and (why := host_unusable(args.host)) is not None:
        return _fail(
            f"--host {args.host}: cannot listen there ({why}); use an address of this machine, e.g. "
            "127.0.0.1 or 0.0.0.0"
        )
    # A fresh local cluster starts its own proxies here; one joined with --address may already run them.
    # With --direct-ingress the Frontend binds --port/--grpc-port, on a joined cluster too.
    ports = [] if args.address and not args.direct_ingress else [("--port", args.host, args.port)]
    if args.grpc_port and (args.direct_ingress or not args.address):  # gRPC listens on every interface
        ports.append(("--grpc-port", "0.0.0.0", args.grpc_port))
    for flag, host, port in ports:
        if (why := port_in_use(host, port)) is not None:
            return _fail(f"{flag} {port}: cannot listen on {host}:{port} ({why}); choose another port")

    import ray
    from ray import serve

    from .control_state import delete_state_actors

    # No --address: always a fresh local cluster, never one that happens to run on this machine already.
    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=False)
    try:
        # Now that the cluster is known: placement strategy, and a clear error when it is too small (the
        # builder itself leaves that to Serve, which waits for nodes to join).
        _, too_small = cluster_fit(args, alive_nodes())
        if too_small is not None:
            raise ValueError(too_small)
        app = build_app(args.model_dump(mode="json"))
    except ValueError as exc:
        ray.shutdown()
        return _fail(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deployed = False
    try:
        from ray.serve.config import gRPCOptions

        proxy_http, proxy_grpc = args.port, args.grpc_port
        if args.direct_ingress:  # Serve still starts a proxy on the head node: off the API's ports
            proxy_http, proxy_grpc = proxy_ports(args.host, args.grpc_port)
        grpc_options = None
        if args.grpc_port:  # the gRPC API (grpc_service) on Serve's gRPC proxy; --grpc-port 0: off
            grpc_options = gRPCOptions(port=proxy_grpc, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS)
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": args.host, "port": proxy_http},
            grpc_options=grpc_options,
        )
        # serve.run reconnects to the controller serve.start made with our options, and logs that "new
        # http_options ... will not be applied": it passes none of its own, ours are in force.
        serve_logger = logging.getLogger("ray.serve")
        serve_logger.addFilter(_drop_reconnect_notice)
        try:
            failed = _deploy(app, APP_NAME, stop)
        except RuntimeError:
            failed = _replica_error(APP_NAME)
            if failed is None:
                raise
        finally:
            serve_logger.removeFilter(_drop_reconnect_notice)
        if failed is not None:
            return _fail(failed)
        if stop.is_set():  # Ctrl-C while the replicas were starting: shut down (below), as when serving
            return 0
        deployed = True
        host, port = (
            (args.host, args.port) if args.direct_ingress else _serve_http_address(args.host, args.port)
        )
        if (host, port) != (args.host, args.port):  # --address: Serve already ran there with its own options
            print(
                f"ditserve: Serve already runs on this cluster with HTTP on {host}:{port}; "
                f"--host/--port {args.host}:{args.port} do not apply",
                flush=True,
            )
        # the id requests name (`model`, GET /v1/models): a folder's name, not the path given to --model
        from ditserve.replica.models.registry import resolve_model

        served = resolve_model(args.model).name
        shown = served if served == args.model else f"{served} ({args.model})"
        print(
            f"ditserve: serving {shown} at http://{host}:{port}/v1"
            + (f", gRPC {args.host}:{args.grpc_port}" if args.grpc_port else "")
            + " (Ctrl-C stops)",
            flush=True,
        )
        stop.wait()
    finally:
        print("ditserve: shutting down", flush=True)
        try:
            if args.address:  # a shared cluster: remove our application only, never the others'
                serve.delete(APP_NAME)
            elif deployed:  # else ray.shutdown below stops our local cluster, replicas still starting too
                serve.shutdown()
            delete_state_actors(APP_NAME)
        finally:
            ray.shutdown()
    return 0


# -- train-demo -----------------------------------------------------------------------------------------
def _add_train_demo(sub, options: bool = True) -> None:
    p = sub.add_parser(
        "train-demo",
        help="Train the demo-scenes model (minutes on one GPU).",
        description="Train demo-scenes (a tiny FLUX.1) on synthetic scenes and write a diffusers folder with its "
        "model card; `ditserve generate --model OUT` serves it. Seeded by --seed.",
    )
    if not options:
        return
    try:
        from ditserve.replica.models.train_demo import add_arguments
    except ImportError:
        return
    add_arguments(p)


def run_train_demo(ns: argparse.Namespace) -> int:
    from ditserve.replica.models.train_demo import run

    print(f"wrote {run(ns)}")
    return 0


def _add_train_demo_video(sub, options: bool = True) -> None:
    p = sub.add_parser(
        "train-demo-video",
        help="Train the demo-scenes-video model (a tiny Wan; minutes on one GPU).",
        description="Train demo-scenes-video (a tiny Wan) on synthetic moving scenes and write a diffusers folder "
        "with its model card; `ditserve generate --model OUT -o clip.mp4` serves it. Seeded by --seed.",
    )
    if not options:
        return
    try:
        from ditserve.replica.models.train_demo_video import add_arguments
    except ImportError:
        return
    add_arguments(p)


def run_train_demo_video(ns: argparse.Namespace) -> int:
    from ditserve.replica.models.train_demo_video import run

    print(f"wrote {run(ns)}")
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with ``argv``, the train-demo commands' options (whose module imports torch, ~1 s) only
    where argv names one of them: every other command starts without that import."""
    parser = argparse.ArgumentParser(prog="ditserve", description="Serve diffusion transformers on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    sub = parser.add_subparsers(dest="command", required=True)
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    _add_generate(sub)
    _add_serve(sub)
    _add_train_demo(sub, options=argv is None or named == "train-demo")
    _add_train_demo_video(sub, options=argv is None or named == "train-demo-video")
    _add_deploy(sub)
    return parser


COMMANDS = {
    "generate": run_generate,
    "serve": run_serve,
    "train-demo": run_train_demo,
    "train-demo-video": run_train_demo_video,
    "deploy": run_deploy,
}


def _not_the_torchvision_fallback(record: logging.LogRecord) -> bool:
    """transformers says, once per process, that an image processor "requires torchvision (not installed)"
    and falls back to its PIL one: diffusers imports those classes with every pipeline, and the PIL processors
    are the ones ditserve runs (see README), so the line is noise before every command's own output."""
    return "requires torchvision (not installed)" not in record.getMessage()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING)
    fallback = logging.getLogger("transformers.utils.import_utils")
    if _not_the_torchvision_fallback not in fallback.filters:
        fallback.addFilter(_not_the_torchvision_fallback)
    return COMMANDS[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
