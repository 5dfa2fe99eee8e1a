"""A replica's ``session_ended`` (the call a session's WebSocket holds) says why its session ended: the
WebSocket closes 4408 for an idle session, 4409 for an old one, 4404 for one deleted or never opened."""

import asyncio
import time

from ditserve.cluster.config import AppArgs
from ditserve.cluster.engine_deployment import EngineReplica, Session
from ditserve.cluster.errors import NotFound


def _replica(**limits) -> EngineReplica:
    # The replica's session bookkeeping alone: no engine, ranks or Ray behind it.
    replica = EngineReplica.__new__(EngineReplica)
    replica.args = AppArgs(model="demo-flux", **limits)
    replica.replica_id = "r0"
    replica.sessions = {}
    replica._realtime = {}  # no realtime video sessions
    return replica


def _open(replica: EngineReplica, sid: str) -> Session:
    replica.sessions[sid] = session = Session(session_id=sid, width=64, height=64)
    return session


def test_a_session_that_expires_while_watched_ends_idle_not_unknown():
    async def run():
        replica = _replica(session_idle_timeout_s=0.3)
        _open(replica, "s")
        # The watch's own wait reaches the deadline and expires the session: it ended "idle".
        return await asyncio.wait_for(replica.session_ended("s"), 5)

    answer = asyncio.run(run())
    assert answer["ended"] == "idle", answer


def test_a_session_past_its_lifetime_ends_lifetime():
    async def run():
        replica = _replica(session_idle_timeout_s=30, session_max_lifetime_s=0.3)
        _open(replica, "s")
        return await asyncio.wait_for(replica.session_ended("s"), 5)

    assert asyncio.run(run())["ended"] == "lifetime"


def test_a_deleted_session_ends_closed_and_an_unknown_one_is_not_found():
    async def run():
        replica = _replica(session_idle_timeout_s=30)
        _open(replica, "s")
        watch = asyncio.ensure_future(replica.session_ended("s"))
        await asyncio.sleep(0)  # the watch is waiting on the session
        replica._drop_session("s", "closed")
        return await asyncio.wait_for(watch, 5), await replica.session_ended("nope")

    closed, unknown = asyncio.run(run())
    assert closed["ended"] == "closed"
    assert isinstance(unknown, NotFound) and unknown.param == "session_id"


def test_a_step_running_past_the_deadline_keeps_the_session_until_it_is_idle_again():
    async def run():
        replica = _replica(session_idle_timeout_s=0.3)
        session = _open(replica, "s")
        await session.lock.acquire()  # a step is running
        watch = asyncio.ensure_future(replica.session_ended("s"))
        await asyncio.sleep(0.5)
        running = "s" in replica.sessions and not watch.done()
        session.last_used = time.monotonic()
        session.lock.release()
        return running, await asyncio.wait_for(watch, 5)

    running, answer = asyncio.run(run())
    assert running and answer["ended"] == "idle"


def test_a_newer_watch_takes_the_session_over_and_the_older_one_ends_replaced():
    async def run():
        replica = _replica(session_idle_timeout_s=30)
        session = _open(replica, "s")
        older = asyncio.ensure_future(replica.session_ended("s"))
        await asyncio.sleep(0)
        newer = asyncio.ensure_future(replica.session_ended("s"))
        replaced = await asyncio.wait_for(older, 5)
        # the session lives on, watched by the newer call alone, which hears of its end
        alive = "s" in replica.sessions and not newer.done() and session.watch is not None
        replica._drop_session("s", "closed")
        closed = await asyncio.wait_for(newer, 5)
        return replaced, alive, closed, session.watch

    replaced, alive, closed, watch = asyncio.run(run())
    assert replaced["ended"] == "replaced" and alive and closed["ended"] == "closed" and watch is None
