"""kvservice/server/stream.py step_stream, its whole contract with step_one stood in for: the session it opens (the
call's stream id within the caller's tenant), what it charges, how each request is observed as a Step (a broken
stream as UNAVAILABLE), when it touches the session, and what it gives back however the call ends.

Oracles: the module docstring (a stream is named by the metadata kvservice-stream-id within the tenant's
namespace; a session's keeping is charged to the tenant's memory budget; each stream request is observed as
method "Step"; only a broken stream, a failed journal, ends the call, UNAVAILABLE; `kvservice serve --max-streams`
caps open streams) and the exact refusal texts of the gRPC statuses. step_one is replaced by a recorder (it has
tests of its own) and the registry's clock is a ManualClock, so every value is compared exactly.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import grpc
import pytest

from kvservice.contract.errors import JournalUnavailable
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.server import stream
from kvservice.server.budget import BudgetLimits, MemoryBudget
from kvservice.server.stream import StreamRegistry
from tests.clocks import ManualClock

TENANT = "tenant-r7"


class _Aborted(Exception):
    """What grpc's context.abort raises."""


class _Context:
    def __init__(self, metadata) -> None:
        self.metadata = metadata
        self.aborts: list = []

    def invocation_metadata(self):
        return self.metadata

    def abort(self, code, details):
        self.aborts.append((code, details))
        raise _Aborted(details)


class _Metrics:
    def __init__(self) -> None:
        self.calls: list = []

    def observe(self, *args) -> None:
        self.calls.append(("observe", *args))

    def observe_reply(self, *args) -> None:
        self.calls.append(("observe_reply", *args))


@pytest.fixture
def world(monkeypatch):
    """A servicer (registry on a ManualClock, budget, metrics recorder) and a step_one that records its arguments,
    reports (seconds, reply) to `observe` and moves the clock; a script entry that is an exception is raised after
    observe(seconds, None)."""
    clock = ManualClock(1000.0)
    sv = SimpleNamespace(streams=StreamRegistry(max_active=2, clock=clock), metrics=_Metrics(),
                         budget=MemoryBudget(BudgetLimits(1 << 20, 1 << 20)))
    seen: list = []
    script: list = []

    def step_one(servicer, session, request, broken, observe):
        seen.append((servicer, session, request, broken, session.calls, sv.streams.active))
        clock.now += 2.5
        out = script.pop(0)
        if isinstance(out, Exception):
            observe(0.375, None)
            raise out
        observe(0.125, out)
        return out
    monkeypatch.setattr(stream, "step_one", step_one)
    monkeypatch.setattr(stream, "current_principal", lambda: TENANT)
    return SimpleNamespace(sv=sv, clock=clock, seen=seen, script=script)


def test_each_request_is_answered_in_order_observed_as_a_step_and_touches_its_session(world) -> None:
    replies = [SimpleNamespace(n=i) for i in range(3)]
    world.script.extend(replies)
    requests = ["r0", "r1", "r2"]
    ctx = _Context([("other", "x"), (STREAM_ID_KEY, "sched-9.a:b_c-d")])
    out = []
    for reply in stream.step_stream(world.sv, iter(requests), ctx):
        (session,) = world.sv.streams._sessions.values()
        assert session.last_used == world.clock.now              # touched when it was answered
        out.append(reply)
    assert out == replies and ctx.aborts == []
    assert [s[2:] for s in world.seen] == [(r, JournalUnavailable, 1, 1) for r in requests]
    assert all(s[0] is world.sv and s[1] is session for s in world.seen)
    assert (session.stream_id, session.tenant) == ("sched-9.a:b_c-d", TENANT)
    assert world.sv.streams._sessions == {(TENANT, "sched-9.a:b_c-d"): session}
    assert world.sv.metrics.calls == [("observe_reply", "Step", 0.125, r) for r in replies]
    assert (session.charge.tenant, session.charge.what, session.charge.nbytes) == (TENANT, "StepStream session", 0)
    assert (session.calls, world.sv.streams.active, session.last_used) == (0, 0, 1007.5)


def test_a_broken_journal_ends_the_call_unavailable_observed_as_such_and_gives_everything_back(world) -> None:
    world.script.extend([SimpleNamespace(n=0), JournalUnavailable("the manager stopped serving: fenced by epoch 4")])
    ctx = _Context([(STREAM_ID_KEY, "s1")])
    got = stream.step_stream(world.sv, iter(["a", "b", "c"]), ctx)
    assert next(got).n == 0
    with pytest.raises(_Aborted):
        next(got)
    assert ctx.aborts == [(grpc.StatusCode.UNAVAILABLE, "the manager stopped serving: fenced by epoch 4")]
    assert [c[:3] for c in world.sv.metrics.calls[:1]] == [("observe_reply", "Step", 0.125)]
    assert world.sv.metrics.calls[1:] == [("observe", "Step", 0.375, "UNAVAILABLE")]
    (session,) = world.sv.streams._sessions.values()
    assert (session.calls, world.sv.streams.active, len(world.seen)) == (0, 0, 2)
    assert session.last_used == 1002.5                         # the request that broke it did not touch it


def test_a_malformed_stream_id_is_refused_before_anything_is_opened(world) -> None:
    ctx = _Context([(STREAM_ID_KEY, "bad id!")])
    with pytest.raises(_Aborted):
        next(stream.step_stream(world.sv, iter(["a"]), ctx))
    assert ctx.aborts == [(grpc.StatusCode.INVALID_ARGUMENT,
                           "metadata kvservice-stream-id must be 1-64 characters of [A-Za-z0-9_.:-]")]
    assert (world.sv.streams.active, len(world.sv.streams), world.seen) == (0, 0, [])


def test_a_stream_past_max_streams_is_refused_and_holds_nothing(world) -> None:
    world.sv.streams.active = 2
    ctx = _Context(None)
    with pytest.raises(_Aborted):
        next(stream.step_stream(world.sv, iter(["a"]), ctx))
    assert ctx.aborts == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "this manager has 2 streams open, its limit "
                           "(kvservice serve --max-streams); close one, or use unary calls")]
    assert (world.sv.streams.active, len(world.sv.streams), world.seen) == (2, 0, [])


def test_an_unnamed_stream_gets_a_made_up_id_and_a_reconnect_keeps_its_sessions_charge(world) -> None:
    world.script.extend([SimpleNamespace(n=0)])
    assert [r.n for r in stream.step_stream(world.sv, iter(["a"]), _Context(None))] == [0]
    (key,) = world.sv.streams._sessions
    assert key[0] == TENANT and re.fullmatch(r"anon-[0-9a-f]{32}", key[1])
    world.script.extend([SimpleNamespace(n=1), SimpleNamespace(n=2)])
    first = stream.step_stream(world.sv, iter(["b"]), _Context([(STREAM_ID_KEY, "re")]))
    assert next(first).n == 1
    session = world.sv.streams._sessions[(TENANT, "re")]
    charge = session.charge
    second = stream.step_stream(world.sv, iter(["c"]), _Context([(STREAM_ID_KEY, "re")]))
    assert next(second).n == 2
    assert session.charge is charge and session.calls == 2 and world.sv.streams.active == 2
    assert list(first) == [] and list(second) == []
    assert (session.calls, world.sv.streams.active) == (0, 0)


def test_without_a_budget_a_session_is_not_charged(world) -> None:
    del world.sv.budget
    world.script.extend([SimpleNamespace(n=0)])
    assert len(list(stream.step_stream(world.sv, iter(["a"]), _Context([(STREAM_ID_KEY, "nb")])))) == 1
    (session,) = world.sv.streams._sessions.values()
    assert session.charge is None
