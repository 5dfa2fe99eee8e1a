"""Config validation and flag generation: errors name the flag and the fix."""

import argparse
import json
import socket

import pytest
from pydantic import ValidationError

from ditserve.cluster.cli import build_parser, main
from ditserve.cluster.config import AppArgs, EngineArgs, add_model_arguments, model_kwargs
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
    "kwargs, flag",
    [
        ({"num_gpus": 3, "dp_size": 2}, "--dp-size"),
        ({"ring_degree": 2, "kv_gather_degree": 2}, "--kv-gather-degree"),
        ({"num_gpus": 4, "ulysses_degree": 2}, "--num-gpus"),
    ],
)
def test_illegal_layouts_name_the_flags(kwargs, flag):
    with pytest.raises(ValidationError) as err:
        AppArgs(**kwargs)
    assert flag in str(err.value)


def test_cli_generate_refuses_illegal_layout_before_starting(capsys):
    assert main(["generate", "a fox", "--model", "demo-flux", "--tp-size", "3", "-o", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--tp-size" in err and "8" in err


def test_cli_parser_has_layout_flags_on_both_commands():
    parser = build_parser()
    for command in (["generate", "p"], ["serve"]):
        ns = parser.parse_args([*command, "--tp-size", "2", "--sp-degree", "2", "--cfg-parallel-size", "2"])
        assert (ns.tp_size, ns.sp_degree, ns.cfg_parallel_size) == (2, 2, 2)


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


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_cli_serve_refuses_a_taken_port_naming_the_flag(capsys, flag):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "demo-flux", flag, str(port)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {port}" in err and "choose another port" in err
