"""ManagerAPI's smaller answers against hand-computed values: ListSequences of a hybrid pool (num_slots is layer
group 0's, a row of n tokens holds ceil(n / page_size) pages in a full group, docs/DESIGN.md), GetStats of one
named pool, ValidatePageTable's default of 100 listed violations (the proto: 0 = 100), reply bounds of fork-only
and malformed steps (fork children count at max_pages; a count <= 0 or an unknown id gives no bound), the
REPLY_TOO_LARGE advice at its boundary, and flush_fleet bringing the fleet index up to a pool's cache."""

import numpy as np
import pytest

from kvservice.contract.convert import cache_spec_to_proto, sizing_to_proto
from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.limits import ReplyModel, StepShape, step_reply_bound
from kvservice.manager.api import ManagerAPI, StepCost, flush_fleet
from kvservice.manager.pools import BlockManager
from kvservice.manager.step_input import decode_step
from kvservice.v1 import block_manager_pb2 as pb

PS = 4
W = 9                       # sliding window (tokens) of the hybrid pool's second group


def _u64(a):
    return to_tensor(np.asarray(a, dtype=np.uint64))


def _i64(a):
    return to_tensor(np.asarray(a, dtype=np.int64))


def _hybrid():
    m = BlockManager()
    spec = CacheSpec((LayerSpec(1, 64, "float16", 0), LayerSpec(1, 64, "float16", W)), PS)
    m.create_pool("h", spec, Sizing(num_slots=200, max_seq_len=200))
    return m


def test_list_sequences_of_a_hybrid_pool_reports_group_zeros_slots():
    rng = np.random.default_rng(1901)
    m = _hybrid()
    api = ManagerAPI(m)
    ids = sorted(rng.choice(np.arange(1, 10**6), 6, replace=False).tolist())
    n = rng.integers(3 * W, 8 * W, 6).tolist()
    api.Step(pb.StepRequest(pool="h", admit_seq_ids=_u64(ids), admit_num_tokens=_i64(n)))
    k = rng.integers(1, 3, 6).tolist()
    api.Step(pb.StepRequest(pool="h", extend_seq_ids=_u64(ids), extend_num_tokens=_i64(k)))     # a decode step
    n = [a + b for a, b in zip(n, k, strict=True)]
    with m.locked("h") as pool:
        full = pool.windows.index(0)
        slid = 1 - full
    got = api.ListSequences(pb.ListSequencesRequest(pool="h"))
    assert got.total == 6
    assert [(s.seq_id, s.num_tokens) for s in got.sequences] == list(zip(ids, n, strict=True))
    for s, k in zip(got.sequences, n, strict=True):
        per = list(s.num_slots_per_group)
        assert per[full] == -(-k // PS)                        # a full group holds every page
        assert 0 < per[slid] < per[full]                     # the sliding group released the pages out of its window
        assert s.num_slots == per[0]
    assert any(s.num_slots != s.num_slots_per_group[1] for s in got.sequences)
    few = api.ListSequences(pb.ListSequencesRequest(pool="h", limit=2))
    assert few.total == 6 and [s.seq_id for s in few.sequences] == ids[:2]


def test_get_stats_of_a_named_pool_lists_that_pool_only():
    m = _hybrid()
    m.create_pool("other", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=40, max_seq_len=40))
    api = ManagerAPI(m)
    api.Step(pb.StepRequest(pool="other", admit_seq_ids=_u64([3]), admit_num_tokens=_i64([7])))
    one = api.GetStats(pb.GetStatsRequest(pool="other"))
    assert list(one.pools) == ["other"]
    assert (one.pools["other"].num_tokens, one.pools["other"].num_sequences) == (7, 1)
    assert sorted(api.GetStats(pb.GetStatsRequest()).pools) == ["h", "other"]


def test_validate_page_table_lists_100_violations_by_default_and_counts_all():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=40, max_seq_len=40 * PS))
    api = ManagerAPI(m)
    rows = 150
    req = dict(pool="p", layer=0, indptr=_i64(np.arange(rows + 1)), indices=_i64(np.full(rows, 10_000)),
               last_page_len=_i64(np.ones(rows)))
    for asked, listed in ((0, 100), (7, 7), (120, 120)):
        r = api.ValidatePageTable(pb.ValidatePageTableRequest(max_reports=asked, **req))
        assert (r.ok, r.num_violations, len(r.violations)) == (False, rows, listed)
        assert {v.reason for v in r.violations} == {"out_of_bounds"}
        assert [v.row for v in r.violations] == list(range(listed))


def _model_and_api(limit=0):
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=400, max_seq_len=60 * PS))
    with m.locked("p") as pool:
        model = ReplyModel.of(pool.plan)
    return m, model, ManagerAPI(m, max_reply_bytes=limit)


def test_a_fork_only_step_counts_each_child_at_max_pages_from_the_request_alone():
    rng = np.random.default_rng(1902)
    _, model, api = _model_and_api()
    parents = [11, 12, 13]
    n = rng.integers(1, 5 * PS, 3).tolist()
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(parents), admit_num_tokens=_i64(n)))
    r = pb.StepRequest(pool="p", fork_parent_ids=_u64(parents[:2]), fork_child_ids=_u64([21, 22]),
                       include_block_table=True)
    mp = model.max_pages
    assert api.step_reply_bound(r, level=0) == step_reply_bound(model, StepShape(2, 0, 0, 0, (2 * mp,), mp),
                                                               True, True)
    own = [-(-k // PS) for k in n[:2]]
    assert api.step_reply_bound(r, level=2) == step_reply_bound(model, StepShape(2, 0, 0, 0, (sum(own),), max(own)),
                                                               True, True)


@pytest.mark.parametrize("level", [1, 2])
def test_no_bound_for_a_zero_count_or_an_id_that_is_not_live(level):
    _, _, api = _model_and_api()
    top = 2**64 - 1
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([5, top]), admit_num_tokens=_i64([6, 9])))
    zero = pb.StepRequest(pool="p", extend_seq_ids=_u64([5]), extend_num_tokens=_i64([0]))
    assert api.step_reply_bound(zero, level) is None
    ok = pb.StepRequest(pool="p", extend_seq_ids=_u64([5, top]), extend_num_tokens=_i64([1, 2]))
    assert api.step_reply_bound(ok, level) is not None
    if level == 2:
        signed = pb.StepRequest(pool="p", extend_seq_ids=_i64([-1]), extend_num_tokens=_i64([1]))
        assert api.step_reply_bound(signed, level) is None          # -1 names no sequence (not 2**64 - 1)
        unknown = pb.StepRequest(pool="p", extend_seq_ids=_u64([6]), extend_num_tokens=_i64([1]))
        assert api.step_reply_bound(unknown, level) is None


def test_reply_too_large_advises_leaving_the_block_table_off_when_that_fits_exactly():
    rng = np.random.default_rng(1903)
    _, _, probe = _model_and_api()
    n = rng.integers(1, 50 * PS, 12).tolist()
    r = pb.StepRequest(pool="p", admit_seq_ids=_u64(range(100, 112)), admit_num_tokens=_i64(n),
                       include_block_table=True)
    b = probe.step_reply_bound(r)
    assert b.block_tables > 0
    for limit, advice in ((b.total - b.block_tables, "leave include_block_table off"),
                          (b.total - b.block_tables - 1, "set omit_tables"),
                          (b.slot_mappings + b.rest, "set omit_tables"),
                          (b.slot_mappings + b.rest - 1, "split it into smaller steps")):
        m, _, api = _model_and_api(limit)
        with pytest.raises(ResourceExhausted) as e:
            api.Step(r)
        assert e.value.reason == "REPLY_TOO_LARGE" and advice in str(e.value), (limit, str(e.value))
        assert int(e.value.metadata["reply_bytes"]) == b.total
        with m.locked("p") as pool:
            assert pool.num_sequences == 0


def test_flush_fleet_brings_the_index_up_to_the_pools_cache():
    rng = np.random.default_rng(1904)
    m = BlockManager()
    m.create_pool("c", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=200, max_seq_len=200),
                  prefix_caching=True)
    pool = m.pool_and_lock("c")[0]
    n = int(rng.integers(5 * PS, 9 * PS))
    with m.locked("c"):
        pool.step(admit_ids=[1], admit_tokens=[n], admit_token_ids=rng.integers(1, 30_000, n), admit_salts=[""])
        flush_fleet(pool)
    with m.fleet.lock:
        snap = m.fleet.snapshot()
    assert sum(len(d) for d in snap.values()) == n // PS           # every full page of the prompt is indexed


def test_check_step_cost_settles_at_each_bound_exactly_and_reserves_what_settled_it():
    """A limit equal to a bound lets the step through at that level (the bound is <= the limit): level 0 from the
    request alone, then the pool's token total (level 1), then each row's own tokens (level 2); one byte less
    than the last is a refusal. No limit: settled by the request, nothing to reserve."""
    rng = np.random.default_rng(1905)
    m, _, probe = _model_and_api()
    ids = list(range(1, 9))
    api_n = rng.integers(1, 3 * PS, len(ids)).tolist()
    probe.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(ids), admit_num_tokens=_i64(api_n)))
    r = pb.StepRequest(pool="p", extend_seq_ids=_u64(ids), extend_num_tokens=_i64(rng.integers(1, 3, len(ids))),
                       admit_seq_ids=_u64([50]), admit_num_tokens=_i64([int(rng.integers(1, 9))]))
    b0, b1, b2 = (probe.step_reply_bound(r, level).total for level in (0, 1, 2))
    assert b0 > b1 > b2
    pool = m.pool_and_lock("p")[0]
    assert probe.check_step_cost(pool, decode_step(r)) == StepCost(True, 0)
    for limit, want in ((b0, StepCost(True, b0)), (b0 - 1, StepCost(False, b1)), (b1, StepCost(False, b1)),
                        (b1 - 1, StepCost(False, b2)), (b2, StepCost(False, b2))):
        api = ManagerAPI(m, max_reply_bytes=limit)
        reserved: list[int] = []
        api.reserve_reply = reserved.append
        assert api.check_step_cost(pool, decode_step(r)) == want, limit
        assert reserved == [want.reply_bytes]
    with pytest.raises(ResourceExhausted):
        ManagerAPI(m, max_reply_bytes=b2 - 1).check_step_cost(pool, decode_step(r))


def test_create_pool_keeps_a_given_incarnation_and_list_pools_lists_every_pool():
    m = BlockManager()
    api = ManagerAPI(m)
    spec = CacheSpec.uniform(2, 1, 64, page_size=PS)
    for name, inc in (("b", 987_654_321), ("a", 12)):
        info = api.CreatePool(pb.CreatePoolRequest(name=name, cache=cache_spec_to_proto(spec),
                                                   sizing=sizing_to_proto(Sizing(num_slots=32, max_seq_len=64)),
                                                   incarnation=inc))
        assert (info.name, info.incarnation) == (name, inc)
    listed = api.ListPools(pb.ListPoolsRequest()).pools
    assert sorted((p.name, p.incarnation) for p in listed) == [("a", 12), ("b", 987_654_321)]
