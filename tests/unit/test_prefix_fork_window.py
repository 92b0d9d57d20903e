"""Prefix caching (hits, collisions, tenants, eviction), forks with copy-on-write, sliding-window release."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.prefix import page_hashes

PS = 4


def cached_pool(num_slots=32, hash_fn=None):
    pool = Pool("c", plan(CacheSpec.uniform(2, 1, 64, page_size=PS),
                          Sizing(num_slots=num_slots, max_seq_len=min(128, num_slots * PS))), prefix_caching=True)
    if hash_fn is not None:
        pool.prefix.hash_fn = hash_fn
    return pool


def admit(pool, seq_id, tokens, salt="", key=""):
    return pool.step(admit_ids=[seq_id], admit_tokens=[len(tokens)], admit_token_ids=np.array(tokens),
                     admit_salts=[salt], admit_extra_keys=[key])


def test_prefix_hit_reuses_pages_and_counts_tokens():
    pool = cached_pool()
    prompt = list(range(100, 114))                    # 14 tokens: 3 full pages + 2 tokens
    r1 = admit(pool, 1, prompt)
    assert r1.cached_tokens.tolist() == [0]
    first = pool.sequence_slots(1).tolist()
    r2 = admit(pool, 2, [*prompt[:12], 7, 8, 9])      # same 3 full pages, then different
    assert r2.cached_tokens.tolist() == [12]
    assert pool.sequence_slots(2).tolist()[:3] == first[:3]
    assert pool.sequence_slots(2).tolist()[3] != first[3]
    assert pool.allocators[0].refcount(np.array(first[:3])).tolist() == [2, 2, 2]
    assert pool.prefix.hits == 3
    # The slot mapping still covers every token (the kernels skip nothing the scheduler sends).
    assert len(r2.tables[0].slot_mapping) == 15
    assert_invariants(pool)


def test_released_pages_stay_cached_until_evicted_lru():
    pool = cached_pool(num_slots=8)
    admit(pool, 1, list(range(8)))                    # 2 full pages; (8-1)//4 = 1 page may hit
    a = pool.sequence_slots(1).tolist()
    pool.step(free_ids=[1])
    assert pool.allocators[0].num_cached == 2 and pool.num_free_slots == 8
    r = admit(pool, 2, list(range(8)))                # revived from the LRU
    assert r.cached_tokens.tolist() == [4] and pool.sequence_slots(2).tolist()[0] == a[0]
    pool.step(free_ids=[2])
    admit(pool, 3, list(range(50, 82)))               # 8 pages: needs every slot, evicts the cache
    assert pool.allocators[0].evictions == 2 and pool.allocators[0].num_cached == 0
    pool.step(free_ids=[3])
    assert admit(pool, 4, list(range(8))).cached_tokens.tolist() == [0]
    assert_invariants(pool)


def test_hash_collision_never_aliases():
    pool = cached_pool(hash_fn=lambda pages, col, *_: np.full(len(pages), 42, dtype=np.uint64))
    admit(pool, 1, [1, 2, 3, 4, 5])
    r = admit(pool, 2, [9, 9, 9, 9, 5])               # same (forced) hash, different tokens
    assert r.cached_tokens.tolist() == [0]
    assert pool.sequence_slots(2)[0] != pool.sequence_slots(1)[0]
    assert_invariants(pool)


@pytest.mark.parametrize("hash_kind", ["constant", "by_position"])
def test_a_forced_collision_differing_in_one_token_misses_at_every_position(hash_kind):
    """Deterministic (issue 28): every page hashes alike whatever its tokens, and the new prompt differs from
    the cached one in exactly one token, at each position of each page in turn. The hit stops at that page:
    a comparison that skips any position of a page (say the last) lets that prompt alias the cached page."""
    hash_fns = {"constant": lambda pages, col, *_: np.full(len(pages), 42, dtype=np.uint64),
                "by_position": lambda pages, col, *_: (col + 1).astype(np.uint64)}
    rng = np.random.default_rng(28)
    cached = rng.integers(1, 1000, 3 * PS + 1).tolist()           # 3 full pages + 1 token
    for page in range(3):
        for pos in range(PS):
            pool = cached_pool(hash_fn=hash_fns[hash_kind])
            admit(pool, 1, cached)
            other = list(cached)
            other[page * PS + pos] += 1000                        # one token differs, nowhere else
            r = admit(pool, 2, other)
            # one hash for every page: the cache holds one page per hash (the first, page 0), so only it can hit
            hit = page if hash_kind == "by_position" else min(page, 1)
            assert r.cached_tokens.tolist() == [hit * PS], (page, pos)
            held1, held2 = pool.sequence_slots(1).tolist(), pool.sequence_slots(2).tolist()
            assert held2[:hit] == held1[:hit] and not set(held2[hit:]) & set(held1), (page, pos)
            assert_invariants(pool)


def test_parent_chain_is_checked_not_just_the_page():
    pool = cached_pool(hash_fn=lambda pages, col, *_: (col + 1).astype(np.uint64))
    admit(pool, 1, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    # page 1 equal, page 0 different: the hash (forced equal) and page-1 tokens match, the parent does not
    r = admit(pool, 2, [3, 3, 3, 3, 2, 2, 2, 2, 0])
    assert r.cached_tokens.tolist() == [0]
    assert_invariants(pool)


def test_tenants_and_extra_keys_are_isolated():
    pool = cached_pool()
    prompt = list(range(9))
    admit(pool, 1, prompt, salt="tenant-a")
    assert admit(pool, 2, prompt, salt="tenant-b").cached_tokens.tolist() == [0]
    assert admit(pool, 3, prompt, salt="tenant-a", key="lora-7").cached_tokens.tolist() == [0]
    assert admit(pool, 4, prompt, salt="tenant-a").cached_tokens.tolist() == [8]
    assert_invariants(pool)


def test_batch_of_admissions_with_80_percent_hits():
    pool = cached_pool(num_slots=2000)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 64).tolist()
    pool.step(admit_ids=[0], admit_tokens=[64], admit_token_ids=np.array(shared))
    tails = rng.integers(0, 1000, (16, 16))
    toks = np.concatenate([np.array(shared + t.tolist()) for t in tails])
    r = pool.step(admit_ids=np.arange(1, 17), admit_tokens=np.full(16, 80), admit_token_ids=toks)
    assert r.cached_tokens.tolist() == [64] * 16
    assert_invariants(pool)


def test_prefix_caching_inputs_are_checked():
    pool = cached_pool()
    with pytest.raises(InvalidArgument, match="add up to 5"):
        pool.step(admit_ids=[1], admit_tokens=[5], admit_token_ids=np.arange(4))
    with pytest.raises(InvalidArgument, match="one per admission"):
        pool.step(admit_ids=[1, 2], admit_tokens=[5, 5], admit_token_ids=np.arange(10), admit_salts=["a"])
    plain = Pool("p", plan(CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=8, max_seq_len=16)))
    with pytest.raises(InvalidArgument, match="without prefix caching"):
        plain.step(admit_ids=[1], admit_tokens=[2], admit_token_ids=np.arange(2))
    assert pool.num_sequences == 0 and plain.num_sequences == 0


def test_page_hashes_are_deterministic_and_chain():
    # Two prompts of 3 full pages each, stored ragged: pages 0..2 are prompt 0's, 3..5 prompt 1's.
    pages = np.arange(6 * PS).reshape(6, PS)
    col, starts, full = np.array([0, 1, 2, 0, 1, 2]), np.array([0, 3]), np.array([3, 3])

    def hashes(p, ns):
        return page_hashes(p, col, starts, full, np.array(ns))

    h = hashes(pages, [0, 0])
    assert (h == hashes(pages, [0, 0])).all() and (h != 0).all()
    assert (hashes(pages, [1, 0])[:3] != h[:3]).all() and (hashes(pages, [1, 0])[3:] == h[3:]).all()
    other = pages.copy()
    other[0, 0] += 1
    assert (hashes(other, [0, 0])[:3] != h[:3]).all()      # a change propagates down the chain
    # Ragged prompts hash each page exactly as a prompt of its own would.
    short = page_hashes(pages[3:5], np.array([0, 1]), np.array([0]), np.array([2]), np.array([0]))
    assert short.tolist() == h[3:5].tolist()
    mixed = page_hashes(pages[:5], np.array([0, 1, 2, 0, 1]), np.array([0, 3]), np.array([3, 2]), np.array([0, 0]))
    assert mixed.tolist() == h[:5].tolist()


def test_fork_shares_then_copies_on_write():
    pool = Pool("f", plan(CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=16, max_seq_len=64)))
    pool.step(admit_ids=[1], admit_tokens=[6])       # pages: one full, one with 2 tokens
    r = pool.step(fork_parents=[1, 1, 1], fork_children=[2, 3, 4])
    assert r.seq_ids.tolist() == [2, 3, 4] and r.num_tokens.tolist() == [6, 6, 6]
    parent = pool.sequence_slots(1).tolist()
    assert all(pool.sequence_slots(c).tolist() == parent for c in (2, 3, 4))
    assert pool.allocators[0].refcount(np.array(parent)).tolist() == [4, 4]
    r = pool.step(extend_ids=[1, 2, 3, 4], extend_tokens=[1, 1, 1, 1])
    (pairs,) = r.copies
    assert pairs[:, 0].tolist() == [parent[1]] * 3          # three copies; the last owner writes in place
    assert pool.sequence_slots(4).tolist() == parent
    for c, (_, dst) in zip((1, 2, 3), pairs.tolist(), strict=True):
        assert pool.sequence_slots(c).tolist() == [parent[0], dst]
        assert r.tables[0].slot_mapping[[1, 2, 3, 4].index(c)] == dst * PS + 2
    assert pool.allocators[0].refcount(np.array(parent)).tolist() == [4, 1]
    assert_invariants(pool)


def test_sliding_window_releases_pages_no_query_can_see():
    layers = (LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8))
    pool = Pool("w", plan(CacheSpec(layers, PS), Sizing(num_slots=32, max_seq_len=100)))
    pool.step(admit_ids=[1], admit_tokens=[20])          # 5 pages in both groups
    assert len(pool.sequence_slots(1, 1)) == 5
    for n in range(20, 40):
        r = pool.step(extend_ids=[1], extend_tokens=[1])
        # the query at position n attends n - 7 .. n: every page before (n - 7) // 4 is gone
        assert pool.first_page(1, 1) == (n + 1 - 8) // PS
        t = r.tables[1].table
        assert len(t.row(0)) == -(-(n + 1) // PS) - pool.first_page(1, 1)
        assert len(pool.sequence_slots(1, 0)) == -(-(n + 1) // PS)
        assert_invariants(pool)
    assert pool.allocators[1].num_free > pool.allocators[0].num_free
    pool.step(free_ids=[1])
    assert pool.allocators[0].num_free == pool.allocators[1].num_free == 32


def test_a_refused_step_registers_no_namespace():
    pool = cached_pool(num_slots=4)
    with pytest.raises(ResourceExhausted):
        pool.step(admit_ids=[1, 2], admit_tokens=[16, 16], admit_token_ids=np.arange(32),
                  admit_salts=["tenant-b", "tenant-b"])
    assert pool.prefix.namespaces._ids == {}
    admit(pool, 3, list(range(5)), salt="tenant-c")
    assert pool.prefix.namespaces._ids == {("tenant-c", ""): 0}


# ---- prefix caching on hybrid pools (full + sliding groups) ----------------------------------
def hybrid_pool(num_slots=64, window=8, layout="per_layer", full=True):
    layers = ((LayerSpec(1, 64),) if full else ()) + (LayerSpec(1, 64, sliding_window=window),)
    if layout == "interleaved":
        layers = ((LayerSpec(1, 128),) if full else ()) + (LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=window))
    return Pool("h", plan(CacheSpec(layers, PS, layout), Sizing(num_slots=num_slots, max_seq_len=128)),
                prefix_caching=True)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_hybrid_hit_shares_full_pages_and_only_the_window_pages_of_the_sliding_group(layout):
    pool = hybrid_pool(layout=layout)
    prompt = list(range(100, 125))                     # 25 tokens: 6 full pages, (25-1)//4 = 6 may hit
    admit(pool, 1, prompt)
    full_g = 0
    slide_g = len(pool.allocators) - 1
    s1_full, s1_slide = pool.sequence_slots(1, full_g).tolist(), pool.sequence_slots(1, slide_g).tolist()
    r = admit(pool, 2, prompt)
    assert r.cached_tokens.tolist() == [24]
    # Full group: pages 0..5 shared. Sliding group (window 8): the first computed token (24) attends
    # 17..24, so pages 0..3 are not needed at all and pages 4, 5 come from the cache.
    assert pool.sequence_slots(2, full_g).tolist()[:6] == s1_full[:6]
    assert pool.first_page(2, slide_g) == 4
    assert pool.sequence_slots(2, slide_g).tolist()[:2] == s1_slide[4:6]
    assert pool.sequence_slots(2, slide_g).tolist()[2] != s1_slide[6]
    assert_invariants(pool)


def expected_hit(pool, tokens, salt=""):
    """Brute force from DESIGN's definition, over the caches' contents: the longest h <= limit such that
    every full group holds pages 0..h-1 along the parent chain and every sliding group the pages
    [first_kept(h), h) anchored to those full pages (or chained by parent hash without a full group)."""
    ps = pool.page_size
    n = len(tokens)
    full = n // ps
    limit = (n - 1) // ps
    if not full:
        return 0, {}
    pages = np.array(tokens[:full * ps], dtype=np.int64).reshape(full, ps)
    ns = pool.prefix.namespaces._ids.get((salt, ""), -1)
    if ns < 0:
        return 0, {}
    hashes = pool.prefix.hash_fn(pages, np.arange(full), np.array([0]), np.array([full]), np.array([ns]))
    hashes = [int(h) for h in hashes]

    def found(g, j):
        c = pool.prefixes[g]
        slot = c.by_hash.get(hashes[j], -1)
        if slot < 0 or c.namespace[slot] != ns or c.tokens[slot].tolist() != pages[j].tolist():
            return -1
        return slot

    for h in range(limit, -1, -1):
        chosen, ok = {}, True
        for g, w in enumerate(pool.windows):
            if w:
                continue
            prev = -1
            for j in range(h):
                slot = found(g, j)
                if slot < 0 or pool.prefixes[g].parent[slot] != prev:
                    ok = False
                    break
                chosen[(g, j)] = prev = slot
        for g, w in enumerate(pool.windows):
            if not ok or not w:
                continue
            first = max(h * ps + 1 - w, 0) // ps
            for j in range(first, h):
                slot = found(g, j)
                anchor = pool._anchor_group
                if slot < 0:
                    ok = False
                elif anchor is not None:
                    ok = pool.prefixes[g].anchor[slot] == chosen[(anchor, j)]
                else:
                    ok = int(pool.prefixes[g].parent_hash[slot]) == (hashes[j - 1] if j else 0)
                if not ok:
                    break
                chosen[(g, j)] = slot
        if ok:
            return h, chosen
    raise AssertionError("h = 0 always qualifies")


@pytest.mark.parametrize(("seed", "layout", "full", "window"), [
    (0, "per_layer", True, 8), (1, "interleaved", True, 8), (2, "per_layer", True, 5), (3, "per_layer", False, 8),
    (4, "interleaved", True, 12), (5, "per_layer", False, 6),
])
def test_hybrid_hits_match_a_brute_force_reading_of_the_caches(seed, layout, full, window):
    rng = np.random.default_rng(seed)
    pool = hybrid_pool(num_slots=40, window=window, layout=layout, full=full)
    prefixes = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    live, next_id, hits_seen, partial_seen = [], 1, 0, 0
    for _ in range(150):
        op = rng.random()
        if op < 0.45 or not live:
            base = prefixes[rng.integers(0, 3)]
            cut = int(rng.integers(1, 40))
            tokens = base[:cut] + rng.integers(0, 50, int(rng.integers(0, 8))).tolist()
            salt = ["", "t"][int(rng.integers(0, 2))]
            want, chosen = expected_hit(pool, tokens, salt)
            try:
                r = admit(pool, next_id, tokens, salt=salt)
            except ResourceExhausted:
                if live:
                    pool.step(free_ids=[live.pop(int(rng.integers(0, len(live))))])
                continue
            assert r.cached_tokens.tolist() == [want * PS], (tokens, want)
            for (g, j), slot in chosen.items():
                first = pool.first_page(next_id, g)
                assert pool.sequence_slots(next_id, g)[j - first] == slot
            hits_seen += want > 0
            partial_seen += 0 < want < (len(tokens) - 1) // PS
            live.append(next_id)
            next_id += 1
        elif op < 0.8:
            sid = live[int(rng.integers(0, len(live)))]
            try:
                pool.step(extend_ids=[sid], extend_tokens=[int(rng.integers(1, 9))])
            except (ResourceExhausted, InvalidArgument):
                pool.step(free_ids=[sid])
                live.remove(sid)
        else:
            pool.step(free_ids=[live.pop(int(rng.integers(0, len(live))))])
        assert_invariants(pool)
    assert hits_seen > 10 and partial_seen > 0
    assert sum(a.evictions for a in pool.allocators) > 0


def test_sliding_only_pool_caches_and_refuses_a_collision_on_the_parent_hash():
    pool = hybrid_pool(full=False, window=8)
    prompt = list(range(300, 325))
    admit(pool, 1, prompt)
    assert admit(pool, 2, prompt).cached_tokens.tolist() == [24]
    assert pool.first_page(2, 0) == 4
    assert_invariants(pool)
    # Forced collisions: every page hashes to its position; the tokens of the needed pages match but an
    # earlier page differs, so the parent hash (the forced one) agrees and ... the tokens of page 3 differ.
    pool.prefixes[0].hash_fn = lambda pages, col, *_: (col + 1).astype(np.uint64)
    other = [1, 1, 1, 1, *prompt[4:]]
    assert admit(pool, 3, other).cached_tokens.tolist() == [0]    # pages registered under real hashes only
    assert_invariants(pool)


def test_cached_prefix_pages_predicts_the_next_admissions_hit_and_changes_nothing():
    """A router's question: how many pages would this prompt take from the cache now? Checked against
    what the admission then actually takes, over random prompts sharing random prefixes, per tenant."""
    rng = np.random.default_rng(23)
    pool = cached_pool(num_slots=64)
    base = rng.integers(1, 1000, 40).tolist()
    assert pool.cached_prefix_pages(np.array(base)) == 0
    hits = []
    for seq in range(1, 13):
        keep = int(rng.integers(0, 40))
        prompt = base[:keep] + rng.integers(1, 1000, int(rng.integers(1, 10))).tolist()
        salt = str(rng.choice(["", "tenant-b"]))
        before = (pool.prefix.hits, pool.allocators[0].num_free, pool.allocators[0].num_cached)
        want = pool.cached_prefix_pages(np.array(prompt), salt=salt)
        assert (pool.prefix.hits, pool.allocators[0].num_free, pool.allocators[0].num_cached) == before
        got = admit(pool, seq, prompt, salt=salt).cached_tokens[0]
        assert got == want * PS
        hits.append(want)
        if seq % 3 == 0:
            pool.step(free_ids=[seq - 1])
    assert max(hits) >= 3                                   # the check saw real hits, not only zeros
    assert_invariants(pool)
