"""kvservice/server/watch.py watch_events, its whole contract on fakes: what it asks of the hub, the tenant's read
budget, the memory budget and the call, in order, and what it streams.

Oracles: watch_events' docstring and the module's (a reset and catch-up are pieces of the tenant's read work, started
on hub.read_budget.try_start and finished with the CPU seconds they took; while one may not start the stream waits
min(wait, POLL_SECONDS) and holds nothing; live batches are free unless a reset came while it waited, which is
charged; a reset's bytes are charged to the memory budget before it is converted; catch-up is read
CATCHUP_BATCHES at a time; it ends when the call ends or the pool is gone; errors end it with the domain's status,
anything else INTERNAL with a fixed message) and the documented constants POLL_SECONDS = 0.5, CATCHUP_BATCHES = 256.
The clock (thread_time) and sleep are fakes with exact binary fractions, so every figure is compared exactly.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest

from kvservice.contract.errors import NotFound, ResourceExhausted
from kvservice.contract.status import to_status
from kvservice.server import watch

TENANT = "tenant-7q"
COMMITTED = 41


class _Budget:
    def __init__(self, ev: list, waits: list[float]) -> None:
        self.ev, self.waits = ev, waits

    def try_start(self, tenant: str) -> float:
        self.ev.append(("try_start", tenant))
        return self.waits.pop(0)

    def finish(self, tenant: str, seconds: float) -> None:
        self.ev.append(("finish", tenant, seconds))

    def charge(self, tenant: str, seconds: float) -> None:
        self.ev.append(("charge", tenant, seconds))


class _Sub:
    """Scripted: heavy() answers from `heavy`, poll() from `polls` (an exception in it is raised)."""

    def __init__(self, ev: list, heavy: list[bool], polls: list) -> None:
        self.ev, self._heavy, self._polls = ev, heavy, polls
        self.log = SimpleNamespace(committed=COMMITTED)

    def heavy(self, live_from: int) -> bool:
        self.ev.append(("heavy", live_from))
        return self._heavy.pop(0)

    def poll(self, timeout: float, max_batches: int | None = None):
        self.ev.append(("poll", timeout, max_batches))
        out = self._polls.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        self.ev.append(("close",))


class _Hub:
    def __init__(self, ev: list, sub: _Sub | None, waits: list[float], refuse: Exception | None = None) -> None:
        self.ev, self.sub, self.refuse = ev, sub, refuse
        self.read_budget = _Budget(ev, waits)

    def subscribe(self, *args, **kwargs):
        self.ev.append(("subscribe", args, kwargs))
        if self.refuse is not None:
            raise self.refuse
        return self.sub


class _Context:
    """A ServicerContext whose abort calls are recorded (and return, so a missing `return` after one shows)."""

    def __init__(self, active: int) -> None:
        self.active, self.checks = active, 0
        self.statuses: list = []
        self.aborts: list = []

    def is_active(self) -> bool:
        self.checks += 1
        return self.checks <= self.active

    def abort_with_status(self, status) -> None:
        self.statuses.append(status)

    def abort(self, code, details) -> None:
        self.aborts.append((code, details))


def _lb(name: str, reset: bool, nbytes: int):
    return SimpleNamespace(name=name, nbytes=nbytes, batch=SimpleNamespace(reset=reset))


@pytest.fixture
def ev(monkeypatch):
    """The event list every fake appends to; the module's clock, sleep, converter, tenant and reply charge faked."""
    events: list = []
    times = iter([1.0, 1.25, 2.0, 2.5, 3.0, 4.0, 5.0, 5.0625])
    monkeypatch.setattr(watch, "time", SimpleNamespace(sleep=lambda s: events.append(("sleep", s)),
                                                       thread_time=lambda: next(times)))
    monkeypatch.setattr(watch, "batch_to_protos", lambda lb: [f"{lb.name}-a", f"{lb.name}-b"])
    monkeypatch.setattr(watch, "current_principal", lambda: TENANT)
    monkeypatch.setattr(watch, "reserve_reply", lambda n: events.append(("reserve", n)))
    return events


def _request(pool: str = "pool-3f", seq: int = 17):
    return SimpleNamespace(pool=pool, from_sequence=seq)


def test_watch_waits_for_its_read_budget_charges_resets_and_streams_every_batch_in_order(ev) -> None:
    """Two waits (0.25 s as asked, 3 s capped at POLL_SECONDS), a catch-up piece (256 batches at most, a reset of 100
    bytes charged to the memory budget, finished with the 0.25 CPU seconds it took), a live reset (charged to the
    read budget: 0.5 s), an empty poll, a live batch (reply charge 0: no reset), and the pool gone (None: the piece
    finished, the stream ends, the subscription closed)."""
    sub = _Sub(ev, heavy=[True, True, True, False, False, False, True],
               polls=[[_lb("A", True, 100), _lb("B", False, 7)], [_lb("C", True, 40)], [], [_lb("D", False, 9)],
                      None])
    hub = _Hub(ev, sub, waits=[0.25, 3.0, 0.0, 0.0])
    ctx = _Context(active=100)
    out = list(watch.watch_events(hub, _request(), ctx))
    assert out == ["A-a", "A-b", "B-a", "B-b", "C-a", "C-b", "D-a", "D-b"]
    assert ev == [
        ("subscribe", ("pool-3f", 17, "grpc"), {"tenant": TENANT}),
        ("heavy", COMMITTED), ("try_start", TENANT), ("sleep", 0.25),
        ("heavy", COMMITTED), ("try_start", TENANT), ("sleep", 0.5),
        ("heavy", COMMITTED), ("try_start", TENANT), ("poll", 0.5, 256), ("reserve", 100), ("finish", TENANT, 0.25),
        ("heavy", COMMITTED), ("poll", 0.5, None), ("reserve", 40), ("charge", TENANT, 0.5),
        ("heavy", COMMITTED), ("poll", 0.5, None),
        ("heavy", COMMITTED), ("poll", 0.5, None), ("reserve", 0),
        ("heavy", COMMITTED), ("try_start", TENANT), ("poll", 0.5, 256), ("finish", TENANT, 0.0625),
        ("close",)]
    assert ctx.checks == 7 and ctx.statuses == [] and ctx.aborts == []
    assert (watch.POLL_SECONDS, watch.CATCHUP_BATCHES) == (0.5, 256)


def test_a_call_that_ended_reads_nothing_and_closes_its_subscription(ev) -> None:
    sub = _Sub(ev, heavy=[], polls=[])
    ctx = _Context(active=0)
    assert list(watch.watch_events(_Hub(ev, sub, waits=[]), _request("p", 0), ctx)) == []
    assert ev == [("subscribe", ("p", 0, "grpc"), {"tenant": TENANT}), ("close",)]
    assert ctx.checks == 1 and ctx.statuses == [] and ctx.aborts == []


def test_a_subscription_the_hub_refuses_ends_with_its_status_and_nothing_else(ev) -> None:
    err = NotFound("pool 'gone' does not exist", pool="gone")
    ctx = _Context(active=100)
    assert list(watch.watch_events(_Hub(ev, None, waits=[], refuse=err), _request("gone", 3), ctx)) == []
    assert ev == [("subscribe", ("gone", 3, "grpc"), {"tenant": TENANT})]
    assert ctx.statuses == [to_status(err)] and ctx.aborts == [] and ctx.checks == 0


def test_a_domain_error_while_streaming_ends_with_its_status_after_the_piece_is_finished(ev) -> None:
    err = ResourceExhausted("the reset does not fit", reason="MEMORY_BUDGET", needed=5)
    sub = _Sub(ev, heavy=[True], polls=[err])
    ctx = _Context(active=100)
    assert list(watch.watch_events(_Hub(ev, sub, waits=[0.0]), _request(), ctx)) == []
    assert ev == [("subscribe", ("pool-3f", 17, "grpc"), {"tenant": TENANT}), ("heavy", COMMITTED),
                  ("try_start", TENANT), ("poll", 0.5, 256), ("finish", TENANT, 0.25), ("close",)]
    assert ctx.statuses == [to_status(err)] and ctx.aborts == []


def test_an_unexpected_failure_is_logged_and_ends_internal_with_a_fixed_message(ev, caplog) -> None:
    sub = _Sub(ev, heavy=[False], polls=[RuntimeError("a bug")])
    ctx = _Context(active=100)
    with caplog.at_level(logging.ERROR, logger="kvservice"):
        assert list(watch.watch_events(_Hub(ev, sub, waits=[]), _request(), ctx)) == []
    assert ev == [("subscribe", ("pool-3f", 17, "grpc"), {"tenant": TENANT}), ("heavy", COMMITTED),
                  ("poll", 0.5, None), ("close",)]
    assert ctx.aborts == [(grpc.StatusCode.INTERNAL, "internal error in WatchEvents; see the manager's log")]
    assert ctx.statuses == []
    (rec,) = [r for r in caplog.records if r.name == "kvservice"]
    assert rec.getMessage() == "WatchEvents failed" and rec.levelno == logging.ERROR
    assert rec.exc_info[0] is RuntimeError
