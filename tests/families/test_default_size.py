"""A request that names no size gets the model's own default: the size its diffusers pipeline draws when called
without height and width (Wan 832×480, HunyuanVideo 1.5 its 16:9 bucket, SD3 its sample size), scaled down,
keeping the aspect, to ``--max-width`` / ``--max-height`` (before, every non-demo model defaulted to 1024²,
a 400 under smaller limits and the wrong shape for the video families)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditserve.replica.families import fit_size
from ditserve.replica.media import decode_mp4
from ditserve.replica.models.registry import resolve_model
from tests.families import hunyuanvideo15, sd3, wan22
from tests.families.harness import (
    openai_client,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("default_size")
    return {
        "wan": wan22.build_folder(root / "ti2v", "ti2v"),
        "hunyuanvideo15": hunyuanvideo15.build_folder(root / "hv15"),
        "sd3": sd3.build_folder(root / "sd3"),
    }


def _pipeline_default(folder: Path, video: bool) -> tuple[int, int]:
    """(width, height) of what the folder's own diffusers pipeline draws without height/width."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"num_frames": 5} if video else {}
    out = pipe(prompt="a fox", num_inference_steps=1, output_type="np", **kwargs)
    pixels = out.frames[0] if video else out.images[0]
    return pixels.shape[-2], pixels.shape[-3]


@pytest.mark.parametrize("family", ["wan", "hunyuanvideo15", "sd3"])
def test_default_size_is_the_pipelines(folders, family):
    spec = resolve_model(str(folders[family]))
    assert spec.family == family
    assert spec.default_size == _pipeline_default(folders[family], spec.kind == "video")


def test_a_folder_named_like_a_demo_model_gets_its_pipelines_default(folders, tmp_path):
    """The embedded demo models draw 64×64 by default; a user's folder whose name starts with "demo-" got that
    too (its name was the test), not its pipeline's default."""
    import shutil

    folder = shutil.copytree(folders["sd3"], tmp_path / "demo-sd3-finetune")
    assert (
        resolve_model(str(folder)).default_size == resolve_model(str(folders["sd3"])).default_size != (64, 64)
    )
    assert resolve_model("demo-flux").default_size == (64, 64)


def test_fit_size_keeps_the_aspect_within_the_limits():
    assert fit_size((832, 480), 2048, 2048, 16) == (832, 480)  # fits: unchanged
    assert fit_size((832, 480), 416, 2048, 16) == (416, 240)
    assert fit_size((832, 480), 128, 128, 32) == (128, 64)  # 128 × 73.8, down to the multiple
    assert fit_size((1024, 1024), 512, 256, 16) == (256, 256)
    assert fit_size((1024, 1024), 16, 16, 32) == (32, 32)  # never below one multiple


def test_cli_generate_without_a_size_draws_the_pipelines_default(folders, tmp_path):
    folder = folders["hunyuanvideo15"]
    out = tmp_path / "v.mp4"
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", "a fox", "--model", str(folder)]
    cmd += ["--num-frames", "5", "--num-inference-steps", "1", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    width, height = _pipeline_default(folder, video=True)
    assert decode_mp4(out.read_bytes()).shape == (5, height, width, 3)


def test_image_to_video_without_a_size_takes_the_pipelines_first_frame_bucket(tmp_path):
    """HunyuanVideo 1.5's image-to-video pipeline takes no size: it draws the bucket of the first frame's
    aspect. A portrait first frame without --width/--height gives that bucket, not the 16:9 default."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from PIL import Image

    folder = hunyuanvideo15.build_folder(tmp_path / "i2v", task="i2v")
    frame = Image.fromarray((np.random.default_rng(0).random((96, 40, 3)) * 255).astype("uint8"))
    (tmp_path / "first.png").write_bytes(_png_bytes(frame))
    out = tmp_path / "v.mp4"
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", "a fox", "--model", str(folder)]
    cmd += ["--image", str(tmp_path / "first.png"), "--num-frames", "5", "--num-inference-steps", "1"]
    done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(image=frame, prompt="a fox", num_frames=5, num_inference_steps=1, output_type="np").frames[0]
    assert ref.shape[1] > ref.shape[2]  # a portrait bucket
    assert decode_mp4(out.read_bytes()).shape == ref.shape


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_serve_without_a_size_fits_the_default_to_the_limits(folders):
    limits = ["--max-width", "128", "--max-height", "128", "--max-frames", "5"]
    with served("--model", str(folders["wan"]), *limits) as server:
        client = openai_client(server)
        job = client.videos.create(
            prompt="a red kite", extra_body={"num_frames": 5, "num_inference_steps": 1, "seed": 1}
        )
        job = client.videos.poll(job.id, poll_interval_ms=200)
        assert job.status == "completed", job
        # Wan's 832×480 scaled to 128 wide keeps 16:9-ish: 128 × 73.8, down to the multiple of 32
        assert job.size == "128x64"
        assert decode_mp4(client.videos.download_content(job.id).read()).shape == (5, 64, 128, 3)
