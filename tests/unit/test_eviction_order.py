"""Eviction order of the prefix cache: leaves first, least recently released, lower slot on a tie (evict.py).

The example of issue 23: in an 8-slot pool holding a 3-page cached prompt, one eviction used to take
page 0, after which pages 1-2 were unreachable (a hit needs every earlier page) and ScorePrefix said 0.
"""

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.allocator import SlotAllocator
from kvservice.core.evict import Lru, LruLeaf, make_policy
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import score_prefix

PS = 4
PROMPT = np.arange(700, 713)                 # 13 tokens: 3 full pages + 1 token


def _pool(spec: CacheSpec, num_slots: int = 8) -> Pool:
    return Pool("p", plan(spec, Sizing(num_slots=num_slots, max_seq_len=num_slots * PS)), prefix_caching=True)


def _admit(pool: Pool, seq_id: int, tokens: np.ndarray):
    return pool.step(admit_ids=[seq_id], admit_tokens=[len(tokens)], admit_token_ids=tokens)


@pytest.mark.parametrize("spec", [
    CacheSpec.uniform(2, 1, 64, page_size=PS),
    # hybrid: a full group and a sliding group whose window needs the last two pages of a 2-page hit
    CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8)), PS, "per_layer"),
], ids=["full", "hybrid"])
def test_one_eviction_keeps_the_head_of_a_cached_prompt(spec):
    pool = _pool(spec)
    _admit(pool, 1, PROMPT)
    pages = pool.sequence_slots(1, 0).tolist()
    pool.step(free_ids=[1])
    assert pool.cached_prefix_pages(PROMPT) == 3
    r = _admit(pool, 2, np.arange(9000, 9021))               # 6 pages: 5 clean slots + 1 eviction per group
    assert r.cached_tokens.tolist() == [0]
    assert [a.evictions for a in pool.allocators] == [1] * len(pool.allocators)
    assert pages[2] in pool.sequence_slots(2, 0).tolist()    # the tail page went, not page 0
    assert pool.cached_prefix_pages(PROMPT) == 2             # pages 0-1 still findable
    pool.step(free_ids=[2])
    assert _admit(pool, 3, PROMPT).cached_tokens.tolist() == [8]
    assert_invariants(pool)


def test_score_prefix_still_sees_the_head_after_one_eviction():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=8, max_seq_len=32),
                  prefix_caching=True)
    with m.locked("p") as pool:
        _admit(pool, 1, PROMPT)
        pool.step(free_ids=[1])
        _admit(pool, 2, np.arange(9000, 9021))
    assert score_prefix(m, PROMPT)[0].cached_tokens == 8


def test_plain_lru_is_the_order_that_lost_the_head():
    """The previous rule, kept as a policy for comparison: the same steps leave nothing findable."""
    pool = _pool(CacheSpec.uniform(2, 1, 64, page_size=PS))
    for a in pool.allocators:
        a.policy = Lru(a.num_slots, a._cached)
    _admit(pool, 1, PROMPT)
    pool.step(free_ids=[1])
    _admit(pool, 2, np.arange(9000, 9021))
    assert pool.cached_prefix_pages(PROMPT) == 0


def test_shared_head_outlives_every_conversations_tail():
    """Two conversations share a system page; after both are freed, evictions take their tails first, then
    the shared page last, although it was released before the second conversation's tail."""
    pool = _pool(CacheSpec.uniform(2, 1, 64, page_size=PS), num_slots=12)
    system = np.arange(1, 5)
    _admit(pool, 1, np.concatenate((system, np.arange(100, 109))))      # pages: S, a1, a2 (+1 token)
    _admit(pool, 2, np.concatenate((system, np.arange(200, 209))))      # pages: S (hit), b1, b2
    s = pool.sequence_slots(1, 0)[0]
    pool.step(free_ids=[1])
    pool.step(free_ids=[2])
    order = pool.allocators[0].free_slots()[-pool.allocators[0].num_cached:].tolist()
    assert order[-1] == s and len(order) == 5


def test_policy_by_name_and_unknown_names():
    a = SlotAllocator(4)
    assert isinstance(a.policy, LruLeaf)
    assert isinstance(SlotAllocator(4, policy="lru").policy, Lru)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; known: lru-leaf, lru"):
        make_policy("mru", 4, {})


def test_inner_page_is_evicted_only_when_no_leaf_is_left():
    """Sliding groups: a page whose dependant is still in use goes only when every cached page is such a one,
    oldest first, and its dependants then count as leaves."""
    a = SlotAllocator(6)
    a.caching = True
    got = a.allocate(6)
    a.cacheable[got] = True
    a.policy.link(np.array([1, 2]), np.array([0, 1]))       # 0 <- 1 <- 2 (2 depends on 1, 1 on 0)
    a.clock = 1
    a.free(np.array([0, 1]), unique=True)                     # 2 stays in use: 0 and 1 are inner pages
    a.clock = 2
    a.free(np.array([3]), unique=True)                        # a leaf, released later
    assert a.free_slots().tolist() == [3, 0, 1]
    evicted = []
    a.on_evict = lambda s: evicted.extend(s.tolist())
    a.allocate(1)
    assert evicted == [3]
    a.allocate(1)                                             # no leaf left: the older inner pages, lower slot first
    assert evicted == [3, 0]
    assert a.policy.children[0] == 0 and a.free_slots().tolist() == [1]
    a.check()


@pytest.mark.parametrize("copy_pool", ["pickle", "deepcopy"])
def test_a_copied_pool_keeps_one_buffer_per_dependency_count(copy_pool):
    """The policy's dependency counts are one buffer seen as a NumPy array (links) and as array.array (the
    eviction loop): a pickled or copied pool must keep them one buffer, and evict as the original does."""
    import copy
    import pickle

    pool = _pool(CacheSpec.uniform(1, 1, 64, page_size=PS), num_slots=8)
    _admit(pool, 1, PROMPT)
    pool.step(free_ids=[1])
    _admit(pool, 2, np.arange(800, 813))                      # 3 pages cached, 1 free slot left
    clone = pickle.loads(pickle.dumps(pool)) if copy_pool == "pickle" else copy.deepcopy(pool)
    for p in (pool, clone):
        pol = p.allocators[0].policy
        assert pol.children.base is not None and np.shares_memory(pol.children, np.frombuffer(pol._children, np.int32))
        pol.children[1] += 5                                  # a write through the view is seen by the loop ...
        assert pol._children[1] == pol.children[1]
        pol.children[1] -= 5
    want = _admit(pool, 3, np.arange(900, 913)).tables[0].slot_mapping    # ... and both evict the same pages
    got = _admit(clone, 3, np.arange(900, 913)).tables[0].slot_mapping
    assert np.array_equal(want, got) and pool.allocators[0].evictions == clone.allocators[0].evictions > 0
    assert_invariants(clone)


@pytest.mark.parametrize("parent", [0, 3])
def test_a_forgotten_page_makes_its_parent_a_leaf_even_in_slot_0(parent):
    """unlink (the prefix cache forgets a page): its parent loses that dependant and, cached and now without
    dependants, is a leaf again, evicted by its own (older) release stamp before a later-released leaf. Slot 0
    is a slot like any other (-1 is the only 'no parent')."""
    child, other = (1, 2) if parent == 0 else (0, 1)
    cached_at = {parent: 1, child: 2, other: 5}               # slot -> release stamp
    pol = LruLeaf(4, cached_at)
    pol.link(np.array([child]), np.array([parent]))
    for s, t in cached_at.items():
        pol.cached([s], t)
    assert pol.order() == [child, parent, other]              # leaves first: the child, then its parent (stamp 1)
    del cached_at[child]                                      # the child is revived by a hit, then forgotten
    pol.unlink(child)
    assert pol.parent_of[child] == -1 and pol.children[parent] == 0 and pol.is_leaf(parent)
    assert pol.order() == [parent, other]                     # stamp 1 before stamp 5: both leaves
    assert pol.evict(2) == [parent, other]
