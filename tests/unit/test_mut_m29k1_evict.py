"""The eviction policies (kvservice/core/evict.py) driven directly and compared with a plain-Python model of the
rules its docstring states: lru-leaf evicts the least recently released cached page no registered page depends
on (ties: the lower slot), or, when every cached page has a dependant, the least recently released of them (its
dependants become unlinked); lru evicts in release order whatever depends on what."""

import copy
import pickle

import numpy as np
import pytest

from kvservice.core.evict import Lru, LruLeaf, make_policy


class Model:
    """Registered pages with their parent page, cached free pages with their release stamp."""

    def __init__(self):
        self.parent: dict[int, int] = {}          # slot -> parent slot (linked pages only)
        self.cached: dict[int, int] = {}
        self.queue: list[int] = []                # cached slots in release order (lru's order)

    def children(self, s: int) -> int:
        return sum(1 for p in self.parent.values() if p == s)

    def victim_leaf(self) -> int:
        leaves = [(t, s) for s, t in self.cached.items() if not self.children(s)]
        return min(leaves or [(t, s) for s, t in self.cached.items()])[1]

    def forget(self, s: int) -> None:
        self.parent.pop(s, None)
        for c in [c for c, p in self.parent.items() if p == s]:
            del self.parent[c]

    def evict_leaf(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            s = self.victim_leaf()
            del self.cached[s]
            self.queue.remove(s)
            self.forget(s)
            out.append(s)
        return out

    def order_leaf(self) -> list[int]:
        twin = copy.deepcopy(self)
        return twin.evict_leaf(len(twin.cached))


def drive(policy_cls, seed: int, num_slots: int = 64, rounds: int = 300):
    """Random registrations (chains and forks under in-use pages), releases, revivals, forgets and evictions,
    told to the policy as the prefix cache and the allocator tell it; yields (policy, model, evicted or None)."""
    rng = np.random.default_rng(seed)
    cached_at: dict[int, int] = {}
    pol = policy_cls(num_slots, cached_at)
    model = Model()
    registered: set[int] = set()
    clock = 0
    for _ in range(rounds):
        clock += int(rng.integers(0, 3))             # equal stamps happen: ties go to the lower slot
        op = rng.integers(0, 5)
        in_use = sorted(registered - set(cached_at))
        free = [s for s in range(num_slots) if s not in registered]
        if op == 0 and free:                         # register a chain under an in-use page (or none)
            k = int(rng.integers(1, min(4, len(free)) + 1))
            chain = [int(s) for s in rng.choice(free, k, replace=False)]
            root = int(rng.choice(in_use)) if in_use and rng.random() < 0.7 else -1
            # a chain (each page under the one before), or siblings (every page under the root: a parent named
            # several times in one link)
            parents = [root, *chain[:-1]] if root < 0 or rng.random() < 0.6 else [root] * k
            links = [(c, p) for c, p in zip(chain, parents, strict=True) if p >= 0]
            if links:
                distinct = len({p for _, p in links}) == len(links) and bool(rng.random() < 0.5)
                pol.link(np.array([c for c, _ in links], dtype=np.int64),
                         np.array([p for _, p in links], dtype=np.int64), distinct=distinct)
                model.parent.update(links)
            registered.update(chain)
        elif op == 1 and in_use:                     # release in-use pages (a sequence freed): now cached
            k = int(rng.integers(1, min(5, len(in_use)) + 1))
            rel = [int(s) for s in rng.choice(in_use, k, replace=False)]
            for s in rel:
                cached_at[s] = clock
                model.cached[s] = clock
                model.queue.append(s)
            pol.cached(rel, clock)
        elif op == 2 and cached_at:                  # a hit revives a cached page
            s = int(rng.choice(sorted(cached_at)))
            del cached_at[s]
            del model.cached[s]
            model.queue.remove(s)
        elif op == 3 and cached_at:                  # evictions
            if policy_cls is LruLeaf:
                assert pol.order() == model.order_leaf()
            else:
                assert pol.order() == model.queue
            n = int(rng.integers(1, min(3, len(cached_at)) + 1))
            got = pol.evict(n)
            if policy_cls is LruLeaf:
                assert got == model.evict_leaf(n)
            else:
                assert got == model.queue[:n]
                for s in got:
                    del model.cached[s]
                    model.queue.remove(s)
                    model.forget(s)
            registered.difference_update(got)
            yield pol, model, got
            continue
        elif op == 4 and in_use and rng.random() < 0.3:   # an in-use page forgotten (its slot reused)
            s = int(rng.choice(in_use))
            pol.unlink(s)
            model.forget(s)
            registered.discard(s)
        yield pol, model, None


def check_links(pol, model, num_slots):
    want_parent = np.full(num_slots, -1, dtype=np.int64)
    want_children = np.zeros(num_slots, dtype=np.int32)
    for c, p in model.parent.items():
        want_parent[c] = p
        want_children[p] += 1
    assert pol.parent_of.tolist() == want_parent.tolist()
    assert pol.children.tolist() == want_children.tolist()
    assert [pol.is_leaf(s) for s in range(num_slots)] == [not c for c in want_children.tolist()]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_lru_leaf_evicts_and_orders_as_the_model(seed):
    evictions = 0
    for pol, model, got in drive(LruLeaf, seed):
        check_links(pol, model, 64)
        evictions += len(got or ())
        assert pol.cached_at == model.cached
    assert evictions > 20


def test_lru_leaf_after_rebuild_and_after_pickling_orders_as_the_model():
    """rebuild() (after a restore) and a pickled copy answer as the live policy: the model's order."""
    last = None
    for pol, model, _ in drive(LruLeaf, 11, rounds=200):
        last = (pol, model)
    pol, model = last
    assert len(model.cached) > 3
    twin = pickle.loads(pickle.dumps(pol))
    check_links(twin, model, 64)
    want = model.order_leaf()
    assert twin.order() == want
    pol.rebuild()
    n = len(model.cached)
    assert pol.evict(n) == model.evict_leaf(n) == want
    check_links(pol, model, 64)
    assert twin.evict(n) == want                        # the copy has its own buffers: the live evictions left it whole


@pytest.mark.parametrize("seed", [5, 6])
def test_lru_evicts_in_release_order_and_orders_so(seed):
    """lru: the cached pages in the order they were released (within one release, the order given); a revived
    page leaves the queue; dependencies are still counted (the prefix cache's links), never consulted."""
    evictions = 0
    for pol, model, got in drive(Lru, seed):
        check_links(pol, model, 64)
        assert pol.order() == model.queue
        evictions += len(got or ())
    assert evictions > 20
    pol.rebuild()
    assert pol.order() == sorted(model.queue, key=lambda s: model.cached[s]) == model.queue


def test_lru_victim_without_a_cached_page_says_so():
    pol = Lru(8, {})
    pol.cached([3, 5], 1)                                  # released, then revived: stale queue entries only
    with pytest.raises(AssertionError, match="no cached slot to evict"):
        pol.victim()


def test_policies_by_name_start_with_no_links():
    for name, cls in (("lru-leaf", LruLeaf), ("lru", Lru)):
        pol = make_policy(name, 37, {})
        assert type(pol) is cls and pol.name == name
        assert pol.children.dtype == np.int32 and pol.parent_of.dtype == np.int64
        assert pol.children.tolist() == [0] * 37 and pol.parent_of.tolist() == [-1] * 37


def test_a_rebuilt_policy_orders_by_release_stamp_whatever_the_maps_order():
    """After a restore, cached_at comes in slot or state order, not release order: both policies order by stamp
    (ties by the lower slot for lru-leaf; lru keeps the map's order among equal stamps)."""
    cached_at = {5: 3, 2: 1, 7: 2, 0: 3, 4: 0}
    lru = Lru(8, cached_at)
    lru.rebuild()
    assert lru.order() == [4, 2, 7, 5, 0]
    leaf = LruLeaf(8, dict(cached_at))
    leaf.rebuild()
    assert leaf.order() == [4, 2, 7, 0, 5]
    assert leaf.evict(5) == [4, 2, 7, 0, 5]
