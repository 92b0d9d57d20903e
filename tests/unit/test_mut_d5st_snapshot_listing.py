"""NatsStore.newest_snapshot_seq without a server: one listing of the snapshot bucket, waited for as docs/HA.md
('Threading') says, "NATS did not answer listing snapshots within 10 s" with the default 2 s request deadline
(a listing is not held to one request's deadline, and never to less than 10 s); the answer is the position in the
name of the newest live snap-<seq, 20 digits> object, 0 when there is none."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvservice.state.nats.journal import NatsStore


def store(infos, request_seconds: float) -> tuple[NatsStore, list[tuple[float, str]]]:
    st = NatsStore.__new__(NatsStore)
    st.config = SimpleNamespace(request_seconds=request_seconds, snapshot_bucket="b")
    st.path = "nats://x (stream s)"
    calls: list[tuple[float, str]] = []

    async def listing(ignore_deletes=False):
        assert ignore_deletes
        return infos

    def call(coro, timeout, what="a request"):
        calls.append((timeout, what))
        return asyncio.run(coro)
    st._obs = SimpleNamespace(list=listing)
    st.link = SimpleNamespace(call=call)
    return st, calls


def info(name, deleted=False):
    return SimpleNamespace(name=name, deleted=deleted)


@pytest.mark.parametrize("request_seconds, wait", [(2.0, 10.0), (0.5, 10.0), (10.0, 10.0), (25.0, 25.0)])
def test_newest_snapshot_seq_lists_once_waiting_at_least_10_s(request_seconds, wait):
    infos = [info(f"snap-{7:020d}"), info(f"snap-{1234:020d}"), info(f"snap-{99999:020d}", deleted=True),
             info("zz-other"), info(f"snap-{300:020d}")]
    st, calls = store(infos, request_seconds)
    assert st.newest_snapshot_seq() == 1234
    assert calls == [(wait, "listing snapshots")]


def test_newest_snapshot_seq_is_0_for_a_bucket_without_live_snapshots():
    st, calls = store([info(f"snap-{5:020d}", deleted=True), info("manifest")], 2.0)
    assert st.newest_snapshot_seq() == 0
    st, calls = store([], 2.0)
    assert st.newest_snapshot_seq() == 0 and calls == [(10.0, "listing snapshots")]
