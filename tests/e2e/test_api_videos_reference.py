"""Image-to-video through a real ``ditserve serve`` on a tiny Wan 2.1 I2V folder: the openai client's
``videos.create(..., input_reference=file)``, a JSON data URL and gRPC bytes give H.264 MP4s of the asked
frames and size; a missing, unreadable, oversized or fetched-URL reference is a 400 naming
input_reference."""

from __future__ import annotations

import base64
import io
import os
import time

import av
import grpc
import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from ditserve.cluster.client import Client
from ditserve.replica.media import decode_mp4
from tests.families.wan_i2v import build_folder, reference_png
from tests.helpers import ServeProcess, psnr

MAX_IMAGE_BYTES = 50_000
MAX_BODY_BYTES = 4096  # the fields; a first frame up to MAX_IMAGE_BYTES comes on top
FIELDS = {"num_frames": 5, "num_inference_steps": 2, "seed": 3, "fps": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_folder(tmp_path_factory.mktemp("i2v") / "wan-i2v-tiny")
    proc = ServeProcess(
        "--model", str(folder), "--max-frames", "9", "--max-steps", "4", "--max-width", "64",
        "--max-height", "64", "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-body-bytes", str(MAX_BODY_BYTES),
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait(client, video_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.videos.retrieve(video_id)
        if job.status in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise TimeoutError(video_id)


def assert_h264(data: bytes, shape: tuple[int, ...]) -> None:
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
    frames = decode_mp4(data)
    assert frames.shape == shape and frames.std() > 0


def test_openai_client_with_input_reference_file(client):
    job = client.videos.create(
        model="wan-i2v-tiny",
        prompt="the red square drifts right",
        input_reference=("first.png", reference_png(), "image/png"),
        size="64x48",
        extra_body=FIELDS,
    )
    assert job.status in ("queued", "in_progress") and job.size == "64x48"
    done = wait(client, job.id)
    assert done.status == "completed", done
    mp4 = client.videos.download_content(job.id).read()
    assert_h264(mp4, (5, 48, 64, 3))
    # the image as a form part without a file name (curl -F 'input_reference=<first.png'): the same video
    # (it was refused as "not UTF-8 text")
    form = {"model": "wan-i2v-tiny", "prompt": "the red square drifts right", "size": "64x48", **FIELDS}
    r = httpx.post(
        f"{client.base_url}videos",
        data={k: str(v) for k, v in form.items()},
        files={"input_reference": (None, reference_png())},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert wait(client, r.json()["id"]).status == "completed"
    assert psnr(decode_mp4(client.videos.download_content(r.json()["id"]).read()), decode_mp4(mp4)) >= 40


def test_openai_client_without_input_reference_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model="wan-i2v-tiny", prompt="a fox", size="64x48", extra_body=FIELDS)
    assert err.value.body["param"] == "input_reference"
    assert "image-to-video" in err.value.body["message"]


def _json_job_completes(server, client, body: dict) -> str:
    """POST /v1/videos with a JSON ``body`` (plus FIELDS); the job's id once it completed."""
    r = httpx.post(f"{server.base_url}/v1/videos", json={**body, **FIELDS}, timeout=60)
    assert r.status_code == 200, r.text
    assert wait(client, r.json()["id"]).status == "completed"
    return r.json()["id"]


def test_data_urls_and_grpc_bytes(server, client):
    url = "data:image/png;base64," + base64.b64encode(reference_png(40, 40)).decode()
    # OpenAI's reference object in JSON (openai 2.x's client sends only files in its multipart body)
    job = _json_job_completes(
        server, client, {"prompt": "a square", "size": "64x64", "input_reference": {"image_url": url}}
    )
    assert_h264(client.videos.download_content(job).read(), (5, 64, 64, 3))
    # JSON: the data URL as a string; a URL's scheme and ";base64" are case-insensitive (it was a 400)
    _json_job_completes(server, client, {"prompt": "a square", "size": "64x48", "input_reference": url})
    shouted = "DATA:image/png;BASE64," + url.partition(",")[2]
    _json_job_completes(server, client, {"prompt": "a square", "size": "64x48", "input_reference": shouted})
    # a first frame near --max-image-bytes: its data URL is a third larger, and still taken, wrapped in lines
    # of 76 characters as MIME base64 is (Python's base64.encodebytes)
    noise = Image.frombytes("RGB", (120, 120), os.urandom(120 * 120 * 3))
    buf = io.BytesIO()
    noise.save(buf, format="PNG")
    assert MAX_IMAGE_BYTES - 10_000 < len(buf.getvalue()) <= MAX_IMAGE_BYTES
    url = "data:image/png;base64," + base64.encodebytes(buf.getvalue()).decode()
    _json_job_completes(server, client, {"prompt": "noise", "size": "64x48", "input_reference": url})
    with Client(f"127.0.0.1:{server.grpc_port}") as c:
        job = c.create_video("a square", size="64x48", input_reference=reference_png(), num_frames=5)
        assert_h264(c.wait_video(job.id, poll_s=0.1, timeout_s=120), (5, 48, 64, 3))
        with pytest.raises(grpc.RpcError) as err:
            c.create_video("a square", size="64x48", input_reference=b"not an image", num_frames=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input_reference" in err.value.details()


BAD_REFERENCES = {  # case: what the message says
    "not-an-image": "not a readable PNG, JPEG or WebP image",
    "empty-file": "the file is empty",
    "too-large": "above the maximum",
    # Wan 2.1 I2V's CLIP processor scales the shortest side up keeping the aspect: out of memory, in time
    "one-pixel-tall": "longer than 8:1",
    "http-url": "the server fetches no URLs",
    "bad-base64": "not valid base64",
    "file-id": "file_id is not supported",
    "empty-object": "no image_url",
    "a-number": "input_reference",
}


@pytest.mark.parametrize("case", list(BAD_REFERENCES))
def test_bad_references_are_400_naming_input_reference(server, case):
    data = {"prompt": "a fox", "size": "64x48", **FIELDS}
    files = None
    if case == "not-an-image":
        files = {"input_reference": ("x.png", b"GIF89a not really", "image/png")}
    elif case == "one-pixel-tall":
        files = {"input_reference": ("strip.png", reference_png(2000, 1), "image/png")}
    elif case == "empty-file":
        files = {"input_reference": ("x.png", b"", "image/png")}
    elif case == "too-large":
        files = {"input_reference": ("big.png", reference_png() + os.urandom(MAX_IMAGE_BYTES), "image/png")}
    elif case == "http-url":
        data["input_reference"] = "https://example.com/first.png"
    elif case == "bad-base64":
        data["input_reference"] = "data:image/png;base64,@@@"
    elif case == "file-id":
        data["input_reference"] = {"file_id": "file-123"}
    elif case == "empty-object":
        data["input_reference"] = {}
    else:  # neither member of the union (a data URL or a reference object): the field, not "input_reference.str"
        data["input_reference"] = 5
    if files is None:
        r = httpx.post(f"{server.base_url}/v1/videos", json=data, timeout=30)
    else:
        form = {k: str(v) for k, v in data.items()}
        r = httpx.post(f"{server.base_url}/v1/videos", data=form, files=files, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input_reference", r.text
    assert BAD_REFERENCES[case] in r.json()["error"]["message"], r.text
