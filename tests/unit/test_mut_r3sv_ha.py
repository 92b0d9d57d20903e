"""kvservice/server/ha.py HAController._follow: a standby looks at the leader key again every poll_seconds when
the lease names no TTL end to wait for (Lease.take_due() is None: nobody holds the key, or its holder's TTL
ends after the next poll anyway), and keeps following: it never dies on that case.

Fakes stand in for the NATS store and the lease (only what _follow reads of them); the lease's clock is a
ManualClock, so nothing here depends on the wall clock's value."""

from __future__ import annotations

from types import SimpleNamespace

from kvservice.server.ha import HAController
from tests.clocks import ManualClock

POLL = 0.01


class _Store:
    """A caught-up journal stream that delivers nothing: poll() records the timeout it was given."""

    pending = None
    last_stream_seq = 7

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def poll(self, timeout: float) -> list:
        self.timeouts.append(timeout)
        return []

    def stream_last_seq(self) -> int:
        return 7


class _Lease:
    """A lease held by someone else with no TTL end to wait for; the controller stops after `looks` looks."""

    def __init__(self, looks: int) -> None:
        self.config = SimpleNamespace(poll_seconds=POLL)
        self.clock = ManualClock()
        self.looks = looks
        self.acquire_calls = 0
        self.due_calls = 0
        self.controller: HAController | None = None

    def try_acquire(self) -> bool:
        self.acquire_calls += 1
        if self.acquire_calls >= self.looks:
            self.controller._stop.set()
        return False

    def take_due(self):
        self.due_calls += 1
        return None


def test_a_standby_with_no_ttl_end_to_wait_for_looks_again_after_poll_and_keeps_following() -> None:
    """take_due() None: _follow neither raises nor fails the controller; it looks again (try_acquire, then
    take_due) each poll until stopped, stays a standby, and never waits on the stream longer than poll_seconds."""
    store, lease = _Store(), _Lease(looks=3)
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    ha._follow()                                   # returns once stopped; raising would fail this test
    assert lease.acquire_calls == 3
    assert lease.due_calls == 3                    # each look that did not take the lease over reads the due time
    assert (ha.role, ha.failed) == ("standby", None)
    assert store.timeouts and all(0 < t <= POLL for t in store.timeouts)
    assert ha.lag_entries == 0                     # stream_last_seq - last_stream_seq, measured as it followed
