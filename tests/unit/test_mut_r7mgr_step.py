"""ManagerAPI.Step and step_delta checked whole against block_manager.proto: every StepReply carries the pool's
incarnation (pool_incarnation: kernel requests built from it send it); a stream's reply carries its request's
stream_seq; with delta_tables and a held reply at delta_base the tables are incremental (TableDelta.base_seq = that
reply's seq, no full tables), otherwise full (no delta), and what the stream's holder keeps says which reply the
client holds (None when the client did not ask for deltas); delta_tables with omit_tables or include_block_table is
refused with its exact message and changes nothing, not even the holder."""

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.manager.step_input import decode_step
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s18mgr_api import _i64, _u64

INC = 6_060_606_061


class Holder:
    held = None


def _step(api, holder, seq, base=0, delta=True, **kw):
    r = pb.StepRequest(pool="s", stream_seq=seq, delta_tables=delta, delta_base=base, **kw)
    return api.step_delta(r, decode_step(r), holder)


def test_step_replies_carry_the_incarnation_the_stream_seq_and_full_or_incremental_tables():
    m = BlockManager()
    m.create_pool("s", CacheSpec.uniform(2, 1, 64, page_size=4), Sizing(num_slots=64, max_seq_len=64), incarnation=INC)
    api = ManagerAPI(m)
    unary = api.Step(pb.StepRequest(pool="s", admit_seq_ids=_u64([1]), admit_num_tokens=_i64([5])))
    assert (unary.pool_incarnation, unary.stream_seq, unary.HasField("delta"), len(unary.tables)) == (INC, 0, False, 1)
    h = Holder()
    first = _step(api, h, 7, admit_seq_ids=_u64([2]), admit_num_tokens=_i64([6]))       # nothing held: full tables
    assert (first.pool_incarnation, first.stream_seq, first.HasField("delta"), len(first.tables)) == (INC, 7, False, 1)
    assert first.tables[0].HasField("indptr")
    held = h.held
    pool = m.pool_and_lock("s")[0]
    assert (held.seq, held.pool(), held.pool_steps, held.seq_ids.tolist(), held.num_tokens.tolist()) == \
        (7, pool, 2, [2], [6])
    second = _step(api, h, 8, base=7, extend_seq_ids=_u64([2]), extend_num_tokens=_i64([3]))
    assert (second.pool_incarnation, second.stream_seq, second.delta.base_seq) == (INC, 8, 7)
    assert second.HasField("delta") and not second.tables[0].HasField("indptr")
    assert (h.held.seq, h.held.pool_steps, h.held.seq_ids.tolist(), h.held.num_tokens.tolist()) == (8, 3, [2], [9])
    stale = _step(api, h, 9, base=3, extend_seq_ids=_u64([2]), extend_num_tokens=_i64([1]))   # not the held reply
    assert (stale.pool_incarnation, stale.stream_seq, stale.HasField("delta")) == (INC, 9, False)
    assert (h.held.seq, h.held.num_tokens.tolist()) == (9, [10])
    plain = _step(api, h, 10, base=9, delta=False, extend_seq_ids=_u64([2]), extend_num_tokens=_i64([1]))
    assert (plain.pool_incarnation, plain.stream_seq, plain.HasField("delta"), h.held) == (INC, 10, False, None)
    assert pool.sequences()[1].tolist() == [5, 11]


@pytest.mark.parametrize("flag", ["omit_tables", "include_block_table"])
def test_delta_tables_with_omit_tables_or_block_tables_is_refused_and_changes_nothing(flag):
    m = BlockManager()
    m.create_pool("s", CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=16, max_seq_len=64))
    api = ManagerAPI(m)
    h = Holder()
    _step(api, h, 1, admit_seq_ids=_u64([4]), admit_num_tokens=_i64([3]))
    held = h.held
    with pytest.raises(InvalidArgument) as e:
        _step(api, h, 2, base=1, extend_seq_ids=_u64([4]), extend_num_tokens=_i64([2]), **{flag: True})
    assert (e.value.message, e.value.reason) == (
        "delta_tables asks for incremental tables; omit_tables and include_block_table do not go with it (the "
        "client's mirror builds block tables): set one or the other", "INVALID_ARGUMENT")
    pool = m.pool_and_lock("s")[0]
    assert (h.held, pool.steps, pool.sequences()[1].tolist()) == (held, 1, [3])
    ok = _step(api, h, 2, base=0, delta=False, extend_seq_ids=_u64([4]), extend_num_tokens=_i64([2]), **{flag: True})
    assert (ok.stream_seq, h.held, pool.sequences()[1].tolist()) == (2, None, [5])
    assert ok.tables[0].HasField("block_table") is (flag == "include_block_table")
