"""Realtime video sessions against a real ``ditserve serve --dp-size 2`` on a tiny AnyFlow-FAR folder, with
a client written from SGLang Diffusion's ``/v1/realtime_video`` protocol (msgpack maps in binary frames over
``websockets``): ordered chunks, a prompt event that changes the following chunks only, the same init giving
the same frames on the other replica, errors for bad inits and events on a socket that keeps serving, and
``session_gone`` (then close 4410) when the owner replica's process is killed."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.families.anyflow import build_folder
from tests.helpers import ServeProcess, png_pixels

KEY = "realtime-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
INIT = {
    "type": "init", "prompt": "a red fox running", "size": "64x64", "num_frames": 8, "seed": 5,
    "num_inference_steps": 2, "realtime_output_format": "raw",
}  # fmt: skip
# A session that outlasts what the tests do meanwhile (without max_chunks a session runs to the server's
# chunk limit, which the tiny model's 64x64 chunks reach within seconds unpaced): paced at 1 fps, it sends a
# chunk of 8 frames every 8 s and its replica denoises one chunk ahead, then idles (unpaced, the replicas
# holding slots denoised all along, taking the 2-core machine from the rest of the test).
HOLD = {**INIT, "fps": 1, "realtime_output_pacing": True}
# A session whose chunks take long to denoise (unpaced).
SLOW = {**INIT, "size": "256x256", "num_frames": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_folder(tmp_path_factory.mktemp("anyflow") / "tiny-anyflow-far")
    proc = ServeProcess(
        "--model", str(folder), "--dp-size", "2", "--api-key", KEY, "--max-realtime-sessions", "1",
        "--max-width", "256", "--max-height", "256", "--max-image-pixels", str(128 * 128),
        timeout_s=300,
    )  # fmt: skip
    proc.folder = folder
    yield proc
    proc.stop()


def image_bytes(width: int, height: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


class Client:
    """What an SGLang realtime client does: msgpack maps both ways, a header map then a binary frame for
    large payloads."""

    def __init__(self, server: ServeProcess):
        self._connection = connect(f"ws://127.0.0.1:{server.port}/v1/realtime_video/generate", max_size=None)
        self.ws = self._connection.__enter__()
        self.close_code: int | None = None
        self.close_reason = ""

    def send(self, message: dict | bytes) -> None:
        self.ws.send(message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True))

    def recv(self, timeout: float = 120) -> dict | None:
        """The next message (a header's payload attached), or None once the server closed."""
        try:
            message = msgpack.unpackb(self.ws.recv(timeout), raw=False)
            if message["type"] == "frame_batch_header":
                message["payload"] = self.ws.recv(timeout)
            return message
        except ConnectionClosed as exc:
            self.close_code = exc.rcvd.code if exc.rcvd else None
            self.close_reason = exc.rcvd.reason if exc.rcvd else ""
            return None

    def error(self) -> dict:
        message = self.recv()
        assert message is not None and message["type"] == "error", message
        return message

    def chunk(self) -> dict | None:
        """One chunk's frames and stats, checked against the protocol; None once the server closed."""
        frames, batches = [], []
        while True:
            message = self.recv()
            if message is None:
                return None
            assert message["type"] in ("frame_batch", "frame_batch_header", "chunk_stats"), message
            if message["type"] == "chunk_stats":
                break
            batches.append(message)
            per = message["bytes_per_frame"]
            assert message["content_type"] == "application/x-raw-rgb" and message["channels"] == 3
            assert len(message["payload"]) == message["num_frames"] * per == message["total_size"]
            assert (message["payload"] and len(message["payload"]) >= 64 * 1024) == (
                message["type"] == "frame_batch_header"
            )
            frames.append(
                np.frombuffer(message["payload"], np.uint8).reshape(
                    -1, message["height"], message["width"], 3
                )
            )
        first = batches[0]
        assert [b["frame_batch_index"] for b in batches] == list(range(first["num_frame_batches"]))
        assert batches[-1]["is_final_frame_batch"] and not any(
            b["is_final_frame_batch"] for b in batches[:-1]
        )
        for b in batches + [message]:
            assert b["chunk_index"] == first["chunk_index"] and b["replica"] == first["replica"]
            assert b["session_id"].startswith(first["replica"] + ".")
        assert message["num_frames"] == sum(len(f) for f in frames)
        return {
            "index": first["chunk_index"],
            "frames": np.concatenate(frames),
            "event_id": first.get("event_id"),
            "replica": first["replica"],
            "stats": message,
        }

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


def run_session(server, init: dict, *, on_chunk=None) -> tuple[list[dict], Client]:
    client = Client(server)
    client.send(init)
    chunks = []
    while (chunk := client.chunk()) is not None:
        chunks.append(chunk)
        if on_chunk is not None:
            on_chunk(client, chunk)
    return chunks, client


def replicas(server) -> list[dict]:
    r = httpx.get(f"{server.base_url}/v1/replicas", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def test_ordered_chunks_a_prompt_event_and_the_same_init_on_the_other_replica(server):
    # Chunks of the tiny model take a fraction of a second: 8 of them leave a loaded machine time to deliver
    # the event (with 4, a CI run under load saw the event reach the replica after the last chunk started,
    # as the protocol allows: then no chunk was made with it).
    init = {**INIT, "max_chunks": 8}
    sent = {}

    def change_prompt(client, chunk):
        if chunk["index"] == 0:
            client.send(
                {"type": "event", "kind": "prompt", "payload": "a blue whale at night", "event_id": 7}
            )
            sent["after"] = 0

    changed, client = run_session(server, init, on_chunk=change_prompt)
    assert (client.close_code, client.close_reason) == (1000, "generation complete")
    assert [c["index"] for c in changed] == list(range(8))
    assert [c["frames"].shape for c in changed] == [(1, 64, 64, 3)] + [(8, 64, 64, 3)] * 7
    owner = changed[0]["replica"]
    assert {c["replica"] for c in changed} == {owner}  # every chunk from the owner
    assert owner in {r["replica_id"] for r in replicas(server)}

    # The event applies from the next chunk not yet queued (chunk 1 was queued as chunk 0's frames came;
    # chunk 2 too when chunk 1 was done before the event arrived): that chunk and the later ones echo it, those before do not.
    applied = next(c["index"] for c in changed if c["event_id"] == 7)
    assert 1 <= applied < 8
    assert all(c["event_id"] is None for c in changed[:applied])
    assert all(c["event_id"] == 7 for c in changed[applied:])  # every chunk made with its prompt

    same, other = run_session(server, init)
    assert other.close_code == 1000
    assert same[0]["replica"] != owner  # round-robin put the second session on the other replica
    for a, b in zip(changed[:applied], same[:applied], strict=True):
        np.testing.assert_array_equal(a["frames"], b["frames"])
    for a, b in zip(changed[applied:], same[applied:], strict=True):
        assert not np.array_equal(a["frames"], b["frames"])  # the new prompt, from that chunk on


def test_bad_inits_and_events_answer_errors_and_the_socket_keeps_serving(server):
    client = Client(server)
    client.send({**INIT, "size": "70x64"})
    assert client.error()["content"].startswith("size")
    client.send({k: v for k, v in INIT.items() if k != "prompt"})
    assert client.error()["content"].startswith("prompt")
    client.send({**INIT, "model": "not-this-one"})
    assert client.error()["content"].startswith("model")
    client.send({**INIT, "num_frames": 6})
    assert client.error()["content"].startswith("num_frames")
    client.send(b"\xc1 not msgpack")
    assert client.error()["content"].startswith("message")
    client.send({**INIT, "max_chunks": 3, "realtime_output_format": "jpeg"})
    client.send({"type": "event", "kind": "teleport", "payload": 1, "event_id": 1})
    client.send({"type": "event", "kind": "prompt", "payload": "", "event_id": 2})
    client.send({"type": "event", "kind": "heartbeat", "event_id": 3})
    errors, kinds, indexes = [], [], []
    while (message := client.recv()) is not None:
        if message["type"] == "error":
            errors.append(message["content"])
        elif message["type"] != "chunk_stats":
            kinds.append(message["content_type"])
            assert all(p > 0 for p in message["payload_lengths"])
            assert sum(message["payload_lengths"]) == len(message["payload"])
            indexes.append(message["chunk_index"])
    assert sorted(e.split(":")[0] for e in errors) == ["kind", "payload"]
    assert sorted(set(indexes)) == [0, 1, 2] and set(kinds) == {"image/jpeg"}
    assert client.close_code == 1000


def test_a_session_past_the_replicas_cap_gets_an_error_and_1008(server):
    """--max-realtime-sessions 1 and two replicas: a third open session is refused; closing frees the slots."""
    first, second = Client(server), Client(server)
    first.send({**HOLD, "prompt": "a lighthouse"})  # no max_chunks: both run until closed
    second.send({**HOLD, "prompt": "a forest"})
    owners = {first.chunk()["replica"], second.chunk()["replica"]}
    assert len(owners) == 2
    third = Client(server)
    third.send(INIT)
    refused = third.error()
    assert refused["content"].startswith("max_realtime_sessions") and refused["code"] == "rate_limit_error"
    assert third.recv() is None and third.close_code == 1008
    first.close()
    second.close()
    wait_for(lambda: all(r["realtime_sessions"] == 0 for r in replicas(server)), 60, "sessions released")


def test_an_init_goes_to_a_replica_with_a_free_slot_and_a_reopen_waits_for_the_close(server):
    """--max-realtime-sessions 1 and two replicas, one of them held by a long session: every new session
    opens on the other one, whichever replica round-robin asks first; and a client that drops a session
    mid-chunk and opens the next at once gets it (the init waits for the close), not a refusal."""
    held = Client(server)
    held.send({**HOLD, "prompt": "a lighthouse"})  # no max_chunks: holds its replica's only slot
    owner = held.chunk()["replica"]
    for k in range(2):  # round-robin asks the held replica first for one of any two opens in a row
        chunks, client = run_session(server, {**INIT, "max_chunks": 1, "seed": k})
        assert client.close_code == 1000 and [c["index"] for c in chunks] == [0]
        assert chunks[0]["replica"] != owner
        wait_for(lambda: sum(r["realtime_sessions"] for r in replicas(server)) == 1, 60, "session closed")
    dropped = Client(server)
    dropped.send({**INIT, "prompt": "a forest", "size": "128x128", "num_frames": 16})
    assert dropped.chunk()["index"] == 0  # chunk 1 is being denoised now
    dropped.close()
    chunks, client = run_session(server, {**INIT, "max_chunks": 1})
    assert client.close_code == 1000 and [c["index"] for c in chunks] == [0], client.close_reason
    held.close()
    wait_for(lambda: all(r["realtime_sessions"] == 0 for r in replicas(server)), 60, "sessions released")


def test_clients_closing_as_their_last_chunk_arrives_leave_no_session_held(server):
    """Clients that close the moment their last chunk's stats arrive (the frontend is then closing the
    session on the replica; the client's leaving cancels the socket's handler), just after sessions were
    abandoned mid-chunk on busy replicas: every session is closed on its replica, and a replica's only
    slot takes a new session again."""

    def last_chunk_then_close():
        client = Client(server)
        client.send({**INIT, "max_chunks": 1})
        while (message := client.recv()) is not None and message["type"] != "chunk_stats":
            assert message["type"] != "error", message
        client.close()

    for _ in range(2):
        busy = [Client(server) for _ in range(2)]
        for client in busy:
            client.send({**INIT, "prompt": "a lighthouse", "size": "128x128", "num_frames": 16})
        for client in busy:
            first = client.recv()
            assert first["type"] == "frame_batch", first  # chunk 0 is here, chunk 1 is being denoised
            client.close()
        wait_for(lambda: all(r["realtime_sessions"] == 0 for r in replicas(server)), 60, "abandoned closed")
        with ThreadPoolExecutor(2) as pool:  # both at once: one on each replica
            for closed in [pool.submit(last_chunk_then_close) for _ in range(2)]:
                closed.result()
        wait_for(lambda: all(r["realtime_sessions"] == 0 for r in replicas(server)), 60, "sessions closed")


def test_open_sockets_past_serves_default_request_limit_leave_the_server_serving(server):
    """Six sockets open and idle (Serve takes five requests at once per replica by default, and a WebSocket
    is one request for its whole life): a seventh still opens a session that streams, and the HTTP API
    still answers."""
    idle = [Client(server) for _ in range(6)]
    try:
        chunks, client = run_session(server, {**INIT, "max_chunks": 1})
        assert client.close_code == 1000 and [c["index"] for c in chunks] == [0]
        assert len(replicas(server)) == 2
    finally:
        for socket in idle:
            socket.close()


def test_releasing_memory_ends_running_sessions_and_frees_their_slots(server):
    """A release fails the running session's chunks (session_gone, 4410); after the resume its replica has
    its slot again (--max-realtime-sessions 1): it was held until the idle timeout, refusing new sessions."""
    wait_for(lambda: [r["health"] for r in replicas(server)] == ["ok", "ok"], 150, "both replicas serving")
    client = Client(server)
    client.send({**INIT, "prompt": "a lighthouse"})  # no max_chunks: runs until closed
    assert client.chunk() is not None
    released = httpx.post(f"{server.base_url}/v1/admin/memory/release", headers=ADMIN, timeout=120)
    assert released.status_code == 200, released.text
    errors = []
    while (message := client.recv()) is not None:
        if message["type"] == "error":
            errors.append(message)
    assert [e["code"] for e in errors] == ["session_gone"] and "released" in errors[0]["content"]
    assert client.close_code == 4410
    resumed = httpx.post(f"{server.base_url}/v1/admin/memory/resume", headers=ADMIN, timeout=120)
    assert resumed.status_code == 200, resumed.text
    assert [r["realtime_sessions"] for r in replicas(server)] == [0, 0]
    both = [Client(server), Client(server)]  # one slot on each replica: both open
    for each in both:
        each.send({**HOLD, "max_chunks": 2})
    assert {each.chunk()["replica"] for each in both} == {r["replica_id"] for r in replicas(server)}
    for each in both:
        each.close()


def test_a_weights_update_leaves_a_running_session_streaming(server):
    """A weights update while a session's chunk is being denoised does not end the session (the chunk is not
    failed as a one-shot request is: that answered session_gone); the chunks go on, the next ones from the
    new weights, and the slot is free once it closes."""
    wait_for(lambda: [r["health"] for r in replicas(server)] == ["ok", "ok"], 150, "both replicas serving")
    folder = str(server.folder)
    client = Client(server)
    # 20 steps a chunk: the next chunk is still being denoised when the update comes
    client.send({**SLOW, "prompt": "a lighthouse", "max_chunks": 4, "num_inference_steps": 20})
    assert client.chunk() is not None
    updated = httpx.post(
        f"{server.base_url}/v1/admin/weights", json={"path": folder}, headers=ADMIN, timeout=300
    )
    assert updated.status_code == 200, updated.text
    rest = []
    while (chunk := client.chunk()) is not None:
        rest.append(chunk["index"])
    assert rest == [1, 2, 3] and client.close_code == 1000, (rest, client.close_code, client.close_reason)
    wait_for(lambda: [r["realtime_sessions"] for r in replicas(server)] == [0, 0], 60, "slots free")


def test_killing_the_owner_replica_ends_the_session_with_session_gone(server):
    client = Client(server)
    client.send({**INIT, "prompt": "a lighthouse"})  # no max_chunks: runs until closed
    first = client.chunk()
    assert first is not None and first["index"] == 0
    owner = next(r for r in replicas(server) if r["replica_id"] == first["replica"])
    os.kill(owner["ranks"][0]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    gone = None
    while (message := client.recv(timeout=120)) is not None:
        if message["type"] == "error":
            gone = message
    assert gone is not None and gone["code"] == "session_gone" and first["replica"] in gone["content"]
    assert client.close_code == 4410 and "gone" in client.close_reason
    assert time.monotonic() - killed < 60
    # The server keeps serving: a new session opens and streams (on the surviving replica or a new one).
    chunks, after = run_session(server, {**INIT, "max_chunks": 2})
    assert [c["index"] for c in chunks] == [0, 1] and after.close_code == 1000


class SGLangStyleClient:
    """Message handling of SGLang Diffusion's own realtime client (its test utilities and their users):
    every message is decoded as a msgpack map and dispatched on ``type``; ``error`` fails the run,
    ``chunk_stats`` is kept, ``frame_batch`` carries its payload inline, ``frame_batch_header`` announces
    the next binary frame as its payload, and any other type is a protocol violation. Raw payloads are
    decoded with the header's width, height, channels and bytes_per_frame, JPEG / WebP ones split by
    payload_lengths; a chunk is complete at its ``is_final_frame_batch`` (default true), and the events
    scheduled ``after_chunk`` n go out right then."""

    def __init__(self, server: ServeProcess, query: str = ""):
        url = f"ws://127.0.0.1:{server.port}/v1/realtime_video/generate{query}"
        self._connection = connect(url, max_size=None)
        self.ws = self._connection.__enter__()

    def run(self, init: dict | None, *, num_chunks: int, events: list[dict] = ()) -> dict:
        """Sends ``init`` (None: sent already), then reads ``num_chunks`` chunks and their stats."""
        events = list(events)
        sent: set[int] = set()

        def send_events(after_chunk: int) -> None:
            for i, event in enumerate(events):
                if i not in sent and event.get("after_chunk", 0) == after_chunk:
                    body = {k: v for k, v in event.items() if k != "after_chunk"}
                    self.ws.send(msgpack.packb({"type": "event", **body}, use_bin_type=True))
                    sent.add(i)

        if init is not None:
            self.ws.send(msgpack.packb(init, use_bin_type=True))
        send_events(-1)
        headers: list[dict] = []
        frames: dict[int, list[np.ndarray]] = {}
        stats: list[dict] = []
        done: set[int] = set()
        while len(done) < num_chunks or len(stats) < len(done):
            header = msgpack.unpackb(self.ws.recv(120), raw=False)
            kind = header.get("type")
            if kind == "error":
                raise AssertionError(f"realtime generation failed: {header.get('content')}")
            if kind == "chunk_stats":
                stats.append(header)
                continue
            if kind == "frame_batch":
                payload = header.pop("payload")
            elif kind == "frame_batch_header":
                payload = self.ws.recv(120)
            else:
                raise AssertionError(f"unexpected realtime message: {header}")
            assert isinstance(payload, bytes) and len(payload) == header["total_size"]
            headers.append(header)
            frames.setdefault(header["chunk_index"], []).extend(self._decode(header, payload))
            if header.get("is_final_frame_batch", True):
                done.add(header["chunk_index"])
                send_events(header["chunk_index"])
        return {"headers": headers, "frames": frames, "stats": stats}

    @staticmethod
    def _decode(header: dict, payload: bytes) -> list[np.ndarray]:
        if header["content_type"] == "application/x-raw-rgb":
            per = header["bytes_per_frame"]
            assert len(payload) == header["num_frames"] * per, "raw frame payload size mismatch"
            shape = (header["height"], header["width"], header["channels"])
            return [
                np.frombuffer(payload[i * per : (i + 1) * per], np.uint8).reshape(shape)
                for i in range(header["num_frames"])
            ]
        out, offset = [], 0
        for length in header["payload_lengths"]:
            out.append(png_pixels(payload[offset : offset + length]))
            offset += length
        assert offset == len(payload) and len(out) == header["num_frames"]
        return out

    def closed(self) -> tuple[int | None, str]:
        """Waits for the server's close; its code and reason."""
        try:
            while True:
                self.ws.recv(120)
        except ConnectionClosed as exc:
            return (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else (None, "")

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


def test_an_sglang_client_with_nil_defaults_raw_frames_and_a_sticky_event_id(server):
    """The init an SGLang client builds (unset options as nil, SGLang-only fields such as ``seconds``), a
    prompt event after chunk 0: only the message types it knows, raw frames it can decode from the header
    alone, SGLang's header and stats fields, and the event's id on every chunk made with its prompt.

    Output is paced at 4 fps: the server denoises one chunk ahead of the one it sends, so chunk 3 is queued
    only once chunk 1 has gone out, a quarter of a second after chunk 0 (whose one frame plays first). The
    event, sent when chunk 0 arrives, is in by then and reaches chunk 2 or 3 however fast the tiny model
    denoises; unpaced, all four chunks could be queued before it arrives."""
    init = {
        **INIT, "max_chunks": 4, "fps": 4, "seed": None, "guidance_scale": None, "negative_prompt": None,
        "realtime_output_format": None, "output_compression": None, "first_frame": None, "seconds": 4,
        "realtime_output_pacing": True, "trace_id": "trace-7",
    }  # fmt: skip
    client = SGLangStyleClient(server)
    run = client.run(
        init,
        num_chunks=4,
        events=[{"kind": "prompt", "payload": "a blue whale at night", "event_id": 7, "after_chunk": 0}],
    )
    assert client.closed() == (1000, "generation complete")
    client.close()
    assert [len(run["frames"][i]) for i in range(4)] == [1, 8, 8, 8]
    assert all(f.shape == (64, 64, 3) for chunk in run["frames"].values() for f in chunk)
    for h in run["headers"]:
        assert h["format"] == "rgb24" and h["encoding"] == "raw" and h["raw_size"] == h["total_size"]
        assert h["request_id"] == f"{h['session_id']}_{h['chunk_index']}"
    stats = {s["chunk_index"]: s for s in run["stats"]}
    assert sorted(stats) == [0, 1, 2, 3]
    for i, s in stats.items():
        assert s["trace_id"] == "trace-7" and s["request_id"].endswith(f"_{i}")
        assert s["num_frames"] == len(run["frames"][i]) and s["raw_bytes"] == s["num_frames"] * 64 * 64 * 3
        for key in ("request_prepare_ms", "scheduler_forward_ms", "pace_wait_ms", "header_write_ms",
                    "raw_payload_build_ms", "raw_write_ms", "ws_write_ms", "chunk_total_ms"):  # fmt: skip
            assert isinstance(s[key], int) and s[key] >= 0, key
    # As SGLang does: the chunk that applied the event and every later one (same prompt) carry its id.
    echoed = [stats[i]["event_id"] for i in range(4)]
    applied = echoed.index(7)
    assert applied in (1, 2, 3) and echoed == [None] * applied + [7] * (4 - applied)
    for h in run["headers"]:
        assert h.get("event_id") == echoed[h["chunk_index"]]


def test_an_sglang_client_gets_jpeg_previews_six_frames_a_message(server):
    """``realtime_output_format`` jpeg with SGLang's ``output_compression`` and
    ``realtime_preview_max_width``, and the first frame as a base64 data URL (in lines of 76 characters, as
    MIME base64 wraps them): 8-frame chunks come as 6 + 2 JPEG files at the preview size, the source size
    named beside it."""
    first = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(first, format="PNG")
    init = {
        **INIT, "max_chunks": 2, "realtime_output_format": "jpeg", "output_compression": 40,
        "realtime_preview_max_width": 32,
        "first_frame": "data:image/png;base64," + base64.encodebytes(first.getvalue()).decode(),
    }  # fmt: skip
    assert "\n" in init["first_frame"].rstrip()
    client = SGLangStyleClient(server, query="?trace_id=from-query")
    run = client.run(init, num_chunks=2)
    assert client.closed() == (1000, "generation complete")
    client.close()
    assert [len(run["frames"][i]) for i in (0, 1)] == [1, 8]
    assert all(f.shape == (32, 32, 3) for chunk in run["frames"].values() for f in chunk)
    later = [h for h in run["headers"] if h["chunk_index"] == 1]
    assert [(h["frame_batch_index"], h["num_frames"]) for h in later] == [(0, 6), (1, 2)]
    for h in run["headers"]:
        assert h["content_type"] == "image/jpeg" and h["format"] == h["encoding"] == "jpeg"
        assert (h["width"], h["height"], h["preview_width"], h["preview_height"]) == (32, 32, 32, 32)
        assert (h["source_width"], h["source_height"]) == (64, 64)
    assert {s["trace_id"] for s in run["stats"]} == {"from-query"}


def test_an_sglang_client_asking_for_paced_output_gets_chunks_as_they_play(server):
    """``realtime_output_pacing`` as SGLang paces: a chunk is sent once the frames sent before it have
    played at ``fps`` (at fps 1: chunk 1 a second after chunk 0's one frame, chunk 2 four seconds after
    chunk 1's four frames, far longer than the tiny model takes to denoise them); each chunk's stats say how
    long it waited."""
    init = {**INIT, "num_frames": 4, "fps": 1, "max_chunks": 3, "realtime_output_pacing": True}
    client = SGLangStyleClient(server)
    run = client.run(init, num_chunks=3)
    assert client.closed() == (1000, "generation complete")
    client.close()
    assert [len(run["frames"][i]) for i in range(3)] == [1, 4, 4]
    waits = {s["chunk_index"]: s["pace_wait_ms"] for s in run["stats"]}
    assert waits[0] == 0 and waits[1] + waits[2] > 0, waits


def test_bad_messages_answer_errors_naming_the_field_while_another_session_streams(server):
    """Each bad message a user can send gets an ``error`` whose content starts with the field at fault,
    before the session (the socket then still takes an init) and during it (the session goes on); a
    second session streams meanwhile."""
    other = SGLangStyleClient(server)
    other.ws.send(msgpack.packb({**INIT, "prompt": "a quiet harbour", "max_chunks": 3}, use_bin_type=True))
    client = Client(server)
    before = [
        ("message", "a text frame"),
        ("message", b"\xc1\xc1 not msgpack"),
        ("message", msgpack.packb([1, 2, 3])),
        ("type", {"type": "event", "kind": "prompt", "payload": "too early", "event_id": 1}),
        ("type", {"prompt": "no type"}),
        ("size", {**INIT, "size": "abc"}),
        ("size", {**INIT, "size": "8x8"}),
        ("size", {**INIT, "size": "32x16"}),  # under one 4x4 patch of 8x latents: chunk 3 would fail
        ("num_frames", {**INIT, "num_frames": 0}),
        ("num_frames", {**INIT, "num_frames": 10**9}),
        ("num_frames", {**INIT, "num_frames": "8"}),
        ("fps", {**INIT, "fps": -5}),
        ("seed", {**INIT, "seed": "5"}),
        ("seed", {**INIT, "seed": -1}),
        ("max_chunks", {**INIT, "max_chunks": 0}),
        ("max_chunks", {**INIT, "max_chunks": 10**6}),
        ("num_inference_steps", {**INIT, "num_inference_steps": True}),
        ("realtime_output_format", {**INIT, "realtime_output_format": "png"}),
        ("output_compression", {**INIT, "output_compression": 0}),
        ("first_frame", {**INIT, "first_frame": "https://example.com/a.png"}),
        ("first_frame", {**INIT, "first_frame": b"not an image"}),
        ("first_frame", {**INIT, "first_frame": 12345}),  # neither bytes nor text: no member tags
        ("first_frame", {**INIT, "first_frame": ["a.png"]}),
        ("first_frame", {**INIT, "first_frame": image_bytes(64, 64, "GIF")}),
        ("first_frame", {**INIT, "first_frame": image_bytes(256, 256, "PNG")}),  # --max-image-pixels
        ("size", {**INIT, "size": "512x256"}),  # --max-width
        ("model", {**INIT, "model": "not-this-one"}),
        ("prompt", {**INIT, "prompt": 5}),
        ("prompt", {**INIT, "prompt": "   "}),
        ("negative_prompt", {**INIT, "negative_prompt": "x" * 4001}),  # --max-prompt-chars, as prompt
    ]
    for field, message in before:
        client.ws.send(message if isinstance(message, (str, bytes)) else msgpack.packb(message))
        error = client.error()
        assert error["content"].startswith(field + ":"), (message, error)
    client.ws.send(msgpack.packb({1: "init", "prompt": "a fox"}))  # valid msgpack: was "not valid msgpack"
    assert client.error()["content"] == "message: the map's keys must be strings (the field names)"
    # The other session streamed on undisturbed (it holds one replica's only slot: it is done before this
    # socket's own session opens, which round-robin may put on the same replica).
    streamed = other.run(None, num_chunks=3)
    assert [len(streamed["frames"][i]) for i in range(3)] == [1, 8, 8]
    assert other.closed() == (1000, "generation complete")
    other.close()
    client.send({**INIT, "max_chunks": 3})
    during = [
        ("kind", {"type": "event", "kind": "teleport", "payload": 1, "event_id": 1}),
        ("payload", {"type": "event", "kind": "prompt", "payload": 42, "event_id": 2}),
        ("event_id", {"type": "event", "kind": "prompt", "payload": "x", "event_id": "two"}),
        ("type", {**INIT}),
        ("message", "a text frame"),
        ("message", b"\xc1"),
    ]
    for _, message in during:
        client.ws.send(message if isinstance(message, (str, bytes)) else msgpack.packb(message))
    errors, chunks = [], set()
    while (message := client.recv()) is not None:
        if message["type"] == "error":
            errors.append(message["content"].split(":")[0])
        elif message["type"] == "chunk_stats":
            chunks.add(message["chunk_index"])
    assert errors == [field for field, _ in during]
    assert chunks == {0, 1, 2} and client.close_code == 1000


def test_an_init_without_a_size_gets_the_model_default_within_the_server_limits(server):
    """No size, nil, "" or "auto" (as the HTTP APIs take it): the model's 832x480 scaled to --max-width 256,
    also with a first frame of another aspect (the model resizes it to the session's size)."""
    no_size = {k: v for k, v in INIT.items() if k != "size"}
    for init in (
        no_size,
        {**INIT, "size": None},
        {**INIT, "size": ""},
        {**INIT, "size": "auto", "first_frame": image_bytes(48, 96, "JPEG")},
    ):
        client = SGLangStyleClient(server)
        run = client.run({**init, "max_chunks": 1}, num_chunks=1)
        assert client.closed() == (1000, "generation complete")
        client.close()
        assert [f.shape for f in run["frames"][0]] == [(144, 256, 3)], init.get("size", "absent")
