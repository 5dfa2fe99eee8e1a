"""Settings a model would not apply are refused where they are given, naming the field, instead of being
dropped or failing the job later: a step cache for AnyFlow-FAR (its chunk loop has no cache hooks; as a
request's field, or as the server's default before it starts) and ``guidance_scale_2`` or an adapter's
``target`` for a one-transformer model (only Wan 2.2 A14B has a second expert).
(``true_cfg_scale`` for a model guided by ``guidance_scale``: ``test_sd3.py``'s served client.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import grpc
import httpx
import pytest
import torch
from safetensors.torch import save_file

from ditserve.cluster.client import Client
from tests.families import anyflow, wan22
from tests.families.harness import (
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.helpers import free_port

pytestmark = pytest.mark.usefixtures("single_thread")

LIMITS = ["--max-width", "64", "--max-height", "64", "--max-frames", "9"]


def test_videos_api_refuses_what_the_model_would_not_apply(tmp_path):
    folder = anyflow.build_folder(tmp_path / "anyflow")
    body = {"prompt": "a red fox", "size": "64x64", "num_frames": 5, "num_inference_steps": 1, "seed": 1}
    bad = {
        "cache": {"cache": {"policy": "fbcache", "threshold": 0.1}},
        "guidance_scale_2": {"guidance_scale_2": 2.0},
    }
    with served("--model", str(folder), *LIMITS) as server:
        for param, extra in bad.items():
            r = httpx.post(f"{server.base_url}/v1/videos", json=body | extra, timeout=60)
            assert r.status_code == 400, (param, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(param), error
        # an adapter for the second expert (POST /v1/loras, gRPC LoadLoRA's target)
        lora = tmp_path / "style.safetensors"
        save_file({f"transformer.proj_out.lora_{x}.weight": torch.zeros(4, 4) for x in "AB"}, lora)
        body_lora = {"name": "style", "path": str(lora), "target": "transformer_2"}
        r = httpx.post(f"{server.base_url}/v1/loras", json=body_lora, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "target", r.text
        assert "does not have (Wan 2.2 A14B has one)" in r.json()["error"]["message"], r.text
        with Client(f"127.0.0.1:{server.grpc_port}") as client, pytest.raises(grpc.RpcError) as err:
            client.load_lora("style", str(lora), target="transformer_2")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "target: transformer_2 names a second expert" in err.value.details(), err.value.details()
        # a cache that is off is no setting at all; the server keeps serving
        r = httpx.post(f"{server.base_url}/v1/videos", json=body | {"cache": {"policy": "none"}}, timeout=60)
        assert r.status_code == 200, r.text


def test_generate_refuses_a_second_scale_for_one_transformer(tmp_path):
    folder = wan22.build_folder(tmp_path / "ti2v", "ti2v")
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", "a kite", "--model", str(folder)]
    cmd += ["--width", "64", "--height", "64", "--num-frames", "5", "--num-inference-steps", "1"]
    done = subprocess.run([*cmd, "--guidance-scale-2", "3", "-o", str(tmp_path / "v.mp4")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and not (tmp_path / "v.mp4").exists()
    assert "--guidance-scale-2: " in done.stderr and "two-expert" in done.stderr, done.stderr
    # an adapter for the second expert (--lora NAME@transformer_2=PATH)
    lora = tmp_path / "style.safetensors"
    save_file({f"transformer.proj_out.lora_{x}.weight": torch.zeros(4, 4) for x in "AB"}, lora)
    done = subprocess.run([*cmd, "--lora", f"style@transformer_2={lora}", "-o", str(tmp_path / "v.mp4")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and not (tmp_path / "v.mp4").exists()
    assert "--lora style: target: transformer_2 names a second expert" in done.stderr, done.stderr


def test_a_default_step_cache_the_model_does_not_take_is_refused_before_starting(tmp_path):
    """--cache-policy on AnyFlow-FAR: serve and generate refuse it naming the flag. serve started, and every
    video job failed with 'cache: step caching ... is not supported', though no request gave a cache."""
    folder = anyflow.build_folder(tmp_path / "anyflow")
    exe = str(Path(sys.executable).with_name("ditserve"))
    serve = [exe, "serve", "--model", str(folder), "--cache-policy", "fbcache", "--port", str(free_port())]
    serve += ["--grpc-port", "0"]
    proc = subprocess.Popen(serve, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # it started serving: stop it and its Ray cluster
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Started a local Ray" not in out + err
    assert "--cache-policy fbcache: " in err and "does not take a step cache" in err, err
    cmd = [exe, "generate", "a kite", "--model", str(folder), "--cache-policy", "taylorseer"]
    cmd += ["--width", "64", "--height", "64", "--num-frames", "4", "--num-inference-steps", "1"]
    done = subprocess.run([*cmd, "-o", str(tmp_path / "v.mp4")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "v.mp4").exists()
    assert "--cache-policy taylorseer: " in done.stderr, done.stderr


def test_max_sequence_length_on_a_model_with_a_fixed_prompt_length_is_refused(tmp_path):
    """HunyuanVideo 1.5's pipeline pads every prompt to its own 1000 tokens and takes no max_sequence_length:
    ``--max-sequence-length 64`` gave the same video as without it, without a word. Now generate refuses it
    naming the flag, before writing anything."""
    from tests.families import hunyuanvideo15

    folder = hunyuanvideo15.build_folder(tmp_path / "hv15")
    exe = str(Path(sys.executable).with_name("ditserve"))
    cmd = [exe, "generate", "a kite", "--model", str(folder), "--max-sequence-length", "64"]
    cmd += ["--width", "32", "--height", "32", "--num-frames", "5", "--num-inference-steps", "1"]
    done = subprocess.run([*cmd, "-o", str(tmp_path / "v.mp4")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "v.mp4").exists()
    assert "--max-sequence-length 64: " in done.stderr and "leave the flag out" in done.stderr, done.stderr


def test_a_tp_size_that_divides_the_heads_but_not_the_mlp_is_refused_before_loading(tmp_path):
    """Z-Image's SwiGLU has int(dim / 3 * 8) features (10240 for Z-Image-Turbo's 30 heads, 170 for the tiny
    folder's 8): --tp-size 4 passed the heads check, every rank loaded the weights and died sharding them, a
    traceback per rank. Now generate refuses it naming --tp-size, the module and the sizes that fit."""
    from tests.families import zimage

    folder = zimage.build_folder(tmp_path / "zimage")
    exe = str(Path(sys.executable).with_name("ditserve"))
    cmd = [exe, "generate", "a kite", "--model", str(folder), "--tp-size", "4", "-o", str(tmp_path / "i.png")]
    done = subprocess.run(
        [*cmd, "--width", "32", "--height", "32"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and not (tmp_path / "i.png").exists()
    assert "--tp-size 4 divides the model's 8 attention heads but not the 170 features" in done.stderr, (
        done.stderr
    )
    assert "noise_refiner.0.feed_forward.w1" in done.stderr and "divides both (1, 2)" in done.stderr, (
        done.stderr
    )
    # a suggestion taken as written runs (tp 2 with the rest of the ranks to the sequence)
    assert "Legal layouts: `--num-gpus 4 --tp-size 2 --ulysses-degree 2`" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
