"""StreamCore.result on a delta stream (kvservice/client/stream_core.py): the StepResult of a reply applied to the
mirror carries every field of the reply that is not a table, as a unary Step's parse does (block_manager.proto's
StepReply): layer_index_space, num_free_slots, admit_cached_tokens (INT64 [A]), copies (group -> INT64 [n, 2]
slot pairs) with their generations (UINT32 [n, 2]), the journal position and lineage, and pool_incarnation; the
batch fields come from the mirror, whose tables are the result's (MirrorTables). Hand-built values on a served
reply (the manager of tests/unit/test_mut_m28d_stream_core.py's _served_core).
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from kvservice.client.stream_core import MirrorTables, StreamCore
from kvservice.contract.mirror import MirrorError
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.unit.test_mut_m28d_stream_core import _served_core
from tests.unit.test_mut_s21a_client import _le


def test_a_delta_results_non_table_fields_are_the_replys():
    api, session, core = _served_core()
    rng = np.random.default_rng(7175)
    try:
        data = core.request_bytes(None, [31, 32], [2, 3], None, None, True, True, {})
        reply = session.apply(api, pb.StepRequest.FromString(data))
        assert reply.HasField("delta")
        pairs = [int(x) for x in rng.integers(1, 2**40, 4)]
        gens = [int(x) for x in rng.integers(1, 2**32, 4)]
        cached = [int(x) for x in rng.integers(1, 2**40, 2)]
        inc, seq, lineage, pool_inc = (int(x) for x in rng.integers(1, 2**62, 4))
        reply.copies.add(group=1, pairs=cpb.Tensor(dtype=cpb.INT64, shape=[2, 2], data=_le("q", pairs)),
                         generations=cpb.Tensor(dtype=cpb.UINT32, shape=[2, 2], data=_le("I", gens)))
        reply.admit_cached_tokens.CopyFrom(cpb.Tensor(dtype=cpb.INT64, shape=[2], data=_le("q", cached)))
        reply.position.CopyFrom(pb.JournalPosition(incarnation=inc, seq=seq, lineage=lineage))
        reply.pool_incarnation = pool_inc
        res = core.result(reply, True, True)
    finally:
        core.client.close()
    assert res.seq_ids.tolist() == [31, 32] and res.num_tokens.tolist() == [7, 10]
    assert res.new_token_indptr.tolist() == [0, 2, 5]
    assert isinstance(res.tables, MirrorTables) and sorted(res.tables) == sorted(core.mirror.spaces)
    sid = next(iter(res.tables))
    assert res.tables[sid].block_table is not None                   # asked for: gathered from the mirror
    assert res.layer_index_space == tuple(reply.layer_index_space) and len(res.layer_index_space) > 0
    assert res.num_free_slots == reply.num_free_slots > 0
    assert res.cached_tokens.tolist() == cached
    assert list(res.copies) == [1] and res.copies[1].tolist() == [pairs[:2], pairs[2:]]
    assert list(res.copy_generations) == [1] and res.copy_generations[1].tolist() == [gens[:2], gens[2:]]
    assert res.copy_generations[1].dtype == np.uint32 and res.copies[1].dtype == np.int64
    assert (res.position, res.lineage, res.pool_incarnation) == ((inc, seq), lineage, pool_inc)
    assert core.last_reply is reply


def test_a_new_stream_core_has_sent_nothing_and_names_itself():
    core = StreamCore("pool-n", 16, False, None)
    assert (core.pool, core.deltas, core.mirror.page_size, core.mirror.seq) == ("pool-n", False, 16, 0)
    assert core.stream_id.startswith("s-") and len(core.stream_id) == 34 and int(core.stream_id[2:], 16) >= 0
    assert StreamCore("p", 8, True, None).stream_id != core.stream_id          # a fresh uuid4 per stream
    assert (core.seq, core.reused, core.resolved, core.reconnects, core.route) == (0, 0, 0, 0, 0)
    assert (core.pending, core.settled, core.last_reply, core._cached, core._methods) == (None, None, None, None, {})
    named = StreamCore("p", 8, True, "s-given")
    assert (named.stream_id, named.deltas) == ("s-given", True)


def test_a_results_tables_name_a_missing_space_and_say_what_to_do_once_replaced():
    api, session, core = _served_core()
    try:
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        first = core.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        with pytest.raises(KeyError) as missing:
            first.tables[97]
        assert missing.value.args == (97,)
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        core.result(session.apply(api, pb.StepRequest.FromString(data)), True, False)
        with pytest.raises(MirrorError) as replaced:
            first.tables[next(iter(first.tables))]
    finally:
        core.client.close()
    assert str(replaced.value) == ("the tables of request 2 were replaced by request 3 on the stream; read a result's "
                                   "tables before the next step")


def test_a_stream_replys_position_check_names_the_stream_and_its_request():
    """checked(): a reply behind what the client saw is refused StateRolledBack for "StepStream", its request_id the
    stream's id and seq, and the mirror is reset; a client with no position tracker takes the reply as it is."""
    from kvservice.client.position import StateRolledBack

    api, session, core = _served_core()
    try:
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        ahead = session.apply(api, pb.StepRequest.FromString(data))
        ahead.position.CopyFrom(pb.JournalPosition(lineage=0xEE, incarnation=1, seq=30))
        core.result(core.checked(ahead, core.client.position.seen()), True, False)
        seen = core.client.position.seen()
        data = core.request_bytes(None, [31], None, None, None, True, False, {})
        behind = session.apply(api, pb.StepRequest.FromString(data))
        behind.position.CopyFrom(pb.JournalPosition(lineage=0xEE, incarnation=1, seq=29))
        with pytest.raises(StateRolledBack) as err:
            core.checked(behind, seen)
        assert core.mirror.seq == 0
    finally:
        core.client.close()
    e = err.value
    assert e.message.startswith("StepStream: the manager answered at journal position 29 of state lineage "
                                "00000000000000ee")
    assert e.request_id == f"s#{core.seq}" == e.metadata["request_id"] and core.seq == 3
    bare = StreamCore("p", 8, True, "s-b")
    bare.client = SimpleNamespace()                                  # no position tracker
    assert bare.checked(behind, {}) is behind


def test_a_stream_whose_deadline_is_spent_names_the_request_left_pending():
    from kvservice.client.codec import ClientError
    from kvservice.client.deadline import CallBudget, RetryPolicy

    core = StreamCore("p", 8, True, "s-d")
    core.start(b"", True, False, None)
    client = SimpleNamespace(retry=RetryPolicy(), stream_failed=lambda index: None)
    budget = CallBudget(RetryPolicy(), 0.0, "StepStream s-d (request 1)", None)      # nothing left
    budget.attempt_timeout()
    with pytest.raises(ClientError) as err:
        core.broken(client, ClientError(grpc.StatusCode.UNAVAILABLE, "down"), 1, budget)
    assert err.value.reason == "RETRIES_EXHAUSTED" and err.value.metadata["stream_seq"] == "1"
    assert "; request 1 of stream s-d may or may not have been applied" in err.value.message
