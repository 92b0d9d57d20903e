"""StreamCore (kvservice/client/stream_core.py) without a transport: the bytes it sends, read back with the proto.

The oracle is the wire format of docs/DESIGN.md's StepStream: a request is a StepRequest whose stream fields
(stream_seq, delta_tables, delta_base, accept_tokens_added) follow the body; stream_seq counts 1, 2, 3 ... per
stream; delta_base is the mirror's seq when deltas are asked for, else 0. Parsed values are compared to the
arguments given (random non-zero ids and counts), never to the encoder's own output.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvservice.client import codec, deadline
from kvservice.client.client import BlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import CallBudget, RetryPolicy
from kvservice.client.stream_core import REFUSED_CALL, MirrorTables, StreamCore
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.server.stream import StreamSession
from kvservice.v1 import block_manager_pb2 as pb
from tests.clocks import ManualClock
from tests.support_stream import MAX_LEN, NUM_SLOTS, PAGE, SPECS


def _ints(t: pb.Tensor, name: str) -> list[int]:
    return [int(x) for x in from_tensor(t, name)]


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.choice(np.arange(1, 10**6), n, replace=False)]


def test_every_request_carries_its_body_then_the_next_stream_seq_and_the_delta_fields():
    rng = np.random.default_rng(2801)
    core = StreamCore("pool-x", PAGE, True, "s-fixed")
    assert core.stream_id == "s-fixed" and core.seq == 0 and core.pending is None
    core.mirror.seq = int(rng.integers(3, 900))          # a mirror holding the tables of some earlier request
    for n in range(1, 6):
        extend = _ids(rng, 3)
        tokens = [int(x) for x in rng.integers(2, 9, 3)]
        tables = bool(n % 2)
        data = core.request_bytes(None, extend, tokens, None, None, tables, False, {})
        assert core.seq == n and core.pending is None            # request_bytes holds nothing pending
        req = pb.StepRequest.FromString(data)
        assert req.pool == "pool-x" and req.stream_seq == n
        assert _ints(req.extend_seq_ids, "ids") == extend and _ints(req.extend_num_tokens, "n") == tokens
        assert req.omit_tables is (not tables)
        assert req.delta_tables is tables and req.accept_tokens_added is tables
        assert req.delta_base == (core.mirror.seq if tables else 0)
    plain = StreamCore("pool-x", PAGE, False, None)
    assert plain.stream_id.startswith("s-") and len(plain.stream_id) == 34
    plain.mirror.seq = 5
    req = pb.StepRequest.FromString(plain.request_bytes(None, [7], None, None, None, True, True, {}))
    assert (req.stream_seq, req.delta_tables, req.delta_base, req.accept_tokens_added) == (1, False, 0, False)
    assert req.include_block_table                     # full tables: the block table goes with them


def test_start_holds_the_request_pending_with_its_body_and_flags():
    core = StreamCore("p", PAGE, True, "s1")
    core.mirror.seq = 41
    body = codec.step_request("p", extend=[11, 12]).SerializeToString()
    seen = object()
    p = core.start(body, True, False, seen)
    assert core.pending is p and (p.seq, p.body, p.tables, p.block_table, p.seen) == (1, body, True, False, seen)
    assert p.data.startswith(body)
    tail = pb.StepRequest.FromString(p.data[len(body):])
    assert (tail.stream_seq, tail.delta_tables, tail.delta_base, tail.accept_tokens_added) == (1, True, 41, True)
    assert p.same(body, True, False)
    assert not p.same(body, True, True) and not p.same(body, False, False) and not p.same(body + b"\x00", True, False)
    q = core.start(body, False, True, None)
    assert q.seq == 2 and core.pending is q
    assert pb.StepRequest.FromString(q.data[len(body):]).delta_base == 0


def test_a_steady_decode_body_is_reused_only_while_ids_counts_and_flags_are_the_same():
    rng = np.random.default_rng(2802)
    core = StreamCore("p", PAGE, True, "s2")
    ids = _ids(rng, 4)
    first = core.body(None, ids, None, None, None, True, False, {})
    assert core.body(None, ids, None, None, None, True, False, {}) is first and core.reused == 1
    assert core.body(None, ids, 1, None, None, True, False, {}) == first          # a scalar 1 = the default
    counts = [int(x) for x in rng.integers(2, 50, 4)]
    other = core.body(None, ids, counts, None, None, True, False, {})
    assert _ints(pb.StepRequest.FromString(other).extend_num_tokens, "n") == counts
    again = core.body(None, ids, [c + 1 for c in counts], None, None, True, False, {})
    assert _ints(pb.StepRequest.FromString(again).extend_num_tokens, "n") == [c + 1 for c in counts]
    assert core.body(None, ids, None, None, None, False, False, {}) != first      # tables flag is in the key
    assert core.reused == 2
    # with deltas and tables the block table is never asked of the body (the mirror builds it)
    assert not pb.StepRequest.FromString(core.body(None, ids, None, None, None, True, True, {})).include_block_table
    assert pb.StepRequest.FromString(core.body(None, ids, None, None, None, False, True, {})).include_block_table


def test_a_mixed_body_carries_every_argument_and_is_never_cached():
    rng = np.random.default_rng(2803)
    core = StreamCore("p", PAGE, False, "s3")
    free, extend, admit = _ids(rng, 2), _ids(rng, 3), _ids(rng, 2)
    ext_n = [int(x) for x in rng.integers(2, 9, 3)]
    adm_n = [int(x) for x in rng.integers(10, 99, 2)]
    extra = {"salts": ["a", "b"], "request_id": "rq-9"}
    for _ in range(2):
        req = pb.StepRequest.FromString(core.body(free, extend, ext_n, admit, adm_n, True, True, extra))
        assert _ints(req.free_seq_ids, "f") == free
        assert _ints(req.extend_seq_ids, "e") == extend and _ints(req.extend_num_tokens, "en") == ext_n
        assert _ints(req.admit_seq_ids, "a") == admit and _ints(req.admit_num_tokens, "an") == adm_n
        assert list(req.admit_cache_salts) == ["a", "b"] and req.request_id == "rq-9"
        assert req.include_block_table and not req.omit_tables
    assert core.reused == 0
    data = core.request_bytes(free, None, None, admit, adm_n, False, False, {})
    req = pb.StepRequest.FromString(data)
    assert _ints(req.admit_num_tokens, "an") == adm_n and _ints(req.free_seq_ids, "f") == free
    assert req.omit_tables and not req.HasField("extend_seq_ids")


def test_expect_passes_the_reply_to_its_own_request_and_refuses_any_other():
    core = StreamCore("p", PAGE, True, "s-exp")
    reply = pb.StepReply(stream_seq=7, num_free_slots=3)
    assert core.expect(reply, 7) is reply
    with pytest.raises(ClientError) as e:
        core.expect(reply, 8)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "stream s-exp: got the reply to request 7 while waiting for request 8" in e.value.message


def test_an_unanswered_request_names_stream_and_seq_and_stays_pending_unless_refused():
    core = StreamCore("p", PAGE, True, "s-un")
    p = core.start(b"", True, False, None)
    err = ClientError(grpc.StatusCode.UNAVAILABLE, "Connection refused", "NO_LEADER", {"k": "v"})
    out = core.unanswered(err, p.seq)
    assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_LEADER")
    assert out.metadata == {"k": "v", "stream_id": "s-un", "stream_seq": "1"}
    assert out.message.startswith("Connection refused; request 1 of stream s-un may or may not have been applied")
    assert core.pending is p
    for code in REFUSED_CALL:
        q = core.start(b"", True, False, None)
        out = core.unanswered(ClientError(code, "no", "R", {"x": "1"}), q.seq)
        assert core.pending is None and out.code == code and out.reason == "R"
        assert out.message == f"no (request {q.seq} of stream s-un was not applied)"
        assert out.metadata == {"x": "1", "stream_id": "s-un", "stream_seq": str(q.seq)}


@pytest.fixture
def clock(monkeypatch):
    c = ManualClock(50.0)
    monkeypatch.setattr(deadline, "clock", c)
    return c


def test_broken_counts_every_reconnection_and_raises_when_it_must_stop(clock):
    client = BlockManagerClient("127.0.0.1:1", retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.02))
    try:
        core = StreamCore("p", PAGE, True, "s-br")
        core.start(b"", True, False, None)
        budget = core.budget(client, 10.0, 1)
        assert isinstance(budget, CallBudget) and budget.name == "StepStream s-br (request 1)"
        down = ClientError(grpc.StatusCode.UNAVAILABLE, "down")
        for n in range(1, 5):
            budget.attempt_timeout()
            pause = core.broken(client, down, 1, budget)
            assert 0.0 < pause <= 0.02 and core.reconnects == n
        with pytest.raises(ClientError) as e:                       # a final code: not reopened
            core.broken(client, ClientError(grpc.StatusCode.NOT_FOUND, "gone"), 1, budget)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and core.reconnects == 4
        with pytest.raises(ClientError) as e:                       # the stream was closed
            core.broken(client, down, 1, budget, closed=True)
        assert e.value.metadata["stream_seq"] == "1" and core.reconnects == 4
        clock.now += 11.0                                           # the deadline is spent
        with pytest.raises(ClientError) as e:
            core.broken(client, down, 1, budget)
        assert e.value.reason == "RETRIES_EXHAUSTED" and core.reconnects == 4 and core.pending is not None
    finally:
        client.close()
    once = BlockManagerClient("127.0.0.1:1", retries=0)
    try:
        core = StreamCore("p", PAGE, True, "s-one")
        budget = core.budget(once, 10.0, 1)
        budget.attempt_timeout()
        with pytest.raises(ClientError) as e:
            core.broken(once, ClientError(grpc.StatusCode.UNAVAILABLE, "down"), 1, budget)
        assert e.value.reason == "RETRIES_EXHAUSTED" and core.reconnects == 0
    finally:
        once.close()


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_mirror_tables_equal_the_full_tables_of_a_unary_step(spec_name):
    """MirrorTables (the tables of a delta stream's result) equal what pool twin "b" returns in full tables."""
    spec, prefix = SPECS[spec_name]
    api = ManagerAPI(BlockManager())
    for name in ("a", "b"):
        api.CreatePool(codec.create_pool_request(name, spec, Sizing(num_slots=NUM_SLOTS, max_seq_len=MAX_LEN),
                                                 prefix_caching=prefix))
    rng = np.random.default_rng(2804)
    session, core = StreamSession("s"), StreamCore("a", PAGE, True, "s")
    ids = _ids(rng, 3)
    steps = [dict(admit=ids, admit_tokens=[int(x) for x in rng.integers(3, 12, 3)]),
             dict(extend=ids), dict(extend=ids, extend_tokens=[int(x) for x in rng.integers(1, 5, 3)])]
    for kw in steps:
        full = codec.parse_step(api.Step(codec.step_request("b", block_table=True, **kw)))
        data = core.request_bytes(kw.get("free"), kw.get("extend"), kw.get("extend_tokens"), kw.get("admit"),
                                  kw.get("admit_tokens"), True, True, {})
        got = core.result(session.apply(api, pb.StepRequest.FromString(data)), True, True)
        assert isinstance(got.tables, MirrorTables) and sorted(got.tables) == sorted(full.tables)
        own = codec.parse_step(core.mirror.full_reply())         # pool "a"'s generations (each pool has its own)
        assert len(got.tables) == len(full.tables)
        for sid, want in full.tables.items():
            have = got.tables[sid]
            assert got.tables[sid] is have                       # gathered once
            assert have.space == want.space
            np.testing.assert_array_equal(have.slot_mapping, want.slot_mapping)
            np.testing.assert_array_equal(have.table.indptr, want.table.indptr)
            np.testing.assert_array_equal(have.table.indices, want.table.indices)
            np.testing.assert_array_equal(have.table.last_page_len, want.table.last_page_len)
            np.testing.assert_array_equal(have.block_table, want.block_table)
            gens = own.tables[sid]
            assert want.slot_generations.shape == have.slot_generations.shape == want.slot_mapping.shape
            assert want.generations.shape == have.generations.shape == want.table.indices.shape
            np.testing.assert_array_equal(have.slot_generations, gens.slot_generations)
            np.testing.assert_array_equal(have.generations, gens.generations)
            assert have.generations.dtype == have.slot_generations.dtype == np.uint32
        with pytest.raises(KeyError):
            got.tables[max(full.tables) + 1]
    no_bt = MirrorTables(core.mirror, False)
    assert all(no_bt[sid].block_table is None for sid in no_bt)


def _served_core(deltas: bool = True):
    """A manager with pool "a", a stream session on it and a StreamCore, after one admission applied."""
    spec, prefix = SPECS["per_layer"]
    api = ManagerAPI(BlockManager())
    api.CreatePool(codec.create_pool_request("a", spec, Sizing(num_slots=NUM_SLOTS, max_seq_len=MAX_LEN),
                                             prefix_caching=prefix))
    session, core = StreamSession("s"), StreamCore("a", PAGE, deltas, "s")
    core.client = BlockManagerClient("127.0.0.1:1")             # its position tracker only: nothing is sent
    data = core.request_bytes(None, None, None, [31, 32], [5, 7], True, False, {})
    reply = session.apply(api, pb.StepRequest.FromString(data))
    res = core.result(core.checked(reply, core.client.position.seen()), True, False)
    assert res.seq_ids.tolist() == [31, 32] and (core.mirror.seq == 1) is deltas
    return api, session, core


def test_a_refused_reply_raises_its_error_and_an_already_applied_one_resets_the_mirror():
    _, _, core = _served_core()
    try:
        bad = pb.StepReply(stream_seq=2, error=pb.RequestStatus(code=grpc.StatusCode.NOT_FOUND.value[0],
                                                                message="no seq 9", reason="SEQ_NOT_FOUND",
                                                                metadata={"seq_id": "9"}))
        with pytest.raises(ClientError) as e:
            core.result(bad, True, False)
        assert (e.value.code, e.value.message, e.value.reason, e.value.metadata) == (
            grpc.StatusCode.NOT_FOUND, "no seq 9", "SEQ_NOT_FOUND", {"seq_id": "9"})
        assert core.mirror.seq == 1 and core.last_reply is bad              # an ordinary refusal keeps the mirror
        odd = pb.StepReply(error=pb.RequestStatus(code=999, message="m", reason="REQUEST_ALREADY_APPLIED"))
        with pytest.raises(ClientError) as e:
            core.result(odd, True, False)
        assert e.value.code == grpc.StatusCode.UNKNOWN and e.value.reason == "REQUEST_ALREADY_APPLIED"
        assert core.mirror.seq == 0                                          # a reply we never saw moved tables on
    finally:
        core.client.close()


def test_a_reply_without_tables_resets_a_delta_mirror_and_a_broken_delta_is_data_loss():
    api, session, core = _served_core()
    try:
        data = core.request_bytes(None, [31, 32], None, None, None, False, False, {})
        res = core.result(session.apply(api, pb.StepRequest.FromString(data)), False, False)
        assert res.seq_ids.tolist() == [31, 32] and res.for_layer(0).table is None and core.mirror.seq == 0
        data = core.request_bytes(None, [31, 32], None, None, None, True, False, {})
        res = core.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        assert core.mirror.seq == 3 and res.num_tokens.tolist() == [7, 9]
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        reply = session.apply(api, pb.StepRequest.FromString(data))
        assert reply.HasField("delta")
        reply.delta.base_seq += 5                                            # not the mirror's base
        with pytest.raises(ClientError) as e:
            core.result(reply, True, False)
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "MIRROR_OUT_OF_SYNC")
        assert e.value.message.startswith("stream s: ") and core.mirror.seq == 0
    finally:
        core.client.close()
    api, session, plain = _served_core(deltas=False)
    try:
        data = plain.request_bytes(None, [31], None, None, None, True, False, {})
        res = plain.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        assert res.for_layer(0).table.indptr.tolist() == [0, 2] and not isinstance(res.tables, MirrorTables)
    finally:
        plain.client.close()


def test_a_rolled_back_reply_resets_the_mirror_and_settle_keeps_only_refusals():
    from kvservice.client.position import StateRolledBack

    api, session, core = _served_core()
    try:
        tracker = core.client.position
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        first = session.apply(api, pb.StepRequest.FromString(data))
        first.position.CopyFrom(pb.JournalPosition(incarnation=2, seq=40, lineage=0xABC))
        core.result(core.checked(first, tracker.seen()), True, False)
        assert dict(tracker.seen()) == {0xABC: 40} and core.mirror.seq == 2
        seen = tracker.seen()
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        reply = session.apply(api, pb.StepRequest.FromString(data))
        reply.position.CopyFrom(pb.JournalPosition(incarnation=2, seq=39, lineage=0xABC))   # behind: rolled back
        with pytest.raises(StateRolledBack):
            core.checked(reply, seen)
        assert core.mirror.seq == 0
        p = core.start(b"", True, False, seen)
        with pytest.raises(StateRolledBack):
            core.settle(p, reply)
        assert core.settled is None
        refused = pb.StepReply(error=pb.RequestStatus(code=grpc.StatusCode.NOT_FOUND.value[0], message="gone"))
        p = core.start(b"", True, False, tracker.seen())
        core.settle(p, refused)
        seq, err = core.settled
        assert seq == p.seq and isinstance(err, ClientError) and err.message == "gone" and core.pending is None
        data = core.request_bytes(None, [32], None, None, None, False, False, {})
        good = session.apply(api, pb.StepRequest.FromString(data))
        p = core.start(data, False, False, tracker.seen())
        core.settle(p, good)
        assert core.settled[0] == p.seq and core.settled[1].seq_ids.tolist() == [32] and core.pending is None
    finally:
        core.client.close()


def test_route_method_opens_one_method_per_address():
    client = BlockManagerClient("127.0.0.1:1")
    try:
        core = StreamCore("p", PAGE, True, "s-r")
        m = core.route_method(client)
        assert core.route == 0 and core.route_method(client) is m and core._methods == {0: m}
    finally:
        client.close()


def test_a_results_tables_must_be_read_before_the_next_step():
    from kvservice.contract.mirror import MirrorError

    api, session, core = _served_core()
    try:
        data = core.request_bytes(None, [31, 32], None, None, None, True, False, {})
        first = core.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        sid = next(iter(first.tables))
        data = core.request_bytes(None, [31, 32], None, None, None, True, False, {})
        core.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        with pytest.raises(MirrorError, match="the tables of request 2 were replaced by request 3"):
            first.tables[sid]
    finally:
        core.client.close()
