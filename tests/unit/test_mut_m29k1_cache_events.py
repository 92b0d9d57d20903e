"""kvservice/core/cache_events.py's event building, unit by unit, against what its docstrings and vLLM's events
state: a BlockStored chain per run of pages each the child of the one before, the group's kind and window on every
event, extra keys as vLLM lists them (the extra key on every page, the salt after it on a prompt's first page),
a reset describing every cached page parent first, and the pending-page bound."""

import numpy as np
import pytest

from kvservice.core import cache_events as ev

PS = 3


def chains(parents_h, hashes):
    """Run boundaries: a page starts a new chain unless its parent is the page before it."""
    cuts = [0] + [i for i in range(1, len(hashes)) if parents_h[i] != hashes[i - 1]] + [len(hashes)]
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]


@pytest.mark.parametrize(("window", "named"), [(0, False), (0, True), (12, True)])
def test_stored_kept_makes_one_event_per_chain_with_the_groups_kind_window_and_keys(window, named):
    rng = np.random.default_rng(window + named)
    events = ev.PoolEvents()
    src = events.source(3, window, 64)
    n = 9
    h = rng.integers(1, 2**64 - 1, n, dtype=np.uint64)
    # three chains: a prompt start, a continuation of a page held elsewhere, a prompt start again
    other = int(rng.integers(1, 2**63))
    parent_h = np.array([0, h[0], h[1], other, h[3], h[4], h[5], 0, h[7]], dtype=np.uint64)
    kept = rng.permutation(64)[:n].astype(np.int64)
    tok = rng.integers(1, 2**40, (n, PS))
    slot_hash = np.zeros(64, dtype=np.uint64)
    slot_hash[kept] = h
    names = [("salt-a", "lora")] * 3 + [("", "lora")] * 4 + [("salt-b", "")] * 2 if named else None
    src.stored_kept(kept, h, parent_h, tok, slot_hash, names)
    assert src.parent_hash[kept].tolist() == parent_h.tolist()
    assert src.index.lookup(h).tolist() == kept.tolist()
    batch = events.take_batch([])
    assert batch.seq == 1 and not batch.reset and batch.num_pages == n
    kind = "sliding_window" if window else "full_attention"
    want = []
    for lo, hi in chains(parent_h.tolist(), h.tolist()):
        keys = None
        if named:
            keys = tuple(((key,) if key else ()) + ((salt,) if salt and parent_h[i] == 0 else ())
                         for (salt, key), i in zip(names[lo:hi], range(lo, hi), strict=True))
        want.append((3, h[lo:hi].tolist(), int(parent_h[lo]), tok[lo:hi].reshape(-1).tolist(), PS, kind, window,
                     keys))
    got = [(e.group, e.block_hashes.tolist(), e.parent_block_hash, e.token_ids.tolist(), e.block_size, e.kind,
            e.sliding_window, e.extra_keys) for e in batch.events]
    assert got == want and [(lo, hi) for lo, hi in chains(parent_h.tolist(), h.tolist())] == [(0, 3), (3, 7), (7, 9)]
    if named:
        assert got[0][7] == (("lora", "salt-a"), ("lora",), ("lora",)) and got[2][7] == (("salt-b",), ())
    assert events.take_batch([]) is None


def test_page_keys_are_vllms_order_extra_key_then_salt_on_the_first_page():
    assert ev.page_keys("s", "k", True) == ("k", "s")
    assert ev.page_keys("s", "k", False) == ("k",)
    assert ev.page_keys("s", "", True) == ("s",)
    assert ev.page_keys("", "k", True) == ("k",)
    assert ev.page_keys("", "", True) == () and ev.page_keys("s", "", False) == ()


def forest(rng, n):
    """n pages, each a root (parent 0 or a hash not among them) or the child of an earlier page, then shuffled."""
    hashes = rng.choice(np.arange(1, 10**6, dtype=np.uint64), n, replace=False)
    parents = np.zeros(n, dtype=np.uint64)
    for i in range(1, n):
        r = rng.random()
        parents[i] = hashes[rng.integers(0, i)] if r < 0.7 else (0 if r < 0.85 else 10**7 + i)
    perm = rng.permutation(n)
    return hashes[perm], parents[perm]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parents_first_puts_the_roots_first_in_order_then_every_page_after_its_parent(seed):
    rng = np.random.default_rng(seed)
    hashes, parents = forest(rng, 40)
    order = ev.parents_first(hashes, parents).tolist()
    assert sorted(order) == list(range(40))
    pos = {int(hashes[i]): k for k, i in enumerate(order)}
    among = set(hashes.tolist())
    roots = [i for i in range(40) if int(parents[i]) not in among]
    assert order[:len(roots)] == roots
    for k, i in enumerate(order):
        p = int(parents[i])
        if p in among:
            assert pos[p] < k


def test_stored_events_describe_each_copied_page_alone_with_its_parent_tokens_and_keys():
    rng = np.random.default_rng(4)
    hashes, parents = forest(rng, 12)
    tokens = rng.integers(1, 2**40, (12, PS))
    ns = rng.integers(0, 3, 12).astype(np.int64)
    names = {0: ("", ""), 1: ("salt-x", "lora-y"), 2: ("salt-z", "")}
    copy = ev.CachedPages(5, hashes, parents, tokens, ns, names, PS, "sliding_window", 24)
    out = ev.stored_events([copy])
    order = ev.parents_first(hashes, parents).tolist()
    want = []
    for i in order:
        salt, key = names[int(ns[i])]
        keys = ((key,) if key else ()) + ((salt,) if salt and parents[i] == 0 else ())
        want.append((5, [int(hashes[i])], int(parents[i]), tokens[i].tolist(), PS, "sliding_window", 24,
                     (keys,) if keys else None))
    got = [(e.group, e.block_hashes.tolist(), e.parent_block_hash, e.token_ids.tolist(), e.block_size, e.kind,
            e.sliding_window, e.extra_keys) for e in out]
    assert got == want
    assert all(e.block_hashes.dtype == np.uint64 for e in out)


def test_removals_and_stores_keep_their_order_and_groups_in_the_batch():
    events = ev.PoolEvents()
    a, b = events.source(0, 0, 16), events.source(1, 4, 16)
    assert events.source(0, 0, 16) is a and a.kind == "full_attention" and b.kind == "sliding_window"
    a.parent_hash[[2, 3]] = 7
    a.removed_many([12, 13], [2, 3])
    assert a.parent_hash[[2, 3]].tolist() == [0, 0]
    b.removed(21, 1)
    h = np.array([31, 32], dtype=np.uint64)
    b.stored_kept(np.array([5, 6], dtype=np.int64), h, np.array([0, 31], dtype=np.uint64),
                  np.arange(2 * PS).reshape(2, PS), np.zeros(16, dtype=np.uint64))
    b.removed_many([22], [2])
    a.removed(14, 4)
    batch = events.take_batch([])
    kinds = [(type(e).__name__, e.group, e.block_hashes.tolist()) for e in batch.events]
    assert kinds == [("BlockRemoved", 0, [12, 13]), ("BlockRemoved", 1, [21]), ("BlockStored", 1, [31, 32]),
                     ("BlockRemoved", 1, [22]), ("BlockRemoved", 0, [14])]
    assert all(e.block_hashes.dtype == np.uint64 for e in batch.events)
    assert batch.num_pages == 7 and ev.event_pages(ev.AllBlocksCleared()) == 0
    view = {0: {12, 14, 99}, 1: {21, 22}}
    ev.apply_events(view, batch.events)
    assert view == {0: {99}, 1: {31, 32}}


def test_the_pending_bound_counts_pages_and_a_batch_past_it_is_a_reset(monkeypatch):
    """Exactly MAX_PENDING_PAGES pending pages are kept; one more drops them all and the next batch is a reset
    (AllBlocksCleared, then the caches' state), after which counting starts again from 0."""
    monkeypatch.setattr(ev, "MAX_PENDING_PAGES", 5)
    events = ev.PoolEvents()
    a = events.source(0, 0, 16)
    a.removed_many([1, 2, 3], [1, 2, 3])
    a.removed_many([4, 5], [4, 5])
    assert events.pending.pages == 5 and not events.pending.overflowed
    b1 = events.take_batch([])
    assert [e.block_hashes.tolist() for e in b1.events] == [[1, 2, 3, 4, 5]]
    assert events.pending.pages == 0
    a.removed_many([6, 7, 8], [6, 7, 8])
    a.removed(9, 9)
    a.removed_many([10, 11], [10, 11])                  # 6 > 5: dropped
    assert events.pending.overflowed and events.pending.events == [] and events.pending.pages == 0
    a.removed(12, 12)                                   # ignored while overflowed
    assert events.pending.events == []
    b2 = events.take_batch([])
    assert b2.seq == 2 and b2.reset and b2.events == (ev.AllBlocksCleared(),)
    assert not events.pending.overflowed and events.take_batch([]) is None
    a.removed(13, 13)
    assert events.take_batch([]).events[0].block_hashes.tolist() == [13]


@pytest.mark.parametrize("given", [False, True])
def test_stored_takes_the_kept_pages_in_page_order_with_their_parents_by_the_documented_rule(given):
    """stored(): of n offered pages, the kept ones (given in any order) in page order; a kept page's parent hash
    is the offered page before it when that page is its parent (same prompt), else the cache's hash of its parent
    slot, else 0 (no parent slot, -1); or the caller's parent_hashes when given."""
    rng = np.random.default_rng(31 + given)
    n = 10
    slots = rng.permutation(40)[:n].astype(np.int64)
    hashes = rng.integers(1, 2**64 - 1, n, dtype=np.uint64)
    slot_hash = np.zeros(40, dtype=np.uint64)
    slot_hash[slots] = hashes
    held = np.setdiff1d(np.arange(40), slots)[:3]                       # pages the cache held before
    slot_hash[held] = rng.integers(1, 2**64 - 1, 3, dtype=np.uint64)
    parents = np.array([-1, slots[0], slots[1], held[0], slots[3], -1, held[1], slots[6], held[2], slots[8]])
    keep = np.array([9, 1, 2, 3, 6, 0, 7, 5], dtype=np.int64)            # 4 and 8 not registered (hash known)
    pages = rng.integers(1, 2**40, (n, PS))
    names = [(f"s{i % 2}", "k" if i % 3 else "") for i in range(n)]
    parent_hashes = rng.integers(1, 2**64 - 1, n, dtype=np.uint64) if given else None
    events = ev.PoolEvents()
    src = events.source(2, 0, 40)
    src.stored(slots, parents.astype(np.int64), hashes, pages, keep, slot_hash, parent_hashes, names)
    k = sorted(keep.tolist())

    def parent_of(i):
        if given:
            return int(parent_hashes[i])
        if i > 0 and slots[i - 1] == parents[i]:
            return int(hashes[i - 1])
        return int(slot_hash[parents[i]]) if parents[i] >= 0 else 0

    ph = [parent_of(i) for i in k]
    assert src.parent_hash[slots[k]].tolist() == ph
    want = []
    hk = [int(hashes[i]) for i in k]
    for lo, hi in chains(ph, hk):
        keys = tuple(ev.page_keys(*names[i], ph[j] == 0) for j, i in zip(range(lo, hi), k[lo:hi], strict=True))
        want.append((hk[lo:hi], ph[lo], pages[k[lo:hi]].reshape(-1).tolist(), keys))
    got = [(e.block_hashes.tolist(), e.parent_block_hash, e.token_ids.tolist(), e.extra_keys)
           for e in events.take_batch([]).events]
    assert got == want and len(got) >= 3
    src.stored(slots, parents.astype(np.int64), hashes, pages, np.zeros(0, dtype=np.int64), slot_hash)
    assert events.take_batch([]) is None


def test_a_pools_caches_copied_and_described_per_group():
    """A hybrid pool (full + sliding group, prefix caching) after random prompts: each group's cache publishes
    with its own group number; a copy without token ids has the same pages and no tokens; the reset events of the
    whole cache rebuild exactly what each group's cache can find."""
    from kvservice.contract.geometry import CacheSpec, LayerSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.core.planner import plan
    from kvservice.core.pool import Pool

    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=8)), PS, "per_layer")
    pool = Pool("p", plan(spec, Sizing(num_slots=64, max_seq_len=128)), prefix_caching=True)
    rng = np.random.default_rng(606)
    shared = rng.integers(1, 50_000, 7)
    for i in range(5):
        tokens = np.concatenate((shared, rng.integers(1, 50_000, int(rng.integers(4, 20)))))
        pool.step(admit_ids=[i + 1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
    pool.step(free_ids=[2, 4])
    caches = ev.pool_caches(pool)
    assert [c.sink.group for c in caches] == [0, 1] and caches == list(pool.prefixes)
    held = ev.indexed_hashes(caches)
    assert held == {g: set(pool.prefixes[g].by_hash) for g in (0, 1)} and all(len(v) > 3 for v in held.values())
    with_tokens, without = ev.copy_cached_pages(caches), ev.copy_cached_pages(caches, token_ids=False)
    for a, b, cache in zip(with_tokens, without, caches, strict=True):
        assert a.hashes.tolist() == b.hashes.tolist() and a.parents.tolist() == b.parents.tolist()
        assert b.tokens.shape == (len(a.hashes), 0) and a.tokens.shape == (len(a.hashes), PS)
        slots = [cache.by_hash[h] for h in a.hashes.tolist()]
        assert a.tokens.tolist() == cache.tokens[slots].tolist()
        assert (a.kind, a.sliding_window) == (("full_attention", 0) if a.group == 0 else ("sliding_window", 8))
    view = {0: {1, 2}, 7: {3}}
    ev.apply_events(view, (ev.AllBlocksCleared(), *ev.state_events(caches)))
    assert view == held
    assert pool.events.take_batch(caches) is not None and ev.pool_caches(object()) == []


def test_an_index_past_three_quarters_is_rebuilt_from_the_live_pages_only():
    """A source of 8 slots (a 16-position index, rebuilt past 12 entries): pages registered slot after slot, each
    replacing the page before it in that slot; lookups then find every live page and none of the replaced ones."""
    rng = np.random.default_rng(12)
    events = ev.PoolEvents()
    src = events.source(0, 0, 8)
    slot_hash = np.zeros(8, dtype=np.uint64)
    replaced = []
    for _ in range(5):
        h = rng.integers(1, 2**64 - 1, 4, dtype=np.uint64)
        kept = rng.permutation(8)[:4].astype(np.int64)
        replaced += [int(x) for x in slot_hash[kept] if x]
        slot_hash[kept] = h
        src.stored_kept(kept, h, np.zeros(4, dtype=np.uint64), rng.integers(1, 99, (4, PS)), slot_hash)
    assert src.index.refill is not None                   # 20 registrations > 12: waiting for its rebuild
    live = slot_hash.nonzero()[0]
    assert src.index.lookup(slot_hash[live]).tolist() == live.tolist()
    assert src.index.lookup(np.array(replaced, dtype=np.uint64)).tolist() == [-1] * len(replaced)
