"""NatsStore's small plumbing, checked on hand-computed values: _call's default wait (request_seconds + 1 s) and the
StoreError it makes of a NATS error, and _relearn_stream_leader reading the stream leader on a daemon thread named
kvs-stream-leader (the name test_mut_s19st_nats.py looks for)."""

from __future__ import annotations

import secrets
import threading
from types import SimpleNamespace

import nats.errors
import pytest

from kvservice.state.nats.config import StoreError
from kvservice.state.nats.journal import NatsStore

from .test_mut_r3sn_lease import BucketRefused, RecordingLink
from .test_nats_store import link  # noqa: F401  (fixture)


async def some_request() -> None:
    """A coroutine for RecordingLink to record (it closes it unrun)."""


@pytest.mark.parametrize("request_seconds", [0.5, 2.0, 10 / 3, 7.25])
def test_call_waits_request_seconds_plus_one_unless_told_and_names_the_store_and_call_on_a_nats_error(
        request_seconds):
    """_call(coro) -> link.call(coro, request_seconds + 1.0, "a request"); an explicit timeout and what are passed
    as they are; a nats.errors.Error becomes StoreError "<path>: <what>: <ErrorClass>: <its text>"."""
    lk = RecordingLink(request_seconds)
    path = "nats://t/" + secrets.token_hex(3)
    store = SimpleNamespace(link=lk, config=lk.config, path=path)
    assert NatsStore._call(store, some_request()) is lk.result
    told = 1.5 + secrets.randbelow(100)
    NatsStore._call(store, some_request(), told, "doing " + path)
    assert lk.calls == [("some_request", request_seconds + 1.0, "a request"),
                        ("some_request", told, "doing " + path)]
    text = "refused-" + secrets.token_hex(4)
    lk.error = BucketRefused(text)
    with pytest.raises(StoreError) as caught:
        NatsStore._call(store, some_request(), what="reading x")
    assert str(caught.value) == f"{path}: reading x: BucketRefused: {text}"
    assert lk.calls[-1] == ("some_request", request_seconds + 1.0, "reading x")
    lk.error = nats.errors.TimeoutError()
    with pytest.raises(StoreError, match=rf"^{path}: a request: TimeoutError: "):
        NatsStore._call(store, some_request())


def test_relearning_reads_the_stream_leader_on_a_daemon_thread_named_kvs_stream_leader(link):  # noqa: F811
    """_relearn_stream_leader runs prefer_stream_leader on a thread of its own: named kvs-stream-leader, a daemon
    (it never holds up shutdown), not the caller's."""
    store = NatsStore(link)
    seen = []
    ran = threading.Event()

    def record():
        t = threading.current_thread()
        seen.append((t.name, t.daemon, t is threading.main_thread()))
        ran.set()
    try:
        store.prefer_stream_leader = record
        store._relearn_stream_leader()
        assert ran.wait(30.0)                      # a bound on a hang, not a timing
        assert store._relearning.acquire(timeout=30.0)
        store._relearning.release()
        assert seen == [("kvs-stream-leader", True, False)]
    finally:
        store.close()
