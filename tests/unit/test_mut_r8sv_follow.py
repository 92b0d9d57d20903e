"""kvservice/server/ha.py HAController._follow: a standby that starts following measures its lag and looks at the
lease on its very first pass, after one shortest poll (5 ms), whatever the monotonic clock reads then; it does
not wait a second first (docs/HA.md, "take (standby, every poll_seconds)": its looks start with its first poll).

The monotonic clock is a ManualClock from 0 moved by each poll's timeout (the fakes of test_mut_r3sv_ha stand in
for the store and lease), so the first pass is decided by the code, not by how long the machine has been up.
Oracle: _follow's polling rule recomputed by hand: timeout = min(poll, max(0.005, next_look - now)).
"""

from __future__ import annotations

from types import SimpleNamespace

from kvservice.server import ha as ha_module
from kvservice.server.ha import HAController
from tests.clocks import ManualClock
from tests.unit.test_mut_r3sv_ha import _Lease, _Store


class _CountingStore(_Store):
    """The caught-up stream; every poll moves the clock by its timeout; lag measurements are counted."""

    def __init__(self, clock: ManualClock, behind: int) -> None:
        super().__init__()
        self.clock = clock
        self.behind = behind
        self.measured = 0
        self.restarts = 0

    def stop_reading(self) -> None:
        self.restarts += 1

    def poll(self, timeout: float) -> list:
        self.clock.now += timeout
        return super().poll(timeout)

    def stream_last_seq(self) -> int:
        self.measured += 1
        return self.last_stream_seq + self.behind


def test_the_first_pass_measures_the_lag_and_looks_at_the_lease_after_one_shortest_poll(monkeypatch) -> None:
    clock = ManualClock(0.0)
    monkeypatch.setattr(ha_module, "time", SimpleNamespace(monotonic=clock))
    store, lease = _CountingStore(clock, behind=4), _Lease(looks=1)
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    ha._follow()
    assert store.timeouts == [0.005]
    assert (lease.acquire_calls, lease.due_calls) == (1, 1)
    assert store.measured == 1 and ha.lag_entries == 4
    assert clock.now == 0.005


def test_a_standby_behind_at_its_first_measurement_keeps_its_consumer_whatever_message_it_read(monkeypatch, caplog):
    """Only a second measurement that finds the same message read while still behind restarts the consumer: the
    first one has nothing to compare with, even when the standby has read exactly stream message 1."""
    import logging

    clock = ManualClock(0.0)
    monkeypatch.setattr(ha_module, "time", SimpleNamespace(monotonic=clock))
    store, lease = _CountingStore(clock, behind=3), _Lease(looks=1)
    store.last_stream_seq = 1
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    with caplog.at_level(logging.WARNING, logger="kvservice"):
        ha._follow()
    assert (store.measured, store.restarts, ha.lag_entries) == (1, 0, 3)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


class _DueLease(_Lease):
    """The holder's TTL ends `due_in` seconds after each look (by the lease's own clock): take_due names it."""

    def __init__(self, looks: int, due_in: float) -> None:
        super().__init__(looks)
        self.due_in = due_in

    def take_due(self):
        self.due_calls += 1
        return self.clock() + self.due_in


def test_a_standby_polls_only_until_the_holders_ttl_ends_then_looks_again(monkeypatch) -> None:
    """docs/HA.md: "The standby looks again exactly when that TTL ends (Lease.take_due), not at its next poll
    after it": after the first look the next poll waits due - now (7 ms here, under poll_seconds = 10 ms)."""
    import pytest

    clock = ManualClock(0.0)
    monkeypatch.setattr(ha_module, "time", SimpleNamespace(monotonic=clock))
    store, lease = _CountingStore(clock, behind=0), _DueLease(looks=2, due_in=0.007)
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    ha._follow()
    assert store.timeouts == pytest.approx([0.005, 0.007])
    assert (lease.acquire_calls, lease.due_calls) == (2, 2)
    assert clock.now == pytest.approx(0.012)


def test_between_measurements_the_lag_is_what_the_server_said_with_the_last_message(monkeypatch) -> None:
    """store.pending (the messages the server said are left, with the last one delivered) is the lag gauge
    between the once-a-second measurements: the second pass (15 ms in) shows it, not the measured 0."""
    clock = ManualClock(0.0)
    monkeypatch.setattr(ha_module, "time", SimpleNamespace(monotonic=clock))
    store, lease = _CountingStore(clock, behind=0), _Lease(looks=2)
    store.pending = 9
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    ha._follow()
    assert (store.measured, len(store.timeouts), ha.lag_entries) == (1, 2, 9)


def test_a_standby_stuck_behind_for_a_second_restarts_its_consumer_once_and_says_so(monkeypatch, caplog) -> None:
    """The lag is measured once a second (at 5 ms, then at the first pass >= 1.005 s); the second measurement
    finds the same stream message read while still 3 behind: one warning naming the lag, one new consumer."""
    import logging

    clock = ManualClock(0.0)
    monkeypatch.setattr(ha_module, "time", SimpleNamespace(monotonic=clock))
    store, lease = _CountingStore(clock, behind=3), _Lease(looks=110)     # 5 ms, then 10 ms a pass: ~1.095 s
    ha = HAController(journal=None, store=store, lease=lease, gate=None)
    lease.controller = ha
    with caplog.at_level(logging.WARNING, logger="kvservice"):
        ha._follow()
    assert 1.0 < clock.now < 1.2
    assert (store.measured, store.restarts, ha.lag_entries) == (2, 1, 3)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "standby: no journal message for 1 s while 3 behind; reading on with a new consumer"]
