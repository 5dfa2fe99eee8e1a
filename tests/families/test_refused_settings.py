"""Settings a model would not apply are refused where they are given, naming the field, instead of being
dropped or failing the job later: a step cache for AnyFlow-FAR (its chunk loop has no cache hooks) and
``guidance_scale_2`` for a one-transformer model (only Wan 2.2 A14B's second expert takes it).
(``true_cfg_scale`` for a model guided by ``guidance_scale``: ``test_sd3.py``'s served client.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.families import anyflow, wan22
from tests.families.harness import (
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)

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
