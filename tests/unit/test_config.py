"""Config validation and flag generation: errors name the flag and the fix."""

import argparse
import json
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from ditserve.cluster.cli import build_parser, main
from ditserve.cluster.config import FLAT_NAMES, NESTED, AppArgs, EngineArgs, add_model_arguments, model_kwargs
from ditserve.replica.config import AUTO_FIELDS, EngineConfig, Limits, ParallelFlags
from ditserve.replica.models.registry import resolve_model


def test_defaults_are_the_embedded_demo_on_cpu():
    args = AppArgs()
    config = args.engine_config()
    assert args.model == "demo-scenes"
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert config.device == "cpu" and config.dtype == "float32"


def test_flags_are_generated_from_fields():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, AppArgs)
    ns = parser.parse_args(["--dp-size", "2", "--num-gpus", "4", "--ulysses-degree", "2", "--no-compile"])
    args = AppArgs(**model_kwargs(ns, AppArgs))
    assert (args.dp_size, args.num_gpus, args.ulysses_degree, args.compile) == (2, 4, 2, False)
    assert args.engine_config().parallel.world_size == 2


def test_unknown_field_is_refused():
    with pytest.raises(ValidationError, match="extra"):
        AppArgs(dp_szie=2)


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--num-gpus", "3", "--dp-size", "2"], "--dp-size"),
        (["--ring-degree", "2", "--kv-gather-degree", "2"], "--kv-gather-degree"),
        (["--num-gpus", "4", "--ulysses-degree", "2"], "--num-gpus"),
    ],
)
def test_illegal_layouts_name_the_flags(flags, flag, capsys):
    # --dp-size is a serve flag (generate runs one replica); serve refuses the layout before starting Ray.
    command = ["serve"] if "--dp-size" in flags else ["generate", "a fox", "-o", "x.png"]
    assert main([*command, "--model", "demo-flux", *flags]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Legal layouts: `--num-gpus" in err


def test_cli_generate_refuses_illegal_layout_before_starting(capsys):
    assert main(["generate", "a fox", "--model", "demo-flux", "--tp-size", "3", "-o", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--tp-size" in err and "8" in err


def test_cli_parser_has_layout_flags_on_both_commands():
    parser = build_parser()
    for command in (["generate", "p"], ["serve"]):
        ns = parser.parse_args([*command, "--tp-size", "2", "--sp-degree", "2", "--cfg-parallel-size", "2"])
        assert (ns.tp_size, ns.sp_degree, ns.cfg_parallel_size) == (2, 2, 2)
        # other stacks' spellings of the sequence degrees are the same flags
        ns = parser.parse_args([*command, "--ulysses-size", "2", "--ring-size", "4", "--kv-gather-size", "1"])
        assert (ns.ulysses_degree, ns.ring_degree, ns.kv_gather_degree) == (2, 4, 1)


def test_resolve_model_errors_say_what_was_found(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin.*model_index\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match="found pipeline StableDiffusionPipeline; supported"):
        resolve_model(str(tmp_path))


def test_engine_args_dtype_default_follows_device():
    assert EngineArgs(device="cpu").engine_config().dtype == "float32"
    assert EngineArgs(device="cuda").engine_config().dtype == "bfloat16"


def test_fp8_on_cuda_without_dtype_resolves_to_bfloat16_before_validation():
    """The README's fastest recipe on a GPU host: --compile --quantization fp8, no --dtype (no GPU needed:
    the device is given instead of probed)."""
    config = EngineArgs(model="demo-flux", compile=True, quantization="fp8").engine_config(device="cuda")
    assert (config.device, config.dtype, config.quantization, config.compile) == (
        "cuda",
        "bfloat16",
        "fp8",
        True,
    )
    assert config.cuda_graphs and config.fused_epilogues  # the other auto values, resolved for one GPU
    assert EngineArgs(device="cuda", quantization="fp8").engine_config().dtype == "bfloat16"
    with pytest.raises(ValidationError, match=r"--dtype float16 cannot hold them: use --dtype bfloat16"):
        EngineArgs(device="cuda", dtype="float16", quantization="fp8").engine_config()


@pytest.mark.parametrize("command", [["generate", "a fox", "-o", "x.png"], ["serve"]])
def test_float16_on_cpu_is_refused_naming_dtype(command, capsys):
    assert main([*command, "--model", "demo-flux", "--device", "cpu", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "--dtype float16 is not supported on --device cpu" in err and "--dtype float32" in err


def test_auto_values_are_resolved_in_the_final_config():
    args = AppArgs(model="demo-flux", ulysses_degree=2)
    assert {name: getattr(args, name) for name in AUTO_FIELDS} == dict.fromkeys(AUTO_FIELDS, "auto")
    on_gpu = args.engine_config(device="cuda")
    assert (on_gpu.dtype, on_gpu.cuda_graphs, on_gpu.fused_epilogues) == ("bfloat16", False, True)  # 2 ranks
    on_cpu = args.engine_config(device="cpu")
    assert (on_cpu.dtype, on_cpu.cuda_graphs, on_cpu.fused_epilogues) == ("float32", False, False)
    assert "auto" not in on_cpu.model_dump(mode="json").values()
    with pytest.raises(ValidationError, match="--cuda-graphs needs --device cuda"):
        AppArgs(cuda_graphs=True).engine_config(device="cpu")


def test_every_engine_field_is_declared_once():
    """The flat flags are EngineConfig's fields (nested layout and limits flattened), same help."""
    nested = {**ParallelFlags.model_fields, **Limits.model_fields}
    declared = {FLAT_NAMES.get(n, n): f for n, f in EngineConfig.model_fields.items() if n not in NESTED}
    declared.update(nested)
    assert set(EngineArgs.model_fields) == set(declared)
    for name, field in EngineArgs.model_fields.items():
        assert field.description == declared[name].description, name
    parser = build_parser()
    ns = parser.parse_args(["serve", "--lora-root", "/a", "--lora-root", "/b", "--no-cuda-graphs"])
    assert AppArgs(**model_kwargs(ns, AppArgs)).engine_config().lora_roots == ("/a", "/b")
    assert "NAME=PATH[:SCALE]" in AppArgs.model_fields["lora_path"].description


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_cli_serve_refuses_a_taken_port_naming_the_flag(capsys, flag):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "demo-flux", flag, str(port)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {port}" in err and "choose another port" in err


@pytest.mark.parametrize(
    "argv",
    [["serve"], ["serve", "--direct-ingress"], ["deploy", "kuberay"], ["deploy", "serve-config"]],
)
def test_http_and_grpc_on_one_port_are_refused_naming_both_flags(argv, capsys):
    """Both proxies bound such a port (HTTP on --host, gRPC on every interface); the HTTP server then took
    the gRPC clients' connections while serve printed 'gRPC 127.0.0.1:9000'."""
    with socket.socket() as taken:  # were the ports let through, serve would stop here, not start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main([*argv, "--model", "demo-flux", "--port", port, "--grpc-port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ditserve: error: --port {port} and --grpc-port {port} are the same port")
    assert AppArgs(port=9000, grpc_port=0).port == 9000  # gRPC off: the port is HTTP's alone


@pytest.mark.parametrize(
    "host, why",
    [("nosuchhost.invalid", "the name does not resolve"), ("203.0.113.7", "not an address of this machine")],
)
def test_cli_serve_refuses_a_host_it_cannot_listen_on_naming_the_flag(host, why, capsys):
    """Serve's proxy failed on such a --host after Ray had started, with a RuntimeError traceback."""
    assert main(["serve", "--model", "demo-flux", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ditserve: error: --host {host}: cannot listen there ({why}")


def test_an_empty_api_key_is_refused(capsys):
    """`--api-key "$KEY"` with KEY unset: the admin API was guarded by the key '', which only the header
    'Authorization: Bearer ' matched (a trailing space some HTTP parsers strip, h11 among them: no client
    could then authenticate). An empty DITSERVE_API_KEY stays no key, as documented."""
    with socket.socket() as taken:  # were the key let through, serve would stop at the taken port, not start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", "demo-flux", "--api-key", "", "--port", port]) == 2
    assert capsys.readouterr().err.startswith("ditserve: error: --api-key: is empty; pass a key")
    with pytest.raises(ValidationError, match="api_key"):
        AppArgs(api_key=" ")


def test_api_key_for_generation_without_a_key_is_refused(monkeypatch, capsys):
    """It was silently ignored: with no key, generation (and the admin API) answered everyone."""
    monkeypatch.delenv("DITSERVE_API_KEY", raising=False)
    with socket.socket() as taken:  # were the flag let through, serve would stop at the taken port, not start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", "demo-flux", "--api-key-for-generation", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "ditserve: error: --api-key-for-generation: no key is set (--api-key, or DITSERVE_API_KEY"
    )
    monkeypatch.setenv("DITSERVE_API_KEY", "k")
    from ditserve.cluster.app import build_app

    build_app({"model": "demo-flux", "api_key_for_generation": True})  # the key from the environment


def test_cli_serve_refuses_an_address_where_no_cluster_answers(capsys):
    """Ray retried such an --address for a minute or more before failing with its own traceback."""
    with socket.socket() as closed:  # a port of this machine that nothing listens on
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    assert main(["serve", "--model", "demo-flux", "--address", address]) == 2
    err = capsys.readouterr().err
    assert f"ditserve: error: --address {address}: no Ray cluster answers there (" in err


def test_the_cli_parses_serve_without_importing_torch():
    """Only the train-demo commands' options need torch (their module imports it): ``ditserve serve``'s
    front end and every refused flag answer without that second's import; train-demo still has its options."""
    code = (
        "import sys; from ditserve.cluster.cli import build_parser; "
        "ns = build_parser(['serve', '--dp-size', '2']).parse_args(['serve', '--dp-size', '2']); "
        "assert ns.dp_size == 2 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    train = build_parser(["-v", "train-demo", "--out", "x"]).parse_args(["-v", "train-demo", "--out", "x"])
    assert train.command == "train-demo" and train.steps > 0


def test_serve_validates_an_embedded_model_without_importing_diffusers():
    """``ditserve serve`` builds the app before Ray starts; for the embedded models that needs no diffusers or
    transformers (their import was about 3 s of every CPU-demo start), and with a CPU build of torch no torch
    either (device auto, the layout's checks: 1.5-2 s); the replicas import them."""
    code = (
        "import sys; from ditserve.cluster.app import build_app; "
        "from ditserve.replica.config import torch_has_gpu_backend; "
        "build_app({'model': 'demo-scenes'}); "
        "assert not {'diffusers', 'transformers'} & set(sys.modules), 'imported diffusers or transformers'; "
        "assert 'torch' not in sys.modules or torch_has_gpu_backend(), 'imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_device_auto_without_importing_torch_never_misses_a_gpu():
    """host_device answers cpu without importing torch only for a build with no GPU backend."""
    import torch

    from ditserve.replica.config import host_device, torch_has_gpu_backend

    assert torch_has_gpu_backend() or not torch.cuda.is_available()
    assert host_device() == ("cuda" if torch.cuda.is_available() else "cpu")
