"""`ditserve generate`: files a user can open, the same pixels for the same seed, clear errors."""

import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from ditserve.replica.media import decode_mp4
from tests.helpers import free_port, psnr, user_env


def generate(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=user_env())


def test_image_png_with_requested_size_and_seed(tmp_path):
    out = tmp_path / "fox.png"
    common = [
        "a red fox",
        "--model",
        "demo-flux",
        "--width",
        "96",
        "--height",
        "64",
        "--num-inference-steps",
        "3",
    ]
    done = generate(*common, "--seed", "7", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "100%" in done.stderr  # the progress bar ran to the end
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (96, 64)
        first = np.array(img)
    again = tmp_path / "again.png"
    assert generate(*common, "--seed", "7", "-o", str(again)).returncode == 0
    assert np.array_equal(first, np.array(Image.open(again)))
    other = tmp_path / "other.png"
    assert generate(*common, "--seed", "8", "-o", str(other)).returncode == 0
    assert not np.array_equal(first, np.array(Image.open(other)))
    # -o's suffix picks the format, as the API's output_format: the same picture as a JPEG / WebP file
    # (JPEG at the default quality 100 keeps full-resolution colour; WebP's lossy coding halves it)
    seed_8 = psnr(np.array(Image.open(other).convert("RGB")), first[..., :3])
    for name, fmt, floor in (("fox.jpg", "JPEG", 40), ("fox.webp", "WEBP", 20)):
        done = generate(*common, "--seed", "7", "-o", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        with Image.open(tmp_path / name) as img:
            assert img.format == fmt and img.size == (96, 64)
            assert psnr(np.array(img.convert("RGB")), first[..., :3]) > max(floor, seed_8 + 5)


def test_video_mp4_frames_and_size(tmp_path):
    out = tmp_path / "clip.mp4"
    done = generate(
        "a red fox",
        "--model",
        "demo-wan",
        "--num-frames",
        "9",
        "--num-inference-steps",
        "2",
        "--width",
        "64",
        "--height",
        "48",
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[4:8] == b"ftyp"
    frames = decode_mp4(out.read_bytes())
    assert frames.shape == (9, 48, 64, 3)
    import av

    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.name == "h264"


def test_several_prompts_one_batch_one_file_each(tmp_path):
    """Prompt k gets seed --seed + k and file OUT-<k>; each equals that prompt generated alone."""
    common = ["--model", "demo-flux", "--num-inference-steps", "2"]
    done = generate("a red fox", "a blue square", *common, "--seed", "7", "-o", str(tmp_path / "b.png"))
    assert done.returncode == 0, done.stderr
    assert "b-0.png (64x64, seed 7)" in done.stdout and "b-1.png (64x64, seed 8)" in done.stdout
    alone = generate("a blue square", *common, "--seed", "8", "-o", str(tmp_path / "alone.png"))
    assert alone.returncode == 0, alone.stderr
    second = np.array(Image.open(tmp_path / "b-1.png"))
    assert psnr(second, np.array(Image.open(tmp_path / "alone.png"))) >= 40  # batched as alone
    assert psnr(second, np.array(Image.open(tmp_path / "b-0.png"))) < 30


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "no such folder"),
        (
            ["--model", "demo-flux", "--width", "72"],
            "--width/--height: width and height must be multiples of 16",
        ),
        # 0 is a size, not "the default size" (it made a 64×64 image)
        (["--model", "demo-flux", "--width", "0"], "--width: Input should be greater than or equal to 16"),
        (["--model", "demo-flux", "-o", "x.mp4"], "makes images (.png, .jpg, .webp)"),
        (["--model", "demo-flux", "-o", "x.gif"], "makes images (.png, .jpg, .webp)"),
        # without --image there is nothing to keep: it was dropped and a text-to-image made
        (["--model", "demo-flux", "--strength", "0.5"], "--strength: image-to-image needs the start image"),
        # a video's settings on an image model: dropped, the image made as without them
        (["--model", "demo-flux", "--num-frames", "5"], "--num-frames: demo-flux makes images"),
        (["--model", "demo-flux", "--fps", "8"], "--fps: demo-flux makes images"),
        (["--model", "demo-wan", "--num-frames", "8", "-o", "x.mp4"], "--num-frames: must be 4·k + 1"),
        # the API's guidance bounds, 0..100 and finite (a NaN, infinite or negative scale made a video)
        (
            ["--model", "demo-wan", "--guidance-scale", "nan", "-o", "x.mp4"],
            "--guidance-scale: Input should be a finite",
        ),
        (["--model", "demo-flux", "--ulysses-degree", "16"], "--ulysses-degree"),
        (["--model", "demo-flux", "--n", "9"], "--n: 9 is above the maximum"),
        (["--model", "demo-flux", "--lora", "style=missing.safetensors"], "--lora style: "),
        # a NaN default scale drew every request without its own scale black (serve's --lora-path)
        (["--model", "demo-flux", "--lora", "style=a.safetensors:nan"], "SCALE nan must be a finite number"),
        (["--model", "demo-flux", "--dp-size", "2"], "unrecognized arguments: --dp-size"),  # one replica
    ],
)
def test_bad_arguments_exit_non_zero_with_a_message(tmp_path, args, message):
    done = generate("a fox", "-o", str(tmp_path / "x.png"), *args)
    assert done.returncode != 0
    assert message in done.stderr


def test_strength_or_a_mask_on_an_image_to_video_model_is_refused(tmp_path):
    """--strength and --mask are image-to-image's: an image-to-video model starts from its --image as the first
    frame, and the strength or mask was dropped (the video made as without it)."""
    from tests.families.wan_i2v import build_folder, reference_png

    folder = build_folder(tmp_path / "wan-i2v-tiny")
    first = tmp_path / "first.png"
    first.write_bytes(reference_png())
    out = tmp_path / "clip.mp4"
    done = generate(
        "a fox", "--model", str(folder), "--image", str(first), "--strength", "0.5",
        "--num-frames", "5", "--num-inference-steps", "1", "--width", "32", "--height", "32", "-o", str(out),
    )  # fmt: skip
    assert done.returncode == 2 and "--strength: wan-i2v-tiny makes videos" in done.stderr, done.stderr
    assert not out.exists()
    # a mask likewise: dropped, the video made from the whole first frame
    done = generate(
        "a fox", "--model", str(folder), "--image", str(first), "--mask", str(first),
        "--num-frames", "5", "--num-inference-steps", "1", "--width", "32", "--height", "32", "-o", str(out),
    )  # fmt: skip
    assert done.returncode == 2 and "--mask: wan-i2v-tiny makes videos" in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused_naming_the_flag(tmp_path):
    done = generate("a fox", "--model", "demo-flux", "--device", "cuda", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 2 and "--device cuda: 1 rank(s) need 1 GPU(s), torch sees 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_refuses_an_illegal_layout_before_starting():
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "serve", "--model", "demo-flux", "--tp-size", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--tp-size" in done.stderr and "Started a local Ray" not in done.stderr + done.stdout


def test_wan22_second_expert_guidance_flag(tmp_path):
    """--guidance-scale-2 is the low-noise expert's CFG (Wan 2.2 A14B), as the API's guidance_scale_2."""
    from tests.families.wan22 import build_folder

    folder = build_folder(tmp_path / "a14b")
    common = ["a red fox", "--model", str(folder), "--num-frames", "5", "--num-inference-steps", "4"]
    # CFG runs when --guidance-scale > 1 (WanPipeline: the first expert's scale decides).
    common += ["--width", "32", "--height", "32", "--guidance-scale", "3", "--seed", "3"]
    videos = []
    for second in ("1", "6"):
        out = tmp_path / f"g{second}.mp4"
        done = generate(*common, "--guidance-scale-2", second, "-o", str(out))
        assert done.returncode == 0, done.stderr
        videos.append(decode_mp4(out.read_bytes()))
    assert videos[0].shape == videos[1].shape == (5, 32, 32, 3)
    assert not np.array_equal(videos[0], videos[1])


def test_hunyuanvideo_refuses_an_adapter_saying_why(tmp_path):
    from tests.families.hunyuanvideo15 import build_folder
    from tests.unit.test_lora_engine import weights, write_kohya

    write_kohya(tmp_path / "style.safetensors", weights(1))
    folder = build_folder(tmp_path / "hy")
    lora = f"style={tmp_path / 'style.safetensors'}"
    done = generate(
        "a fox", "--model", str(folder), "--lora", lora, "--num-frames", "5", "-o", str(tmp_path / "x.mp4")
    )
    assert done.returncode == 2, done.stderr
    assert "--lora style: diffusers has no LoRA loader for HunyuanVideo15Pipeline" in done.stderr


def test_a_folder_saved_without_a_needed_component_is_refused_naming_it(tmp_path):
    """FluxPipeline saved with text_encoder_2=None, tokenizer_2=None (diffusers writes them as [null, null];
    FLUX.1 cannot run without T5): generate and serve exit with status 2 naming both, not with a traceback
    of diffusers' from_pretrained (generate) or Serve's bare 'Failed to update the deployments' (serve);
    serve says it before starting Ray (a replica's refusal at start reaches serve too: the --lora-path test)."""
    from diffusers import FluxPipeline

    from ditserve.replica.models.demo import ensure_demo_model

    pipe = FluxPipeline.from_pretrained(ensure_demo_model("demo-flux"))
    folder = tmp_path / "flux-without-t5"
    FluxPipeline(**(pipe.components | {"text_encoder_2": None, "tokenizer_2": None})).save_pretrained(folder)
    want = f"--model {folder.name}: the folder was saved without text_encoder_2, tokenizer_2"
    done = generate("a fox", "--model", str(folder), "-o", str(tmp_path / "x.png"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert want in done.stderr
    ports = ["--port", str(free_port()), "--grpc-port", str(free_port())]
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "serve", "--model", str(folder), *ports]
    served = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert served.returncode == 2, served.stderr
    assert f"ditserve: error: {want}" in served.stderr
    assert "Started a local Ray instance" not in served.stdout + served.stderr  # said before anything starts


def test_serve_refuses_a_lora_path_it_cannot_load_naming_the_entry(tmp_path):
    """``serve --lora-path NAME=PATH`` with a file the replicas refuse (a kohya file with text-encoder
    weights, as POST /v1/loras refuses it at run time) exits with status 2 naming the entry and the reason,
    instead of serving without the adapter (listed as loaded); a file that does not exist is refused
    before anything starts, by generate's --lora as well."""
    from safetensors.torch import load_file, save_file

    from tests.unit.test_lora_engine import ALPHA, RANK, weights, write_kohya

    te_file = tmp_path / "with_te.safetensors"
    tensors = dict(load_file(str(write_kohya(tmp_path / "good.safetensors", weights(1)))))
    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    tensors |= {f"{te}.lora_down.weight": torch.ones(RANK, 32), f"{te}.lora_up.weight": torch.ones(32, RANK)}
    save_file(tensors | {f"{te}.alpha": torch.tensor(ALPHA)}, str(te_file))
    gone = tmp_path / "gone.safetensors"

    def serve(lora: str) -> tuple[int, str]:
        """Its exit status and output; a server that starts instead is stopped (Ctrl-C) and reported as -1."""
        ports = ["--port", str(free_port()), "--grpc-port", str(free_port())]
        cmd = [sys.executable, "-m", "ditserve.cluster.cli", "serve", "--model", "demo-flux", *ports]
        proc = subprocess.Popen(
            [*cmd, "--lora-path", lora], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines = []
        for line in proc.stdout:  # until it exits, or says it serves
            lines.append(line)
            if line.startswith("ditserve: serving"):
                proc.send_signal(signal.SIGINT)
                lines += proc.stdout.readlines()
                proc.wait(120)
                return -1, "".join(lines)
        return proc.wait(120), "".join(lines)

    status, output = serve(f"gone={gone}")
    assert status == 2, output
    assert f"ditserve: error: --lora-path gone={gone}: {gone} does not exist" in output
    assert "Started a local Ray instance" not in output  # refused before the cluster starts
    status, output = serve(f"te={te_file}:0.5")
    assert status == 2, output
    assert "Traceback" not in output, output
    assert (
        f"ditserve: error: --lora-path te={te_file}: {te_file} holds LoRA weights for text_encoder" in output
    )
    done = generate("a fox", "--model", "demo-flux", "--lora", f"gone={gone}", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 2 and f"--lora gone: {gone} does not exist" in done.stderr, done.stderr
