"""Realtime video sessions against a real ``ditserve serve --dp-size 2`` on a tiny AnyFlow-FAR folder, with
a client written from SGLang Diffusion's ``/v1/realtime_video`` protocol (msgpack maps in binary frames over
``websockets``): ordered chunks, a prompt event that changes the following chunks only, the same init giving
the same frames on the other replica, errors for bad inits and events on a socket that keeps serving, and
``session_gone`` (then close 4410) when the owner replica's process is killed."""

from __future__ import annotations

import os
import signal
import time

import httpx
import msgpack
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.families.anyflow import build_folder
from tests.helpers import ServeProcess

KEY = "realtime-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
INIT = {
    "type": "init", "prompt": "a red fox running", "size": "64x64", "num_frames": 8, "seed": 5,
    "num_inference_steps": 2, "realtime_output_format": "raw",
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_folder(tmp_path_factory.mktemp("anyflow") / "tiny-anyflow-far")
    proc = ServeProcess(
        "--model", str(folder), "--dp-size", "2", "--api-key", KEY, "--max-realtime-sessions", "1",
        timeout_s=300,
    )  # fmt: skip
    yield proc
    proc.stop()


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
    init = {**INIT, "max_chunks": 4}
    sent = {}

    def change_prompt(client, chunk):
        if chunk["index"] == 0:
            client.send(
                {"type": "event", "kind": "prompt", "payload": "a blue whale at night", "event_id": 7}
            )
            sent["after"] = 0

    changed, client = run_session(server, init, on_chunk=change_prompt)
    assert (client.close_code, client.close_reason) == (1000, "generation complete")
    assert [c["index"] for c in changed] == [0, 1, 2, 3]
    assert [c["frames"].shape for c in changed] == [(1, 64, 64, 3)] + [(8, 64, 64, 3)] * 3
    owner = changed[0]["replica"]
    assert {c["replica"] for c in changed} == {owner}  # every chunk from the owner
    assert owner in {r["replica_id"] for r in replicas(server)}

    # The event applies from the next chunk not yet queued (chunk 1 was queued as chunk 0's frames came;
    # chunk 2 too when chunk 1 was done before the event arrived): that chunk echoes it, those before do not.
    applied = next(c["index"] for c in changed if c["event_id"] == 7)
    assert applied in (1, 2, 3)
    assert all(c["event_id"] is None for c in changed[:applied])
    assert all(c["event_id"] is None for c in changed[applied + 1 :])

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
    first.send({**INIT, "prompt": "a lighthouse"})  # no max_chunks: both run until closed
    second.send({**INIT, "prompt": "a forest"})
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
