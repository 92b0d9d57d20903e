"""StepReply.copies checked whole (block_manager.proto's SlotCopies; docs/DESIGN.md: a shared, partly filled last
page is copied before a sequence appends to it): one SlotCopies per layer group that copied, named by its group,
its pairs (source slot: the page the fork child keeps; destination: the parent's new last page) and the two slots'
generations (a slot's first allocation hands out generation_seed(incarnation) + 1, allocator.generation_seed's
rule: (incarnation ^ incarnation >> 32) mod 2^32)."""

from itertools import pairwise

import numpy as np

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s18mgr_api import _i64, _u64

INC = 9_000_000_007


def _rows(st):
    """Each row's slots in one SpaceTables: page = base + offset + slot * scale (docs/DESIGN.md)."""
    indptr, pages = from_tensor(st.indptr, "indptr").tolist(), from_tensor(st.indices, "indices")
    slots = ((pages - st.base - st.offset) // st.scale).tolist()
    return [slots[a:b] for a, b in pairwise(indptr)]


def test_each_groups_copies_name_the_group_the_slots_and_their_generations():
    m = BlockManager()
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=64)), 4)
    m.create_pool("c", spec, Sizing(num_slots=32, max_seq_len=64), incarnation=INC)
    api = ManagerAPI(m)
    api.Step(pb.StepRequest(pool="c", admit_seq_ids=_u64([1]), admit_num_tokens=_i64([6])))   # 2 pages, 1 partial
    r = api.Step(pb.StepRequest(pool="c", extend_seq_ids=_u64([1]), extend_num_tokens=_i64([1]),
                                fork_parent_ids=_u64([1]), fork_child_ids=_u64([2])))
    assert from_tensor(r.seq_ids, "seq_ids").tolist() == [1, 2]
    seed = (INC ^ (INC >> 32)) % 2**32
    assert [c.group for c in r.copies] == [0, 1]
    for c in r.copies:
        (st,) = [st for st in r.tables if st.group == c.group]
        parent, child = _rows(st)
        assert parent[0] == child[0] and parent[1] != child[1]
        assert np.asarray(from_tensor(c.pairs, "pairs")).reshape(-1).tolist() == [child[1], parent[1]]
        assert from_tensor(c.generations, "generations").reshape(-1).tolist() == [seed + 1, seed + 1]


def test_pool_stats_count_the_cached_pages_a_full_pool_evicted():
    """PoolStats.prefix_cache_evictions and cached_slots (docs/DESIGN.md: a freed sequence's full pages stay
    cached until their slots are needed): 8 slots of 4 tokens; a 16-token prompt freed leaves its 4 pages cached;
    a 32-token admission of other tokens needs all 8 slots and evicts those 4."""
    rng = np.random.default_rng(7077)
    m = BlockManager()
    m.create_pool("e", CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=8, max_seq_len=32),
                  prefix_caching=True)
    api = ManagerAPI(m)

    def stats():
        s = api.GetStats(pb.GetStatsRequest(pool="e")).pools["e"]
        return s.prefix_caching, s.cached_slots, s.prefix_cache_evictions, s.num_free_slots

    a = rng.integers(1, 1000, 16)
    api.Step(pb.StepRequest(pool="e", admit_seq_ids=_u64([1]), admit_num_tokens=_i64([16]), admit_token_ids=_i64(a)))
    api.Step(pb.StepRequest(pool="e", free_seq_ids=_u64([1])))
    assert stats() == (True, 4, 0, 8)
    b = rng.integers(1000, 2000, 32)
    api.Step(pb.StepRequest(pool="e", admit_seq_ids=_u64([2]), admit_num_tokens=_i64([32]), admit_token_ids=_i64(b)))
    assert stats()[2:] == (4, 0)
