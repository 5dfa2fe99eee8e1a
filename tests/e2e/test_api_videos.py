"""Videos as async jobs against a real ``ditserve serve --model demo-wan`` that requires the API key for
generation too: the openai client's videos resource (multipart create, retrieve, list, download with its
variants, remix, delete), httpx, the gRPC client, limits, expiry."""

from __future__ import annotations

import io
import time

import av
import grpc
import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from ditserve.cluster.client import Client
from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.replica.media import decode_mp4
from tests.helpers import ServeProcess, png_pixels, psnr

KEY = "video-key"
TTL_S = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.unit.test_lora_wan import weights, write_original  # an adapter that fits demo-wan

    style = write_original(tmp_path_factory.mktemp("loras") / "style.safetensors", weights(1))
    proc = ServeProcess(
        "--model", "demo-wan", "--api-key", KEY, "--api-key-for-generation",
        "--max-frames", "9", "--max-steps", "20", "--max-width", "64", "--max-height", "64",
        "--video-ttl-s", str(TTL_S), "--lora-path", f"style={style}",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


AUTH = {"authorization": f"Bearer {KEY}"}


def wait(client, video_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        job = client.videos.retrieve(video_id)
        seen.append((job.status, job.progress))
        if job.status in ("completed", "failed"):
            return job, seen
        time.sleep(0.1)
    raise TimeoutError(seen)


def test_openai_client_video_job(client):
    job = client.videos.create(
        prompt="waves on a beach", model="demo-wan", size="64x64",
        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3, "fps": 8},
    )  # fmt: skip
    assert job.object == "video" and job.status in ("queued", "in_progress") and job.model == "demo-wan"
    assert job.size == "64x64" and job.seconds == "0.625"
    done, seen = wait(client, job.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert all(0 <= p <= 100 for _, p in seen)
    data = client.videos.download_content(job.id).read()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == 8
        assert stream.codec_context.colorspace == 1  # BT.709, said in the stream (browsers read it so)
    frames = decode_mp4(data)
    assert frames.shape == (5, 64, 64, 3) and frames.std() > 0
    deleted = client.videos.delete(job.id)
    assert deleted.deleted and deleted.id == job.id
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.videos.retrieve(job.id)


def test_seconds_become_frames_and_json_works(server):
    r = httpx.post(
        f"{server.base_url}/v1/videos",
        json={"prompt": "a fox", "seconds": "0.5", "fps": 8, "num_inference_steps": 1},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 5 and r.headers["x-ditserve-replica"] in r.json()["id"]
    both = {"prompt": "a fox", "seconds": 0.5, "num_frames": 5, "fps": 8, "num_inference_steps": 1}
    r = httpx.post(f"{server.base_url}/v1/videos", json=both, headers=AUTH)  # the same duration twice
    assert r.status_code == 200 and r.json()["num_frames"] == 5, r.text
    # a form whose media type is written in capitals (media types are case-insensitive)
    form = {"prompt": (None, "a fox"), "num_frames": (None, "5"), "num_inference_steps": (None, "1")}
    request = httpx.Request("POST", f"{server.base_url}/v1/videos", files=form, headers=AUTH)
    content_type = request.headers["content-type"].replace("multipart/form-data", "Multipart/Form-Data")
    r = httpx.post(request.url, content=request.read(), headers={**AUTH, "content-type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 5
    # the same form cut off inside the prompt: the parser kept what it had read ("a f"), a 200 for another
    # prompt; now a 400 that says the upload was cut off
    long = {**form, "prompt": (None, "a fox in the snow")}
    request = httpx.Request("POST", f"{server.base_url}/v1/videos", files=long, headers=AUTH)
    body = request.read()
    cut = body[: body.index(b" in the snow")]
    r = httpx.post(
        request.url, content=cut, headers={**AUTH, "content-type": request.headers["content-type"]}
    )
    assert r.status_code == 400 and "closing boundary is missing" in r.json()["error"]["message"], r.text


def test_form_with_its_file_input_left_empty(server):
    """An HTML form whose file input was left empty sends the part with filename "" and no bytes: no first
    frame (it was refused as a reference on this text-to-video model)."""
    fields = {"prompt": "a fox", "num_frames": "1", "num_inference_steps": "1"}
    parts = [f'Content-Disposition: form-data; name="{k}"\r\n\r\n{v}' for k, v in fields.items()]
    parts.append(
        'Content-Disposition: form-data; name="input_reference"; filename=""\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    )  # as a browser sends it (httpx leaves an empty filename out)
    body = "".join(f"--XX\r\n{part}\r\n" for part in parts) + "--XX--\r\n"
    form = {**AUTH, "content-type": "multipart/form-data; boundary=XX"}
    r = httpx.post(f"{server.base_url}/v1/videos", content=body.encode(), headers=form)
    assert r.status_code == 200, r.text


def test_content_before_completion_then_expiry(server, client):
    # the server's most frames and steps, the content asked at once: on a loaded machine the job can still
    # win the race, so a job done first (its content then served) is followed by another, until one is asked
    # for before it is done
    for _ in range(5):
        job = client.videos.create(
            prompt="a slow one", extra_body={"num_frames": 9, "num_inference_steps": 20}
        )
        r = httpx.get(f"{server.base_url}/v1/videos/{job.id}/content", headers=AUTH)
        if r.status_code != 200:
            break
        assert client.videos.retrieve(job.id).status == "completed"
    assert r.status_code == 409 and "completed" in r.json()["error"]["message"]
    done, _ = wait(client, job.id)
    assert done.expires_at == done.completed_at + TTL_S
    time.sleep(TTL_S + 1)
    r = httpx.get(f"{server.base_url}/v1/videos/{job.id}", headers=AUTH)
    assert r.status_code == 404 and "expired" in r.json()["error"]["message"]


def test_grpc_video_job(server):
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=KEY) as c:
        job = c.create_video("waves", num_frames=5, num_inference_steps=2, size="64x64")
        assert job.status in ("queued", "in_progress") and job.num_frames == 5
        frames = decode_mp4(c.wait_video(job.id, poll_s=0.1))
        assert frames.shape == (5, 64, 64, 3)
        # HTTP reports the job's usage as gRPC does, in image responses' shape (OpenAI's token fields); it
        # was the engine's own ({"text_tokens": ..., "transformer_forwards": ...}, no input_tokens)
        usage = c.get_video(job.id).usage
        details = usage.input_tokens_details
        assert usage.input_tokens == details.text_tokens > 0 and usage.transformer_forwards > 0
        expected = {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {
                "text_tokens": details.text_tokens,
                "image_tokens": details.image_tokens,
            },
            "output_tokens": usage.output_tokens,
            "total_tokens": usage.total_tokens,
            "transformer_forwards": usage.transformer_forwards,
            "cached_forwards": usage.cached_forwards,
            "cache_policy": usage.cache_policy,
        }
        retrieved = httpx.get(f"{server.base_url}/v1/videos/{job.id}", headers=AUTH).json()
        listed = httpx.get(f"{server.base_url}/v1/videos", params={"limit": 100}, headers=AUTH).json()
        assert retrieved["usage"] == expected, retrieved
        assert [v["usage"] for v in listed["data"] if v["id"] == job.id] == [expected], listed
        assert c.delete_video(job.id).deleted
        with pytest.raises(grpc.RpcError) as info:
            c.get_video(job.id)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with Client(f"127.0.0.1:{server.grpc_port}") as c:
        # without the key every call is refused before its fields are looked at (CloseSession's empty id
        # was INVALID_ARGUMENT), as HTTP answers 401 first
        for call in (lambda: c.create_video("waves"), lambda: c.close_session(""), lambda: c.get_video("")):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    # An image call on a video model names the RPC to use (HTTP's message names POST /v1/videos).
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=KEY) as c, pytest.raises(grpc.RpcError) as info:
        c.generate("waves")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "model 'demo-wan' makes videos; use CreateVideo"


def test_grpc_client_takes_videos_above_grpc_default_message_limit():
    """A 640x480 video of 4 s is about 5 MB, above gRPC's default 4 MiB for a received message; the client
    failed with RESOURCE_EXHAUSTED. The limit is the client channel's, so a plain gRPC server answers here."""
    from concurrent import futures

    from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc

    mp4 = bytes(range(256)) * (5 * 2**20 // 256)

    class Videos(pb_grpc.DitServeServicer):
        def GetVideoContent(self, request, context):
            return pb.VideoContent(id=request.id, mp4=mp4, media_type="video/mp4")

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_DitServeServicer_to_server(Videos(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        with Client(f"127.0.0.1:{port}") as c:
            assert c.video_content("r.1f") == mp4
    finally:
        grpc_server.stop(None)


def test_list_pages_variants_and_remix(server, client):
    """Two jobs listed oldest first one per page (the client follows the cursor), the first's thumbnail and
    spritesheet, then a remix: the same video settings and seed with another prompt."""
    settings = {"num_frames": 5, "num_inference_steps": 2, "seed": 5, "fps": 8}
    first = client.videos.create(prompt="waves on a beach", size="64x48", extra_body=settings)
    second = client.videos.create(prompt="a fox in snow", size="64x48", extra_body=settings)
    first, _ = wait(client, first.id)
    wait(client, second.id)
    ours = [second.id, first.id]  # newest first
    newest_first = [v.id for v in client.videos.list() if v.id in ours]
    assert newest_first == ours
    pages = client.videos.list(limit=1, order="asc")
    assert len(pages.data) == 1 and pages.has_more
    listed = [v for v in pages if v.id in ours]  # the client asks for the next page after last_id
    assert [v.id for v in listed] == ours[::-1]
    assert all(v.status == "completed" and v.size == "64x48" and v.model == "demo-wan" for v in listed)

    mp4 = client.videos.download_content(first.id)
    assert mp4.response.headers["accept-ranges"] == "bytes"
    frames = decode_mp4(mp4.read())
    # byte ranges, as players ask to seek (and Safari before it plays a video at all)
    url, size = f"{server.base_url}/v1/videos/{first.id}/content", len(mp4.read())
    for asked, (start, end) in (("0-1", (0, 2)), ("100-", (100, size)), ("-50", (size - 50, size))):
        r = httpx.get(url, headers={**AUTH, "range": f"bytes={asked}"})
        assert r.status_code == 206 and r.content == mp4.read()[start:end], (asked, r.status_code)
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
        assert r.headers["content-type"] == "video/mp4"
    r = httpx.get(url, headers={**AUTH, "range": "bytes=0-1,5-9"})  # several ranges: the whole video
    assert r.status_code == 200 and r.content == mp4.read()
    r = httpx.head(url, headers=AUTH)  # what a player or downloader asks first: the size and type (was 405)
    assert r.status_code == 200 and not r.content and int(r.headers["content-length"]) == size
    assert r.headers["content-type"] == "video/mp4" and r.headers["accept-ranges"] == "bytes"
    thumb = client.videos.download_content(first.id, variant="thumbnail")
    assert thumb.response.headers["content-type"] == "image/webp"
    image = Image.open(io.BytesIO(thumb.read()))
    assert image.format == "WEBP" and image.size == (64, 48)
    assert psnr(png_pixels(thumb.read()), frames[0]) >= 25  # the first frame, lossy
    sheet = client.videos.download_content(first.id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    grid = png_pixels(sheet.read())
    assert grid.shape == (2 * 48, 4 * 64, 3)  # 5 frames, 4 a row
    assert psnr(grid[48:, :64], frames[4]) >= 25  # the last frame starts the second row

    remix = client.videos.remix(first.id, prompt="waves at night")
    assert remix.remixed_from_video_id == first.id and remix.id not in ours
    assert remix.prompt == "waves at night" and remix.size == "64x48" and remix.seconds == first.seconds
    done, _ = wait(client, remix.id)
    assert done.status == "completed" and done.remixed_from_video_id == first.id
    remixed = decode_mp4(client.videos.download_content(remix.id).read())
    assert remixed.shape == frames.shape and not (remixed == frames).all()  # another prompt, same seed
    for video_id in (*ours, remix.id):
        client.videos.delete(video_id)
    assert not [v for v in client.videos.list() if v.id in (*ours, remix.id)]


def test_list_pages_past_a_deleted_cursor(server, client):
    """Deleting each video as the client's pages yield it (one a page, so each is the next page's cursor):
    the page after a deleted video's id is the rest, as after a live one; it was a 404 that ended the loop."""
    ours = []
    for _ in range(3):
        job = client.videos.create(prompt="a", extra_body={"num_frames": 1, "num_inference_steps": 1})
        ours.append(wait(client, job.id)[0].id)
    seen = []
    for video in client.videos.list(limit=1, order="asc"):
        if video.id in ours:
            seen.append(video.id)
            client.videos.delete(video.id)
    assert seen == ours
    with pytest.raises(openai.NotFoundError) as info:  # not an id: no place in the listing
        client.videos.list(after="nosuch.cursor")
    assert info.value.body["param"] == "after"


def test_list_content_and_remix_bad_input(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.list(after="nosuch.cursor")
    assert info.value.body["param"] == "after" and "after" in info.value.message
    for query, param in (({"limit": 0}, "limit"), ({"limit": "ten"}, "limit"), ({"order": "up"}, "order")):
        r = httpx.get(f"{server.base_url}/v1/videos", params=query, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    job = client.videos.create(prompt="a", extra_body={"num_frames": 1, "num_inference_steps": 1})
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.download_content(job.id, variant="poster")
    assert info.value.body["param"] == "variant"
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.remix(job.id, prompt=" ")
    assert info.value.body["param"] == "prompt"
    # and the served schema says so, as for a new video (it took any string: schemathesis sent "\t", a 400)
    schemas = httpx.get(f"{server.base_url}/openapi.json").json()["components"]["schemas"]
    remix_prompt = schemas["VideoRemixRequest"]["properties"]["prompt"]
    create_prompt = schemas["VideoCreateRequest"]["properties"]["prompt"]
    assert remix_prompt["pattern"] == create_prompt["pattern"] and remix_prompt["pattern"]
    assert remix_prompt["maxLength"] == create_prompt["maxLength"] > 0
    with pytest.raises(openai.NotFoundError):
        client.videos.remix(job.id.split(".")[0] + ".nosuch", prompt="a")
    # ids this server never issued, of no replica: not found, never a failed job or a deletion
    for video_id in ("my.video", "video_68d7", job.id.split(".")[0] + ".1f", job.id.upper()):
        for call in (client.videos.retrieve, client.videos.delete, client.videos.download_content):
            with pytest.raises(openai.NotFoundError) as info:
                call(video_id)
            assert info.value.body["param"] == "video_id", (video_id, call)
    # An empty id names no video: a 404 naming video_id on every method and sub-route, after the key is
    # checked. DELETE /v1/videos/ was a 307 to the list (a client following it got a 405), the sub-routes a
    # bare 404 naming nothing.
    for method, path in (
        ("DELETE", "/v1/videos/"),
        ("GET", "/v1/videos//content"),
        ("HEAD", "/v1/videos//content"),
        ("POST", "/v1/videos//remix"),
    ):
        body = {"prompt": "a"} if method == "POST" else None
        url = f"{server.base_url}{path}"
        assert httpx.request(method, url, json=body).status_code == 401, (method, path)
        r = httpx.request(method, url, json=body, headers=AUTH)
        assert r.status_code == 404, (method, path, r.status_code, r.headers)
        if method != "HEAD":
            error = r.json()["error"]
            assert error["param"] == "video_id" and "empty" in error["message"], (method, path, error)
    # "/v1/videos/" lists and creates as "/v1/videos" does (they were 307 redirects)
    r = httpx.get(f"{server.base_url}/v1/videos/", params={"limit": 1, "order": "desc"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "list" and len(r.json()["data"]) == 1, r.text
    one = {"prompt": "a", "num_frames": 1, "num_inference_steps": 1}
    r = httpx.post(f"{server.base_url}/v1/videos/", json=one, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "video", r.text
    after = httpx.get(f"{server.base_url}/v1/videos", params={"after": r.json()["id"]}, headers=AUTH)
    assert after.status_code == 200 and r.json()["id"] not in [v["id"] for v in after.json()["data"]]
    wait(client, r.json()["id"])
    for path in ("/v1/videos/edits", "/v1/videos/extensions", "/v1/videos/characters"):
        assert httpx.post(f"{server.base_url}{path}", data={"prompt": "a"}).status_code == 401, path
        r = httpx.post(f"{server.base_url}{path}", data={"prompt": "a"}, headers=AUTH)
        assert r.status_code == 501 and "POST /v1/videos" in r.json()["error"]["message"], (path, r.text)
    done, _ = wait(client, job.id)  # the server kept serving
    assert done.status == "completed"


def test_grpc_list_variants_and_remix(server):
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=KEY) as c:
        job = c.create_video("waves", num_frames=5, num_inference_steps=2, size="64x48", seed=1)
        mp4 = c.wait_video(job.id, poll_s=0.1)
        frames = decode_mp4(mp4)
        assert c.video_content(job.id, variant="video") == mp4  # the default variant named (it gave b"")

        def call(method: str, request):
            return getattr(c.stub, method)(request, metadata=c.metadata, timeout=120)

        page = c.list_videos(limit=100)
        assert job.id in [v.id for v in page.data] and page.last_id == page.data[-1].id
        thumb = call("GetVideoContent", pb.VideoRef(id=job.id, variant="thumbnail"))
        assert thumb.media_type == "image/webp" and not thumb.mp4
        assert psnr(png_pixels(thumb.image), frames[0]) >= 25
        assert c.video_content(job.id, variant="thumbnail") == thumb.image
        sheet = call("GetVideoContent", pb.VideoRef(id=job.id, variant="spritesheet"))
        assert sheet.media_type == "image/jpeg" and png_pixels(sheet.image).shape == (96, 256, 3)
        remix = c.remix_video(job.id, "waves at night")
        assert remix.remixed_from_video_id == job.id and remix.size == "64x48"
        assert decode_mp4(c.wait_video(remix.id, poll_s=0.1)).shape == frames.shape
        for method, request, param in (
            ("GetVideoContent", pb.VideoRef(id=job.id, variant="poster"), "variant"),
            ("ListVideos", pb.ListVideosRequest(limit=0), "limit"),
            ("ListVideos", pb.ListVideosRequest(order="up"), "order"),
            ("ListVideos", pb.ListVideosRequest(after="nosuch.cursor"), "after"),
            ("RemixVideo", pb.RemixVideoRequest(id=job.id, prompt=""), "prompt"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(method, request)
            assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert info.value.details().startswith(param), (method, info.value.details())
        # a well-formed id of a replica that is no longer there: a failed job (as over HTTP), never INTERNAL
        gone = "gone." + job.id.rpartition(".")[2]
        lost = call("GetVideo", pb.VideoRef(id=gone))
        assert lost.status == "failed" and "gone" in lost.error, lost
        http = httpx.get(f"{server.base_url}/v1/videos/{gone}", headers=AUTH).json()["error"]
        assert (
            (lost.error_code, lost.error) == (http["code"], http["message"]) == ("replica_gone", lost.error)
        )
        with pytest.raises(grpc.RpcError) as info:
            call("GetVideoContent", pb.VideoRef(id=gone))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith(f"video_id: video {gone!r} failed"), info.value.details()
        assert "replica" in info.value.details()
        assert call("DeleteVideo", pb.VideoRef(id=gone)).deleted
        for video_id in (job.id, remix.id):
            c.delete_video(video_id)


BAD = {
    "no key": ({"prompt": "a"}, {}, 401, "API key"),
    "frames not 4k+1": ({"prompt": "a", "num_frames": 6}, AUTH, 400, "num_frames"),
    "frames above max": ({"prompt": "a", "num_frames": 13}, AUTH, 400, "num_frames"),
    "seconds above max": (
        {"prompt": "a", "seconds": "4"},  # as OpenAI's clients send it
        AUTH,
        400,
        "seconds: 4 s at 16 fps is 65 frames, above the maximum 9; ask at most 0.5625 s (or a lower fps)",
    ),
    "seconds not a number": ({"prompt": "a", "seconds": "long"}, AUTH, 400, "seconds"),
    "seconds true": ({"prompt": "a", "seconds": True}, AUTH, 400, "seconds: a number, not true"),
    "frames true": ({"prompt": "a", "num_frames": True}, AUTH, 400, "num_frames: a number, not true"),
    "seconds NaN": ({"prompt": "a", "seconds": "nan"}, AUTH, 400, "seconds: Input should be a finite number"),
    "seconds and frames disagree": (
        {"prompt": "a", "seconds": "4", "num_frames": 5},
        AUTH,
        400,
        "seconds: 4 s at 16 fps is 65 frames, but num_frames is 5",
    ),
    "guidance NaN": (
        {"prompt": "a", "guidance_scale": "NaN"},
        AUTH,
        400,
        "guidance_scale: Input should be a finite",
    ),
    "size above max": ({"prompt": "a", "size": "128x128"}, AUTH, 400, "size"),
    # 0 is a multiple of every size multiple: the side is too small, not a wrong multiple
    "form-encoded body": (
        "prompt=a+red+circle&num_frames=5",
        AUTH,
        400,
        "not valid JSON: send a JSON object or a multipart/form-data form",
    ),
    "size of zero": (
        {"prompt": "a", "size": "0x64"},
        AUTH,
        400,
        "size: 0x64 is below the minimum of 16 pixels",
    ),
    "unknown model": ({"prompt": "a", "model": "sora-2"}, AUTH, 400, "model"),
    "missing prompt": ({"seconds": 1}, AUTH, 400, "prompt"),
    "negative prompt too long": (
        {"prompt": "a", "negative_prompt": "b" * 5000},
        AUTH,
        400,
        "negative_prompt: 5000",
    ),
    "file upload": (None, AUTH, 400, "input_reference"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_video_bad_input(server, case):
    body, headers, status, needle = BAD[case]
    if body is None:  # multipart with a file: not supported, said so
        files = {"input_reference": ("ref.png", b"\x89PNG", "image/png")}
        r = httpx.post(f"{server.base_url}/v1/videos", data={"prompt": "a"}, files=files, headers=headers)
    elif isinstance(body, str):  # as curl -d sends it
        form = headers | {"content-type": "application/x-www-form-urlencoded"}
        r = httpx.post(f"{server.base_url}/v1/videos", content=body, headers=form)
    else:
        r = httpx.post(f"{server.base_url}/v1/videos", json=body, headers=headers)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(
        f"{server.base_url}/v1/videos",
        json={"prompt": "a", "num_frames": 1, "num_inference_steps": 1},
        headers=AUTH,
    )
    assert ok.status_code == 200, ok.text


def test_images_on_a_video_model_and_auth_for_generation(server, client):
    with pytest.raises(openai.BadRequestError, match="POST /v1/videos"):
        client.images.generate(model="demo-wan", prompt="a fox")
    r = httpx.post(f"{server.base_url}/v1/images/generations", json={"prompt": "a fox"})
    assert r.status_code == 401


def test_step_cache_from_openai_client_and_form_json(server, client):
    """OpenAI's client sends extra_body's cache mapping as form fields cache[policy], cache[threshold]; a form
    may also carry it as JSON text. Both reach the job (its usage names the policy)."""
    settings = {"num_frames": 5, "num_inference_steps": 4, "seed": 2}
    job = client.videos.create(
        prompt="waves",
        size="64x64",
        extra_body={**settings, "cache": {"policy": "fbcache", "threshold": 0.5}},
    )
    done, _ = wait(client, job.id)
    assert done.status == "completed" and done.usage["cache_policy"] == "fbcache", done
    form = {"prompt": "waves", "cache": '{"policy": "taylorseer", "interval": 2}'}
    form |= {k: str(v) for k, v in settings.items()}
    r = httpx.post(
        f"{server.base_url}/v1/videos", files={k: (None, v) for k, v in form.items()}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    done, _ = wait(client, r.json()["id"])
    assert done.status == "completed" and done.usage["cache_policy"] == "taylorseer", done
    for extra, param in (
        ({"cache": {"policy": "sometimes"}}, "cache"),
        ({"cache": {"threshold": "high"}}, "cache"),
        ({"lora": [{"name": "style"}]}, "lora"),
        # two items: lora[][name] twice, which was refused as the field "lora[][name]" given more than once
        ({"lora": [{"name": "style"}, {"name": "style", "scale": 0.5}]}, "lora"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.videos.create(prompt="waves", extra_body=extra)
        assert info.value.body["param"].startswith(param), (extra, info.value.body)
        if param == "lora":
            assert "send it as JSON text in lora" in info.value.body["message"], info.value.body


def test_lora_per_video(server, client):
    """An adapter named by a video request changes that video, from the openai client (lora[name] form
    fields), JSON and gRPC alike; an adapter that is not loaded is a 400 naming lora."""
    settings = {"num_frames": 5, "num_inference_steps": 2, "seed": 4}

    def frames(extra: dict) -> object:
        job = client.videos.create(prompt="a fox", size="64x64", extra_body={**settings, **extra})
        done, _ = wait(client, job.id)
        assert done.status == "completed", done
        return decode_mp4(client.videos.download_content(job.id).read())

    plain = frames({})
    styled = frames({"lora": {"name": "style", "scale": 1.0}})
    assert psnr(styled, plain) < 30
    assert psnr(frames({"lora": {"name": "style", "scale": 0.0}}), plain) >= 40
    r = httpx.post(
        f"{server.base_url}/v1/videos",
        json={"prompt": "a fox", "size": "64x64", **settings, "lora": [{"name": "style"}]},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    done, _ = wait(client, r.json()["id"])
    assert psnr(decode_mp4(client.videos.download_content(done.id).read()), styled) >= 40
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=KEY) as c:
        job = c.create_video("a fox", size="64x64", **settings, lora=[pb.LoRARef(name="style")])
        assert psnr(decode_mp4(c.wait_video(job.id, poll_s=0.1)), styled) >= 40
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a fox", extra_body={"lora": {"name": "nope"}})
    assert info.value.body["param"] == "lora" and "nope" in info.value.message
