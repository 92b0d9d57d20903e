"""NatsLink.call names a call it is not told about "a request" (kvservice/state/nats/link.py, call's signature and
docstring: both timeout messages say which call and after how long), on a link whose nats.connect is a recorder."""

from __future__ import annotations

import asyncio
import re
import secrets
from types import SimpleNamespace

import pytest

import kvservice.state.nats.link as link_module
from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.link import NatsLink
from tests.clocks import ManualClock
from tests.unit.test_mut_r7nats_link import FakeNC


def test_an_unnamed_call_is_called_a_request_in_both_timeout_messages(monkeypatch):
    nc = FakeNC("2.10.22")

    async def connect(**kw):
        return nc
    monkeypatch.setattr(link_module.nats, "connect", connect)
    config = NatsConfig(("nats://127.0.0.1:1",), name="t" + secrets.token_hex(4), request_seconds=1.0,
                        append_seconds=30.0)
    lk = NatsLink(config, client_name="c", connect_seconds=5.0)
    try:
        async def times_out_itself():
            raise TimeoutError

        with pytest.raises(StoreError) as err:
            lk.call(times_out_itself(), 30.0)
        assert re.fullmatch(r"NATS timed out a request after \d+\.\d\d s \(TimeoutError; " + re.escape(config.url)
                            + r"\)", err.value.message), err.value.message
        never = asyncio.Event()
        with pytest.raises(StoreError) as err:
            lk.call(never.wait(), 0.05)
        assert err.value.message == f"NATS did not answer a request within 0.05 s ({config.url})"
    finally:
        lk.close()


class PacedLoop:
    """Stands in for asyncio inside link.py: wait_for records its timeout; sleep records and moves the clock."""

    def __init__(self, clock, sleep_to) -> None:
        self.clock, self.sleep_to, self.timeouts, self.sleeps = clock, list(sleep_to), [], []

    async def wait_for(self, aw, timeout):
        self.timeouts.append(timeout)
        return await aw

    async def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.clock.now = self.sleep_to.pop(0)


def _connecting(monkeypatch, connect_to, sleep_to, last_error=None):
    clock = ManualClock(1024.0)
    paced = PacedLoop(clock, sleep_to)
    monkeypatch.setattr(link_module, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(link_module, "asyncio", paced)
    tries = []

    async def connect(**kw):
        tries.append(kw["name"])
        clock.now = connect_to.pop(0)
        raise OSError(f"refused {len(tries)}")
    monkeypatch.setattr(link_module.nats, "connect", connect)
    config = NatsConfig(("nats://127.0.0.1:1", "nats://127.0.0.1:2"), name="t" + secrets.token_hex(4))
    stub = SimpleNamespace(config=config, last_error=last_error, _on_error=None, _on_disconnect=None,
                           _on_reconnect=None)
    with pytest.raises(StoreError) as err:
        asyncio.run(NatsLink._connect(stub, "c", 1.0))
    return err.value.message, tries, paced, config


def test_connecting_retries_every_fifth_of_a_second_until_the_next_try_would_end_past_the_deadline(monkeypatch):
    """Deadline 1025.0 (1024.0 + 1 s): a failure at 1024.0 sleeps 0.2 s (moved here to 1024.99: the next try still
    waits at least 0.05 s); a failure at 1024.8 (1024.8 + 0.2 == the deadline) gives up, naming nats-py's error."""
    message, tries, paced, config = _connecting(monkeypatch, [1024.0, 1024.8], [1024.99])
    assert tries == ["c", "c"] and paced.timeouts == [1.0, 0.05] and paced.sleeps == [0.2]
    assert message == (f"cannot reach NATS at {config.url}: connecting gave up after 1 s (last: "
                       "OSError('refused 2'))")


def test_giving_up_names_the_last_error_nats_py_reported_when_there_is_one(monkeypatch):
    message, tries, _, config = _connecting(monkeypatch, [1024.9], [], last_error=RuntimeError("Authorization"))
    assert tries == ["c"]
    assert message == (f"cannot reach NATS at {config.url}: connecting gave up after 1 s (last: "
                       "RuntimeError('Authorization'))")


class Joined:
    """Wraps the loop thread, recording the timeout each join is given."""

    def __init__(self, thread) -> None:
        self.thread, self.joins = thread, []

    def join(self, timeout):
        self.joins.append(timeout)
        self.thread.join(timeout)

    def is_alive(self):
        return self.thread.is_alive()


def test_closing_waits_five_seconds_for_the_connection_and_for_the_loop_thread(monkeypatch):
    nc = FakeNC("2.10.22")

    async def connect(**kw):
        return nc
    monkeypatch.setattr(link_module.nats, "connect", connect)
    lk = NatsLink(NatsConfig(("nats://127.0.0.1:1",), name="t" + secrets.token_hex(4)), client_name="c")
    calls, real_call = [], lk.call

    def call(coro, timeout, what="a request"):
        calls.append((coro.__qualname__, timeout, what))
        return real_call(coro, timeout, what)
    lk.call, lk._thread = call, Joined(lk._thread)
    lk.close()
    assert calls == [("FakeNC.close", 5.0, "a request")] and lk._thread.joins == [5.0]
    assert nc.is_closed and lk.loop.is_closed()
