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
        assert world.sv.budget.charged_bytes == 0                 # an open session starts charged nothing
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


def test_a_new_session_starts_empty_in_the_token_less_namespace() -> None:
    """StreamSession's docstring: last_seq 0 (none answered), held None (nothing known), no call open, no charge,
    last_used 0 until the registry touches it; tenant "" without tokens."""
    s = stream.StreamSession("st-new")
    assert (s.stream_id, s.tenant, s.last_seq, s.held, s.last_used, s.calls, s.charge) == (
        "st-new", "", 0, None, 0.0, 0, None)
    assert s.kept_bytes() == 0


def test_the_registry_defaults_hold_4096_sessions_idle_for_600_s_and_64_open_streams() -> None:
    """docs/ARCHITECTURE.md: --max-streams defaults to 64 open streams; the registry keeps 4096 sessions and expires
    one idle for more than 600 s."""
    clock = ManualClock(50.0)
    reg = StreamRegistry(clock=clock)
    assert [reg.enter() for _ in range(65)] == [True] * 64 + [False]
    first = reg.session("s0")
    assert first.tenant == ""                                      # the token-less namespace by default
    for i in range(1, 4096):
        reg.session(f"s{i}")
    assert len(reg) == 4096 and reg.session("s0") is first        # all kept (s0 now the newest)
    reg.session("s4096")
    assert len(reg) == 4096 and reg.session("s0") is first        # the 4097th dropped the oldest, s1
    assert reg.session("s1").last_seq == 0 and len(reg) == 4096
    clock.now += 600.0
    assert reg.session("s0") is first                              # idle exactly 600 s: kept
    clock.now += 600.5
    assert reg.session("s0") is not first and len(reg) == 1        # idle past it: a new one, the rest expired


def test_a_request_that_is_not_a_step_request_is_refused_naming_what_was_expected() -> None:
    """step_one: something other than a StepRequest (without the server's stand-in's type_name) is refused
    INVALID_ARGUMENT "request is not a valid StepRequest message" on stream_seq 0, and the stream goes on."""
    from google.rpc import code_pb2

    seen: list = []
    servicer = SimpleNamespace(journal=None, limits=None)
    reply = stream.step_one(servicer, stream.StreamSession("st-x"), SimpleNamespace(pool="p"), JournalUnavailable,
                            lambda s, r: seen.append(r))
    assert (reply.stream_seq, reply.error.code, reply.error.message, reply.error.reason) == (
        0, code_pb2.INVALID_ARGUMENT, "request is not a valid StepRequest message", "INVALID_ARGUMENT")
    assert seen == [reply]


def test_without_a_journal_a_step_is_applied_and_checked_against_the_limits_with_its_one_decoding() -> None:
    """step_one with no journal (a manager without durable state): the request is checked once, Limits.check("Step",
    the request, the manager, its decoding), then applied; the reply names the stream and carries its seq."""
    from kvservice.client.codec import step_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.manager.api import ManagerAPI
    from kvservice.manager.pools import BlockManager
    from kvservice.manager.step_input import DecodedStep

    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=64))
    checks: list = []
    limits = SimpleNamespace(check=lambda *a: checks.append(a))
    servicer = SimpleNamespace(journal=None, limits=limits, api=ManagerAPI(m))
    session = stream.StreamSession("st-nj", "t")
    r = step_request("p", admit=[5], admit_tokens=[3])
    r.stream_seq = 1
    reply = stream.step_one(servicer, session, r, JournalUnavailable, lambda s, rep: None)
    assert not reply.HasField("error") and (reply.stream_seq, reply.stream_id) == (1, "st-nj")
    ((method, req, manager, step),) = checks
    assert method == "Step" and req is r and manager is m and type(step) is DecodedStep
    assert step.admit_seq_ids.tolist() == [5] and session.last_seq == 1
    with m.locked("p") as pool:
        assert pool.num_sequences == 1
