"""kvservice/server/stream.py's StreamRegistry and StreamSession against plain-Python models of their documented rules,
and step_one's replies written out by hand.

Rules (the module and class docstrings): a session is keyed by (tenant, stream id); an unknown, dropped or expired
one (idle more than idle_seconds) is replaced by a new one; sessions are ordered by when their stream last opened
and the least recently opened ones go past max_streams or once idle; at most max_active calls are open at once.
stream_seq: >= 1, and no more than one ahead of the highest answered (any seq on a session that answered none).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import pytest
from google.rpc import code_pb2

from kvservice.contract.errors import InvalidArgument, JournalUnavailable
from kvservice.server.stream import StreamRegistry, StreamSession
from kvservice.v1 import block_manager_pb2 as pb
from tests.clocks import ManualClock


@pytest.mark.parametrize("seed", range(6))
def test_the_registry_keeps_and_drops_sessions_as_an_lru_model_with_idle_expiry(seed: int) -> None:
    rng = np.random.default_rng(seed)
    max_streams, idle = int(rng.integers(1, 5)), float(rng.integers(3, 12))
    clock = ManualClock()
    reg = StreamRegistry(max_streams=max_streams, idle_seconds=idle, clock=clock)
    model: OrderedDict[tuple[str, str], list] = OrderedDict()      # key -> [session object, last_used]
    ids, tenants = [f"s{i}" for i in range(6)], ["", "t1", "t2"]
    for _ in range(300):
        op = rng.integers(0, 4)
        if op == 0:
            clock.now += float(rng.integers(0, 5))
        elif op == 1 and model:                     # a request on an open stream refreshes its session
            key = list(model)[int(rng.integers(0, len(model)))]
            model[key][0].last_used = model[key][1] = clock.now
        else:
            key = (tenants[int(rng.integers(0, 3))], ids[int(rng.integers(0, 6))])
            old = model.pop(key, None)
            s = reg.session(key[1], key[0])
            if old is not None and clock.now - old[1] <= idle:
                assert s is old[0]                  # found again, with what it kept
            else:
                assert s is not None and all(s is not v[0] for v in model.values())
                assert (s.stream_id, s.tenant, s.last_seq, s.held, s.calls) == (key[1], key[0], 0, None, 0)
                s.last_seq = int(rng.integers(1, 100))     # something a new session would not have
            model[key] = [s, clock.now]
            while model:
                first = next(iter(model.values()))
                if len(model) <= max_streams and clock.now - first[1] <= idle:
                    break
                model.popitem(last=False)
            assert s.last_used == clock.now
        assert len(reg) == len(model)
    for key, (s, last) in list(model.items()):     # each kept one is found again, itself, unless idle since
        assert (reg.session(key[1], key[0]) is s) == (clock.now - last <= idle)


def test_a_registry_holds_exactly_max_streams_sessions() -> None:
    reg = StreamRegistry(max_streams=3, clock=ManualClock())
    kept = [reg.session(f"s{i}") for i in range(3)]
    assert len(reg) == 3
    assert [reg.session(f"s{i}") for i in range(3)] == kept        # all three found again at the cap


def test_open_calls_are_counted_up_to_max_active() -> None:
    rng = np.random.default_rng(5)
    for cap in (1, 2, 5):
        reg, open_ = StreamRegistry(max_active=cap), 0
        for _ in range(60):
            if rng.integers(0, 2) and open_:
                reg.leave()
                open_ -= 1
            else:
                want = open_ < cap
                assert reg.enter() is want
                open_ += want
            assert reg.active == open_


@pytest.mark.parametrize("last", [0, 1, 2, 7])
def test_check_order_accepts_exactly_the_documented_seqs(last: int) -> None:
    s = StreamSession("st-9")
    s.last_seq = last
    for seq in range(-2, last + 5):
        ok = seq >= 1 and (last == 0 or seq <= last + 1)
        if ok:
            s.check_order(seq)
            continue
        with pytest.raises(InvalidArgument) as err:
            s.check_order(seq)
        assert err.value.reason == "STREAM_SEQ"
        if seq < 1:
            assert err.value.message == ("stream_seq must be >= 1 on StepStream: number the requests of a stream "
                                         "1, 2, 3, ...")
            assert dict(err.value.metadata) == {}
        else:
            assert err.value.message == (f"stream_seq {seq} skips ahead: stream 'st-9' answered up to {last}; "
                                         f"send {last + 1} next (or resend an earlier one)")
            assert dict(err.value.metadata) == {"expected": str(last + 1)}


def _servicer():
    from kvservice.client.codec import create_pool_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.manager.api import ManagerAPI
    from kvservice.manager.pools import BlockManager
    from kvservice.server.limits import Limits
    from kvservice.server.metrics import ManagerMetrics
    from kvservice.server.servicer import BlockManagerServicer
    from kvservice.state.journal import Journal

    m = BlockManager()
    api = ManagerAPI(m)
    sv = BlockManagerServicer(api, ManagerMetrics(m), Journal(m), Limits())
    req = create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=64))
    sv.journal.execute("CreatePool", req, api.CreatePool)       # journaled: a rebuild from the journal keeps it
    return sv


def test_an_unexpected_failure_answers_internal_with_the_requests_seq_and_the_stream_goes_on(caplog) -> None:
    from kvservice.client.codec import step_request
    from kvservice.server.stream import step_one

    sv = _servicer()
    session = StreamSession("st-4")
    seen: list = []

    def boom(*_a, **_k):
        raise RuntimeError("a bug")
    real = sv.api.step_delta
    sv.api.step_delta = boom                         # a fault injected where the step runs
    r = step_request("p", admit=[3], admit_tokens=[5])
    r.stream_seq = 1
    with caplog.at_level(logging.ERROR, logger="kvservice"):
        reply = step_one(sv, session, r, JournalUnavailable, lambda s, rep: seen.append(rep))
    want = pb.StepReply(stream_seq=1, error=pb.RequestStatus(
        code=code_pb2.INTERNAL, message="internal error in StepStream; see the manager's log", reason="INTERNAL"))
    assert reply == want and seen == [want]
    (rec,) = [x for x in caplog.records if x.name == "kvservice"]
    assert rec.getMessage() == "StepStream request 1 of stream 'st-4' failed"
    assert (rec.pool, rec.stream_id) == ("p", "st-4") and rec.exc_info[0] is RuntimeError
    assert session.last_seq == 1
    sv.api.step_delta = real
    r2 = step_request("p", admit=[3], admit_tokens=[5])
    r2.stream_seq = 2
    ok = step_one(sv, session, r2, JournalUnavailable, lambda s, rep: seen.append(rep))
    assert not ok.HasField("error") and ok.stream_seq == 2 and ok.stream_id == "st-4"


def test_a_stream_requests_idempotency_key_is_stream_id_hash_seq_scoped_to_its_tenant() -> None:
    """Module docstring: the key is "<stream id>#<stream_seq>" unless the request brings its own request_id, and a
    tenant's key is "<len(tenant)>:<tenant>/<id>"; the journal keeps it with the request."""
    from kvservice.client.codec import step_request
    from kvservice.server.stream import step_one

    sv = _servicer()
    rng = np.random.default_rng(17)
    sent = []
    for tenant, stream_id, own in (("", "st-a", ""), ("acme", "st-b", ""), ("acme", "st-c", "mine-9")):
        session = StreamSession(stream_id, tenant)
        seq = int(rng.integers(1, 50))
        r = step_request("p", admit=[len(sent) + 1], admit_tokens=[int(rng.integers(1, 20))])
        r.stream_seq, r.request_id = seq, own
        reply = step_one(sv, session, r, JournalUnavailable, lambda s, rep: None)
        assert not reply.HasField("error") and (reply.stream_seq, reply.stream_id) == (seq, stream_id)
        assert session.last_seq == seq
        key = own or f"{stream_id}#{seq}"
        sent.append(f"{len(tenant)}:{tenant}/{key}" if tenant else key)
    steps = [pb.StepRequest.FromString(e.request) for e in sv.journal.store.entries_after(0) if e.method == "Step"]
    assert [s.request_id for s in steps] == sent


def test_refusals_are_replies_and_a_failed_journal_breaks_the_stream() -> None:
    from kvservice.client.codec import step_request
    from kvservice.contract.serving import Malformed
    from kvservice.server.stream import step_one

    sv = _servicer()
    session = StreamSession("st-r")
    replies: list = []
    junk = Malformed("kvservice.v1.StepRequest", ValueError("truncated"))   # the stand-in for unparsed bytes
    reply = step_one(sv, session, junk, JournalUnavailable, lambda s, rep: replies.append(rep))
    assert reply == pb.StepReply(stream_seq=0, error=pb.RequestStatus(
        code=code_pb2.INVALID_ARGUMENT, message="request is not a valid kvservice.v1.StepRequest message",
        reason="INVALID_ARGUMENT"))
    r = step_request("p", extend=[77], extend_tokens=[1])      # an unknown sequence: NOT_FOUND, the stream goes on
    r.stream_seq = 3
    reply = step_one(sv, session, r, JournalUnavailable, lambda s, rep: replies.append(rep))
    assert (reply.stream_seq, reply.error.code) == (3, code_pb2.NOT_FOUND) and replies[-1] is reply
    assert session.last_seq == 3
    sv.journal._fail("disk gone")
    r.stream_seq = 4
    with pytest.raises(JournalUnavailable) as err:
        step_one(sv, session, r, JournalUnavailable, lambda s, rep: replies.append(rep))
    assert str(err.value) == "the manager stopped serving: disk gone" and replies[-1] is None


def _held(rng: np.random.Generator, n: int):
    import weakref

    from kvservice.manager.delta import HeldTables

    class Anchor:
        pass
    anchor = Anchor()
    return HeldTables(1, weakref.ref(anchor), 0, rng.integers(1, 1 << 40, n).astype(np.uint64),
                      rng.integers(1, 1000, n).astype(np.int64)), anchor


def test_a_session_charges_what_it_keeps_keeps_nothing_past_the_budget_and_the_last_call_frees_it() -> None:
    """Module docstring: what an open session keeps (the held tables: 8 bytes per uint64 id and int64 count) is
    charged to its tenant; with no room it keeps nothing; when its last call closes the charge goes, last_seq stays."""
    from kvservice.server.budget import BudgetLimits, MemoryBudget

    rng = np.random.default_rng(19)
    budget = MemoryBudget(BudgetLimits(total_bytes=1 << 20, tenant_bytes=4096))
    s = StreamSession("st-m", "acme")
    assert s.kept_bytes() == 0
    s.account()                                              # no charge (no budget): nothing happens
    n = int(rng.integers(5, 50))
    s.held, _anchor = _held(rng, n)
    assert s.kept_bytes() == 16 * n
    s.charge = budget.charge("acme", 0, "StepStream session")
    s.calls, s.last_seq = 2, 9
    s.account()
    assert budget.tenant_bytes("acme") == 16 * n and s.held is not None
    s.held, _anchor2 = _held(rng, 300)                       # 4800 bytes > the tenant's 4096: kept no more
    s.account()
    assert s.held is None and budget.tenant_bytes("acme") == 0 and s.charge.nbytes == 0
    s.held = _held(rng, n)[0]
    s.account()
    s.close_call()                                           # one of two calls: it keeps what it has
    assert s.calls == 1 and s.held is not None and budget.tenant_bytes("acme") == 16 * n
    s.close_call()                                           # the last: keeps only last_seq
    assert (s.calls, s.held, s.last_seq, budget.tenant_bytes("acme"), budget.charged_bytes) == (0, None, 9, 0, 0)
    s.held = _held(rng, 3)[0]
    s.forget()
    assert s.held is None and s.kept_bytes() == 0


def test_error_reply_maps_each_error_class_to_its_grpc_code() -> None:
    from kvservice.contract.errors import AlreadyExists, FailedPrecondition, KVError, NotFound, ResourceExhausted
    from kvservice.server.stream import error_reply

    # google.rpc.Code numbers: INVALID_ARGUMENT 3, NOT_FOUND 5, ALREADY_EXISTS 6, RESOURCE_EXHAUSTED 8,
    # FAILED_PRECONDITION 9, INTERNAL 13
    for cls, code in ((InvalidArgument, 3), (NotFound, 5), (AlreadyExists, 6), (ResourceExhausted, 8),
                      (FailedPrecondition, 9), (KVError, 13)):
        err = cls(f"{cls.__name__} said no", reason="WHY_" + cls.__name__.upper(), pool="p", n=4)
        assert error_reply(12, err) == pb.StepReply(stream_seq=12, error=pb.RequestStatus(
            code=code, message=f"{cls.__name__} said no", reason="WHY_" + cls.__name__.upper(),
            metadata={"pool": "p", "n": "4"}))


def test_request_ids_are_scoped_by_tenant_length_and_name() -> None:
    from kvservice.server.stream import scoped_request_id

    assert scoped_request_id("", "r-1") == "r-1"
    assert scoped_request_id("acme", "r-1") == "4:acme/r-1"
    assert scoped_request_id("a", "b/r") == "1:a/b/r" != scoped_request_id("a/b", "r") == "3:a/b/r"


def test_step_stream_over_the_wire_ids_seqs_metrics_and_the_open_stream_cap() -> None:
    """step_stream: one reply per request in order, each naming the stream id of the call metadata (a made-up
    "anon-<32 hex>" without one, INVALID_ARGUMENT for a malformed one); each request counts as a Step; a stream
    past max_streams open ones is refused RESOURCE_EXHAUSTED."""
    import re
    import threading

    import grpc

    from kvservice.client.codec import create_pool_request, step_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.contract.transport import STREAM_ID_KEY
    from kvservice.server.app import serve
    from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

    rng = np.random.default_rng(59)
    running = serve("127.0.0.1:0", max_streams=1)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.BlockManagerStub(channel)
    try:
        stub.CreatePool(create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=64)),
                        timeout=10)

        def requests(n: int, first_id: int):
            for i in range(n):
                r = step_request("p", admit=[first_id + i], admit_tokens=[int(rng.integers(1, 9))])
                r.stream_seq = i + 1
                yield r
        n = int(rng.integers(2, 6))
        replies = list(stub.StepStream(requests(n, 100), metadata=[(STREAM_ID_KEY, "sched-7")], timeout=10))
        assert [(r.stream_seq, r.stream_id, r.HasField("error")) for r in replies] == \
            [(i + 1, "sched-7", False) for i in range(n)]
        (anon,) = list(stub.StepStream(requests(1, 200), timeout=10))
        assert re.fullmatch(r"anon-[0-9a-f]{32}", anon.stream_id) and anon.stream_seq == 1
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StepStream(requests(1, 300), metadata=[(STREAM_ID_KEY, "bad id!")], timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"metadata {STREAM_ID_KEY} must be 1-64 characters of [A-Za-z0-9_.:-]"
        count = running.metrics.registry.get_sample_value("kvservice_rpc_duration_seconds_count",
                                                          {"method": "Step", "code": "OK"})
        assert count == n + 1

        hold, opened = threading.Event(), threading.Event()

        def held_open():
            yield from requests(1, 400)
            opened.set()
            hold.wait(10)
        call = stub.StepStream(held_open(), metadata=[(STREAM_ID_KEY, "sched-8")], timeout=20)
        assert next(call).stream_seq == 1 and opened.wait(10)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StepStream(requests(1, 500), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == ("this manager has 1 streams open, its limit (kvservice serve --max-streams); "
                                       "close one, or use unary calls")
        hold.set()
        assert list(call) == []
    finally:
        channel.close()
        running.stop(0)


def test_a_reconnect_overlapping_its_stream_reuses_the_sessions_charge_and_all_is_given_back() -> None:
    """Module docstring: what an open session keeps is charged to its tenant's budget, and released when its last
    call closes. A client that reconnects while its old call is still open (the overlap a reconnect may have) is
    the same session: one charge, so once both calls closed nothing stays charged."""
    import threading

    import grpc

    from kvservice.client.codec import create_pool_request, step_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.contract.transport import STREAM_ID_KEY
    from kvservice.server.app import serve
    from kvservice.server.budget import BudgetLimits
    from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

    running = serve("127.0.0.1:0", budget=BudgetLimits(total_bytes=64 << 20, tenant_bytes=32 << 20))
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.BlockManagerStub(channel)
    md = [(STREAM_ID_KEY, "sched-ov")]
    try:
        stub.CreatePool(create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=64)),
                        timeout=10)
        hold = threading.Event()

        def first():
            r = step_request("p", admit=[1, 2, 3], admit_tokens=[3, 5, 7])
            r.stream_seq, r.delta_tables = 1, True
            yield r
            hold.wait(10)
        call_a = stub.StepStream(first(), metadata=md, timeout=20)
        assert next(call_a).stream_seq == 1
        session = next(iter(running.servicer.streams._sessions.values()))
        charge = session.charge
        assert session.calls == 1 and charge.nbytes == 3 * 16               # 3 rows held: 16 bytes each
        r2 = step_request("p", extend=[1], extend_tokens=[1])
        r2.stream_seq, r2.delta_tables = 2, True
        (reply,) = list(stub.StepStream(iter([r2]), metadata=md, timeout=10))       # the reconnect, A still open
        assert reply.stream_seq == 2 and not reply.HasField("error")
        assert session.charge is charge and charge.nbytes == session.kept_bytes() > 0 and session.calls == 1
        hold.set()
        assert list(call_a) == []
        assert (session.calls, session.last_seq, running.budget.charged_bytes) == (0, 2, 0)
    finally:
        channel.close()
        running.stop(0)
