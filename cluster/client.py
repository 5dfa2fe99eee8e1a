"""A small Python client of ditserve's gRPC API (``ditserve.v1.DitServe``), plus an SSE helper for HTTP.

    >>> from ditserve.cluster.client import Client
    >>> with Client("localhost:9000", api_key=None) as c:
    ...     png = c.generate("a red fox", size="64x64", num_inference_steps=4)[0]
    ...     for step, total, image in c.generate_stream("a red fox", size="64x64"):
    ...         print(step, total)               # image is None until the last event
    ...     edited = c.edit_image([open("in.png", "rb").read()], "make it blue", strength=0.6)[0]
    ...     job = c.create_video("waves", num_frames=9)
    ...     mp4 = c.wait_video(job.id)           # polls GetVideo, then GetVideoContent
    ...     page = c.list_videos(limit=10)       # newest first; page.has_more, page.last_id

Errors are ``grpc.RpcError`` with the server's code (INVALID_ARGUMENT, NOT_FOUND, ...) and a message
naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc

from .grpc_gen import ditserve_pb2 as pb
from .grpc_gen import ditserve_pb2_grpc as pb_grpc

# The Serve application ditserve deploys (config.APP_NAME, not imported: that module loads torch).
APPLICATION = "ditserve"


class Client:
    def __init__(
        self,
        target: str = "localhost:9000",
        api_key: str | None = None,
        timeout_s: float = 600.0,
        application: str = APPLICATION,
    ):
        # gRPC's own limit on a received message is 4 MiB: an ordinary video (640x480, 4 s) is larger
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
        self.stub = pb_grpc.DitServeStub(self.channel)
        # Serve's gRPC proxy picks the application by this metadata; without it, a cluster that serves other
        # applications too (ditserve serve --address) answers NOT_FOUND "Application metadata not set".
        self.metadata = [("application", application)]
        if api_key:
            self.metadata.append(("authorization", f"Bearer {api_key}"))
        self.timeout_s = timeout_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=self.timeout_s)

    # -- images ------------------------------------------------------------------------------------------
    def generate(self, prompt: str, **fields: Any) -> list[bytes]:
        """A list of PNGs (bytes), one per image (``n``, default 1: ``generate(...)[0]`` is the image);
        ``fields`` are GenerateRequest's (size, n, seed, num_inference_steps, lora...)."""
        return list(self._call("Generate", _image_request(prompt, fields)).images)

    def generate_stream(self, prompt: str, **fields: Any) -> Iterator[tuple[int, int, bytes | None]]:
        """(step, total, preview) per denoising step, then (total, total, first PNG). ``preview`` is None unless
        asked (``preview=True``, or ``partial_images=N`` for the last N steps): a low-res PNG of the latents."""
        yield from _image_events(self._call("GenerateStream", _image_request(prompt, fields)))

    def edit_image_stream(
        self, images: list[bytes], prompt: str, **fields: Any
    ) -> Iterator[tuple[int, int, bytes | None]]:
        """``edit_image`` as ``generate_stream`` gives its steps (``partial_images=N`` for previews)."""
        yield from _image_events(self._call("EditImageStream", _edit_request(images, prompt, fields)))

    def edit_image(self, images: list[bytes], prompt: str, **fields: Any) -> list[bytes]:
        """Images (encoded bytes) from one or more input images (PNG / JPEG / WebP bytes; several for
        multi-reference models); ``fields`` are EditImageRequest's (mask, size, n, strength, seed, lora...)."""
        return list(self._call("EditImage", _edit_request(images, prompt, fields)).images)

    # -- videos ------------------------------------------------------------------------------------------
    def create_video(self, prompt: str, **fields: Any) -> pb.VideoJob:
        """A video job; ``fields`` are CreateVideoRequest's (size, num_frames, seed, lora...)."""
        return self._call("CreateVideo", pb.CreateVideoRequest(prompt=prompt, **_with_loras(fields)))

    def get_video(self, video_id: str) -> pb.VideoJob:
        return self._call("GetVideo", pb.VideoRef(id=video_id))

    def delete_video(self, video_id: str) -> pb.VideoJob:
        return self._call("DeleteVideo", pb.VideoRef(id=video_id))

    def video_content(self, video_id: str, variant: str | None = None) -> bytes:
        """The MP4; ``variant="thumbnail"`` (WebP) or ``"spritesheet"`` (JPEG) gives that image instead."""
        if variant is None:
            return self._call("GetVideoContent", pb.VideoRef(id=video_id)).mp4
        content = self._call("GetVideoContent", pb.VideoRef(id=video_id, variant=variant))
        return content.mp4 if variant == "video" else content.image

    def list_videos(
        self, after: str | None = None, limit: int | None = None, order: str | None = None
    ) -> pb.VideoList:
        """One page of video jobs (``order`` "desc", the default, or "asc" by creation; ``after`` = the previous
        page's ``last_id``)."""
        fields = {k: v for k, v in (("after", after), ("limit", limit), ("order", order)) if v is not None}
        return self._call("ListVideos", pb.ListVideosRequest(**fields))

    def remix_video(self, video_id: str, prompt: str) -> pb.VideoJob:
        """A new job with a finished video's settings and a new prompt."""
        return self._call("RemixVideo", pb.RemixVideoRequest(id=video_id, prompt=prompt))

    def wait_video(self, video_id: str, poll_s: float = 0.5, timeout_s: float = 600.0) -> bytes:
        """Poll until the job completes; its MP4 bytes (RuntimeError when it failed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.get_video(video_id)
            if job.status == "completed":
                return self.video_content(video_id)
            if job.status == "failed":
                raise RuntimeError(f"video {video_id} failed: {job.error}")
            time.sleep(poll_s)
        raise TimeoutError(f"video {video_id} did not complete in {timeout_s}s")

    # -- sessions and admin -------------------------------------------------------------------------------
    def open_session(self, size: str | None = None, model: str | None = None) -> str:
        fields = {k: v for k, v in (("size", size), ("model", model)) if v}
        return self._call("OpenSession", pb.OpenSessionRequest(**fields)).id

    def session_step(self, session_id: str, prompt: str, **fields: Any) -> Iterator[pb.GenerateEvent]:
        request = pb.SessionGenerateRequest(session_id=session_id, prompt=prompt, **_with_loras(fields))
        yield from self._call("SessionGenerateStream", request)

    def session_generate(self, session_id: str, prompt: str, **fields: Any) -> pb.GenerateResponse:
        """One session step, its result only (the images, seed and ``session_step``)."""
        request = pb.SessionGenerateRequest(session_id=session_id, prompt=prompt, **_with_loras(fields))
        return self._call("SessionGenerate", request)

    def close_session(self, session_id: str) -> None:
        self._call("CloseSession", pb.SessionRef(id=session_id))

    def list_loras(self) -> pb.ListLoRAsResponse:
        return self._call("ListLoRAs", pb.Empty())

    def list_models(self) -> pb.ListModelsResponse:
        return self._call("ListModels", pb.Empty())

    def list_replicas(self) -> pb.ListReplicasResponse:
        """Every engine replica with its health, device and layout (``details`` too with the admin key)."""
        return self._call("ListReplicas", pb.Empty())

    def health(self) -> str:
        """ "ok" when every replica the deployment asks for serves; otherwise grpc.RpcError UNAVAILABLE."""
        return self._call("Health", pb.Empty()).status

    # -- control operations (the admin key) ---------------------------------------------------------------
    def load_lora(
        self, name: str, path: str, scale: float | None = None, target: str | None = None
    ) -> pb.AdminReply:
        """Load (or replace) adapter ``name`` from ``path`` on every replica; ``target``: the expert the file
        loads into (``transformer_2``: Wan 2.2 A14B's low-noise expert)."""
        fields = {k: v for k, v in (("scale", scale), ("target", target)) if v is not None}
        return self._call("LoadLoRA", pb.LoadLoRARequest(name=name, path=path, **fields))

    def unload_lora(self, name: str) -> pb.AdminReply:
        return self._call("UnloadLoRA", pb.UnloadLoRARequest(name=name))

    def update_weights(self, path: str) -> pb.AdminReply:
        """Replace the served transformer weights on every replica with ``path``'s."""
        return self._call("UpdateWeights", pb.UpdateWeightsRequest(path=path))

    def release_memory(self) -> pb.AdminReply:
        return self._call("ReleaseMemory", pb.Empty())

    def resume_memory(self) -> pb.AdminReply:
        return self._call("ResumeMemory", pb.Empty())

    def shutdown(self) -> pb.AdminReply:
        """Stop serving for good: every replica frees its engine and takes no more work (Health then answers
        UNAVAILABLE); restart the service to serve again."""
        return self._call("Shutdown", pb.Empty())


def _lora_ref(ref: Any) -> pb.LoRARef:
    if isinstance(ref, pb.LoRARef):
        return ref
    return pb.LoRARef(**(ref if isinstance(ref, dict) else {"name": ref}))


def _with_loras(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with ``lora`` as HTTP's field takes it (one adapter or a list of them; each a name, a
    ``{"name": ..., "scale": ...}`` mapping or a LoRARef) made the messages' LoRARef list."""
    if fields.get("lora") is None:
        return {k: v for k, v in fields.items() if k != "lora"}
    lora = fields["lora"]
    refs = [lora] if isinstance(lora, (str, dict, pb.LoRARef)) else list(lora)
    return {**fields, "lora": [_lora_ref(r) for r in refs]}


def _image_request(prompt: str, fields: dict[str, Any]) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, **_with_loras(fields))


def _edit_request(images: list[bytes], prompt: str, fields: dict[str, Any]) -> pb.EditImageRequest:
    return pb.EditImageRequest(image=list(images), prompt=prompt, **_with_loras(fields))


def _image_events(events: Iterator[pb.GenerateEvent]) -> Iterator[tuple[int, int, bytes | None]]:
    total = 0
    for event in events:
        if event.HasField("progress"):
            total = event.progress.total
            yield event.progress.step, total, event.progress.preview or None
        else:
            yield total, total, event.result.images[0]


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) from the lines of a ``text/event-stream`` body (e.g. httpx's ``iter_lines``);
    stops at ``data: [DONE]``."""
    name = "message"
    for line in lines:
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = line.split(":", 1)[1].strip()
            if data == "[DONE]":
                return
            yield name, json.loads(data)
            name = "message"
