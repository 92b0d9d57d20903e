"""The fleet index of ScorePrefix: every pool's answer equals what its admission would find, and the index
equals one built from scratch after random steps, evictions, a restore, a deletion and threads."""

import copy
import threading

import numpy as np
import pytest

from kvservice.contract.errors import NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.pool import Pool
from kvservice.core.prefix import _mix, page_hashes
from kvservice.manager.api import flush_fleet
from kvservice.manager.fleet_index import _X0, rebuilt, unmix
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import chained_hashes, score_prefix, score_prefix_per_pool
from tests.kv_workload import PS, Workload, pool_step_args

KEYS = ["", "lora-1"]


def fleet_manager(seed):
    """Pools of every kind sharing prompt families: members of the index (page sizes 4 and 8, two head sizes), a
    hybrid and a sliding-only pool (asked one by one), and one without a cache."""
    m = BlockManager()
    full = CacheSpec.uniform(1, 1, 64, page_size=PS)
    kinds = {
        "a": (full, 64), "b": (full, 80), "c": (full, 112), "d8": (CacheSpec.uniform(1, 1, 64, page_size=8), 40),
        "hyb": (CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8)), PS), 64),
        "sld": (CacheSpec((LayerSpec(1, 64, sliding_window=8),), PS), 64),
        "two": (CacheSpec((LayerSpec(1, 128), LayerSpec(1, 64)), PS), 64),
    }
    for name, (spec, slots) in kinds.items():
        m.create_pool(name, spec, Sizing(num_slots=slots, max_seq_len=256), prefix_caching=True)
    m.create_pool("plain", full, Sizing(num_slots=16, max_seq_len=64))
    w = Workload(np.random.default_rng(seed))
    loads = {name: Workload(np.random.default_rng(seed * 100 + i)) for i, name in enumerate(kinds)}
    for wl in loads.values():
        wl.families = w.families                                   # the same prompt families everywhere
    return m, w, loads


def step(pool, **kw):
    """A Step as the step service runs it (ManagerAPI.run_step): the pool's step, then the fleet index brought
    up to date with the pool's cache, applied or refused."""
    try:
        return pool.step(**kw)
    finally:
        flush_fleet(pool)


def run_steps(m, loads, steps):
    for _ in range(steps):
        for name, wl in loads.items():
            if name not in m.pool_names():
                continue
            with m.locked(name) as pool:
                kw = wl.step()
                args = pool_step_args(kw)
                if kw["admit"]:
                    args["admit_extra_keys"] = [KEYS[int(wl.rng.integers(2))] for _ in kw["admit"]]
                try:
                    step(pool, **args)
                except ResourceExhausted:
                    kw = wl.step(pressure=True)
                    step(pool, **pool_step_args(kw))
                wl.applied(kw)


def admit_now(pool, prompt, salt, key):
    """What a Step admitting the prompt reports, on a copy; the Step's own planner when the copy is too full."""
    clone = copy.deepcopy(pool)
    try:
        r = clone.step(admit_ids=[10**12], admit_tokens=[len(prompt)], admit_token_ids=prompt, admit_salts=[salt],
                       admit_extra_keys=[key])
        return int(r.cached_tokens[0])
    except ResourceExhausted:
        return clone.cached_prefix_pages(prompt, salt, key) * clone.page_size


def random_prompt(w):
    fam = w.families[int(w.rng.integers(len(w.families)))]
    keep = int(w.rng.integers(1, len(fam) + 1))
    tail = w.rng.integers(1, 50_000, int(w.rng.integers(0, 3 * PS)))
    return np.concatenate((fam[:keep], tail)).astype(np.int64)


def assert_scores_exact(m, w, prompts=12):
    """Index answer == per-pool answer == admission, for every pool; returns the pages found."""
    found = 0
    for _ in range(prompts):
        prompt = random_prompt(w)
        salt, key = str(w.rng.choice(["", "tenant-b"])), KEYS[int(w.rng.integers(2))]
        fast = score_prefix(m, prompt, salt, key)
        assert fast == score_prefix_per_pool(m, prompt, salt, key)
        names = m.pool_names()        # a tenant's token reads some pools: the walk follows only theirs, same answers
        mine = frozenset(n for n in names if w.rng.random() < 0.5)
        assert score_prefix(m, prompt, salt, key, readable=mine) == [s for s in fast if s.pool in mine]
        for s in fast:
            if not s.prefix_caching:
                assert s.cached_tokens == 0
                continue
            with m.locked(s.pool) as pool:
                assert s.cached_tokens == admit_now(pool, prompt, salt, key), (s, salt, key)
            found += s.cached_pages
    return found


def assert_index_exact(m):
    """The incrementally kept index == one built from scratch from the caches as they are now."""
    with m.fleet.lock:
        members = [b for b in m.fleet._bits if b is not None]
        ref = rebuilt(members)
        assert m.fleet.snapshot() == ref.snapshot()
    return members


@pytest.mark.parametrize("seed", [1, 2])
def test_index_answers_equal_admissions_through_random_steps(seed):
    m, w, loads = fleet_manager(seed)
    found = 0
    for _ in range(6):
        run_steps(m, loads, 8)
        found += assert_scores_exact(m, w)
        members = assert_index_exact(m)
    caches = {mb.cache for mb in members}
    assert all(m.pool_and_lock(n)[0].prefix in caches for n in ("a", "b", "c", "d8"))
    assert not any(pc in caches for n in ("hyb", "sld") for pc in m.pool_and_lock(n)[0].prefixes)
    assert found > 100                                            # plenty was cached
    assert all(m.pool_and_lock(n)[0].allocators[0].evictions > 0 for n in ("a", "d8"))   # and evicted


def test_restore_and_delete_keep_the_index_exact():
    m, w, loads = fleet_manager(3)
    run_steps(m, loads, 20)
    back = BlockManager()
    back.restore({n: Pool.from_state(m.pool_and_lock(n)[0].export_state(), m.pool_and_lock(n)[0].plan)
                  for n in m.pool_names()})
    assert_index_exact(back)
    for _ in range(10):
        prompt = random_prompt(w)
        assert score_prefix(back, prompt) == score_prefix(m, prompt)
    run_steps(back, loads, 10)                                    # the restored pools keep it up to date
    assert_scores_exact(back, w)
    assert_index_exact(back)
    bit_b = back.pool_and_lock("b")[0].prefix.fleet.bit
    back.delete_pool("b", force=True)
    snap = assert_index_exact(back) and back.fleet.snapshot()
    assert all(bit_b not in bits for table in snap.values() for _, bits, *_ in table.values())
    back.create_pool("b2", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=64, max_seq_len=256),
                     prefix_caching=True)
    assert back.pool_and_lock("b2")[0].prefix.fleet.bit == bit_b                   # the bit is reused
    loads["b2"] = loads.pop("b")
    loads["b2"].live.clear()
    run_steps(back, loads, 10)
    assert_scores_exact(back, w)
    assert_index_exact(back)


def test_more_pools_than_one_mask_word():
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    rng = np.random.default_rng(7)
    prompt = rng.integers(1, 1000, 64)
    for i in range(70):
        m.create_pool(f"p{i:02d}", spec, Sizing(num_slots=20, max_seq_len=64), prefix_caching=True)
        n = int(rng.integers(0, 64))
        if n:
            with m.locked(f"p{i:02d}") as pool:
                step(pool, admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
    assert m.fleet.words == 2
    scores = score_prefix(m, prompt)
    assert scores == score_prefix_per_pool(m, prompt)
    assert len({s.cached_tokens for s in scores}) > 5
    assert_index_exact(m)


def test_a_colliding_page_sends_the_pool_to_the_per_pool_path():
    """Pool x registers prompt q's tokens under prompt p's hashes (an injected hash function: a collision on
    every page), before pool y caches p itself. The entries are mixed; y's answer still equals its admission."""
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    for name in ("x", "y"):
        m.create_pool(name, spec, Sizing(num_slots=32, max_seq_len=64), prefix_caching=True)
    rng = np.random.default_rng(9)
    p, q = rng.integers(1, 1000, 41), rng.integers(1000, 2000, 41)
    x = m.pool_and_lock("x")[0]
    p_pages = p[:40].reshape(10, PS)
    x.prefix.hash_fn = lambda pages, col, starts, full, ns: page_hashes(p_pages[col], col, starts, full, ns)
    step(x, admit_ids=[1], admit_tokens=[41], admit_token_ids=q)
    step(m.pool_and_lock("y")[0], admit_ids=[1], admit_tokens=[41], admit_token_ids=p)
    t = m.fleet.tables[(PS, m.fleet.known_namespace(("", "")))]
    assert t.mixed[[t.row_of(h) for h in x.prefix.by_hash]].all()
    sx, sy = score_prefix(m, p)
    assert (sx.cached_tokens, sy.cached_tokens) == (0, 40)
    assert sy.cached_tokens == admit_now(m.pool_and_lock("y")[0], p, "", "")
    assert score_prefix(m, q)[1].cached_tokens == 0


def test_threads_stepping_while_scoring_leave_the_index_exact():
    m, w, loads = fleet_manager(4)
    errors = []

    def stepper(name):
        try:
            for _ in range(15):
                run_steps(m, {name: loads[name]}, 1)
        except Exception as e:                                    # reported below
            errors.append(e)

    threads = [threading.Thread(target=stepper, args=(n,)) for n in ("a", "b", "c", "d8")]
    for t in threads:
        t.start()
    for _ in range(20):
        for s in score_prefix(m, random_prompt(w)):
            assert 0 <= s.cached_tokens
    for t in threads:
        t.join()
    assert not errors
    assert_index_exact(m)
    assert_scores_exact(m, w, prompts=6)


def registered_by_hand(pages):
    """A manager with one member pool whose cache gets pages registered directly: pages is a list of
    (slot, parent slot, token ids, hash, parent hash as registered)."""
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=16, max_seq_len=64),
                  prefix_caching=True)
    cache = m.pool_and_lock("p")[0].prefix
    cache.add_namespaces({("", ""): 0})
    for slot, parent, tok, h, ph in pages:
        cache.register(np.array([slot]), np.array([parent]), np.array([0]), np.array([tok], dtype=np.int64),
                       np.array([h], dtype=np.uint64), np.array([ph], dtype=np.uint64))
    cache.fleet.flush()                        # what the end of a Step does
    return m


def test_a_page_registered_under_another_parent_is_not_served():
    """Page 1 carries the prompt's hash and tokens but hangs off a page whose hash is not the prompt's page 0
    (only a hash collision makes this): the admission stops after page 0, and so does the index."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(1, 1000, 2 * PS + 1)
    h0, h1 = chained_hashes(prompt[:2 * PS].reshape(2, PS), 0).tolist()
    other = rng.integers(1, 1000, PS)
    m = registered_by_hand([(5, -1, prompt[:PS], h0, 0), (6, -1, other, 777, 0), (7, 6, prompt[PS:2 * PS], h1, 777)])
    assert score_prefix(m, prompt)[0].cached_tokens == PS == score_prefix_per_pool(m, prompt)[0].cached_tokens
    assert m.pool_and_lock("p")[0].cached_prefix_pages(prompt) == 1


def test_a_page_whose_parent_slot_was_reused_is_asked_of_the_pool():
    """Page 1's parent slot now holds the prompt's page 0, but page 1 was registered under another parent hash
    (a stale parent pointer that only a collision can make match): the index cannot tell, so the pool is asked."""
    rng = np.random.default_rng(12)
    prompt = rng.integers(1, 1000, 2 * PS + 1)
    h0, h1 = chained_hashes(prompt[:2 * PS].reshape(2, PS), 0).tolist()
    m = registered_by_hand([(5, -1, prompt[:PS], h0, 0), (7, 5, prompt[PS:2 * PS], h1, 777)])
    (t,) = m.fleet.tables.values()
    assert t.stale[t.row_of(h1)] == 1
    assert m.pool_and_lock("p")[0].cached_prefix_pages(prompt) == 2
    assert score_prefix(m, prompt)[0].cached_tokens == 2 * PS == score_prefix_per_pool(m, prompt)[0].cached_tokens


def test_long_prompts_and_prefixes_of_every_length():
    """Prefixes ending around 64 pages (the per-pool path's first round) and far past it, prompts cut at them:
    every pool gets exactly the pages it holds."""
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    rng = np.random.default_rng(13)
    prompt = rng.integers(1, 50_000, 2001)
    held = [0, 63 * PS, 64 * PS, 64 * PS + 3, 65 * PS, 400 * PS + 1, 2000, 2001]
    for i, n in enumerate(held):
        m.create_pool(f"p{i}", spec, Sizing(num_slots=520, max_seq_len=2004), prefix_caching=True)
        if n:
            with m.locked(f"p{i}") as pool:
                step(pool, admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
                step(pool, free_ids=[1])
    for length in (2001, 64 * PS + 1, 64 * PS, 300):
        got = [s.cached_tokens for s in score_prefix(m, prompt[:length])]
        assert got == [min(n // PS, (length - 1) // PS) * PS for n in held], length
        assert got == [s.cached_tokens for s in score_prefix_per_pool(m, prompt[:length])]
    assert score_prefix(m, np.concatenate((prompt[:100], [7] * 500)))[-1].cached_tokens == 100 // PS * PS


def test_a_step_in_flight_does_not_hold_up_a_score():
    """A member pool is answered from the index as of its last Step, without its lock (held here, as by a long
    Step); a pool asked itself (hybrid) still waits for its lock."""
    m, w, loads = fleet_manager(5)
    run_steps(m, loads, 10)
    prompt, salt, key = next((f, salt, key) for f in w.families for salt in ("", "tenant-b") for key in KEYS
                             if score_prefix(m, f, salt, key, pools=["a"])[0].cached_tokens)
    before = score_prefix(m, prompt, salt, key, pools=["a", "b"])
    out = []
    _, lock = m.pool_and_lock("a")
    with lock:
        t = threading.Thread(target=lambda: out.append(score_prefix(m, prompt, salt, key, pools=["a", "b"])))
        t.start()
        t.join(60)                                   # a guard against a deadlock, not a timing
        assert not t.is_alive()
    assert out == [before]


def test_pools_created_and_deleted_while_scoring():
    """A query over every pool leaves out one deleted meanwhile (no NotFound), a reused bit never answers for the
    pool that left (each temporary pool caches its own prompt), and the index stays exact."""
    m, w, loads = fleet_manager(6)
    run_steps(m, loads, 10)
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    own = [np.random.default_rng(50 + i).integers(60_000, 90_000, 60) for i in range(3)]   # no family shares them
    stop, errors, cycles = threading.Event(), [], [0]

    def churn():
        try:
            k = 0
            while not stop.is_set():                              # runs for as long as the queries do
                i = k % 3
                if f"tmp{i}" in m.pool_names():
                    m.delete_pool(f"tmp{i}", force=True)
                else:
                    m.create_pool(f"tmp{i}", spec, Sizing(num_slots=64, max_seq_len=256), prefix_caching=True)
                    with m.locked(f"tmp{i}") as pool:
                        step(pool, admit_ids=[1], admit_tokens=[60], admit_token_ids=own[i])
                k += 1
                cycles[0] = k
        except Exception as e:                                    # reported below
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    seen = k = 0
    try:
        # At least 60 queries, and on until a temporary pool was scored while the churn went on: how the two threads
        # interleave is up to the scheduler (on a loaded machine the churn once ran all its work before the first
        # query), so a fixed count of either cannot promise that they overlapped.
        while (k < 60 or not seen) and k < 20_000 and not errors:
            i = k % 3
            for s in score_prefix(m, np.concatenate((own[i], [1, 2, 3]))):
                if s.pool == f"tmp{i}":
                    assert s.cached_tokens in (0, 60)              # 0: created, not yet stepped
                    seen += s.cached_tokens == 60
                else:
                    assert s.cached_tokens == 0, s
            k += 1
    finally:
        stop.set()
        t.join()
    assert not errors
    assert seen, (k, cycles[0])                                   # the temporary pools were found and scored
    assert_index_exact(m)
    assert_scores_exact(m, w, prompts=4)


def test_unmix_inverts_the_steps_mix():
    x = np.random.default_rng(14).integers(0, 2**63, 1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    x = np.concatenate((x, np.array([0, 1, 2**64 - 1], dtype=np.uint64)))
    assert np.array_equal(unmix(_mix(x)), x)
    assert np.array_equal(_mix(unmix(x)), x)
    assert _mix(np.array([_X0], dtype=np.uint64))[0] == 0


def test_the_chain_value_stored_as_another_sends_the_pools_to_their_own_path(monkeypatch):
    """The Step stores a page whose chain value is 0 as 1 (never seen: 2^-64). Pretend page 3's value is that one:
    the walk stops there and the pools that hold page 3 are asked themselves, so the answers stay exact."""
    import kvservice.manager.fleet_index as fi
    from kvservice.manager.routing import _Chain

    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    rng = np.random.default_rng(15)
    prompt = rng.integers(1, 1000, 41)
    for name, n in (("short", 8), ("long", 40)):
        m.create_pool(name, spec, Sizing(num_slots=32, max_seq_len=64), prefix_caching=True)
        step(m.pool_and_lock(name)[0], admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
    hashes = chained_hashes(prompt[:40].reshape(10, PS), 0)
    monkeypatch.setattr(fi, "_X0", int(unmix(hashes[3:4])[0]))
    chain = _Chain(prompt[:40].reshape(10, PS), 0)
    with m.fleet.lock:
        members = [m.pool_and_lock(n)[0].prefix.fleet for n in ("short", "long")]
        served, check = m.fleet.served_pages(PS, chain.seed, chain.terms(), chain.pages, ("", ""), members)
    assert served.tolist() == [2, 3] and check.tolist() == [False, True]
    assert [(s.pool, s.cached_tokens) for s in score_prefix(m, prompt)] == [("long", 40), ("short", 8)]


def test_prompts_of_at_most_one_page_score_what_an_admission_gets_in_every_pool_kind():
    """Short prompts are answered 0 without asking any pool (their last token is always computed): checked
    against admissions on full, hybrid and sliding-only pools, with page sizes 4 and 8."""
    m, w, loads = fleet_manager(3)
    run_steps(m, loads, 8)
    for fam in w.families:
        for n in range(1, 10):
            prompt = np.asarray(fam[:n], dtype=np.int64)
            for s in score_prefix(m, prompt, "", KEYS[0]):
                if not s.prefix_caching:
                    assert s.cached_tokens == 0
                    continue
                with m.locked(s.pool) as pool:
                    assert s.cached_tokens == admit_now(pool, prompt, "", KEYS[0]), (s, n)


class _CountingRows(dict):
    """A table's key -> row dict that counts lookups (what a walk reads)."""

    lookups = 0

    def get(self, key, default=None):
        _CountingRows.lookups += 1
        return super().get(key, default)


def test_a_tenants_score_reads_only_its_own_pools_entries():
    """Issue 27: with readable pools, the walk stops where none of them serves the prompt, whatever other pools
    (another tenant's) hold: same entries read, same answer, whether the other pool caches 1 or 40 of its pages."""
    rng = np.random.default_rng(27)
    prompt = rng.integers(1, 1000, 40 * PS + 1)
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    reads = {}
    for theirs in (1, 40):
        m = BlockManager()
        for name, n in (("mine", 2 * PS), ("theirs", theirs * PS)):
            m.create_pool(name, spec, Sizing(num_slots=64, max_seq_len=64 * PS), prefix_caching=True)
            step(m.pool_and_lock(name)[0], admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
        for t in m.fleet.tables.values():
            t.rows = _CountingRows(t.rows)
        _CountingRows.lookups = 0
        (s,) = score_prefix(m, prompt, readable=frozenset({"mine"}))
        assert (s.pool, s.cached_tokens) == ("mine", 2 * PS)
        reads[theirs] = _CountingRows.lookups
        assert [x.pool for x in score_prefix(m, prompt)] == ["mine", "theirs"]
        with pytest.raises(NotFound, match="'theirs' does not exist"):       # named but not readable: as unknown
            score_prefix(m, prompt, pools=["theirs"], readable=frozenset({"mine"}))
    assert reads[1] == reads[40] == 3, reads       # pages 0 and 1 (ours), then page 2 (nobody of ours): stop


def test_each_members_child_lists_are_exactly_the_caches_registered_pages():
    """A member's children (parent slot -> registered slots under it) rebuilt from the cache's own arrays after a
    long run with evictions: a page the cache forgot must leave its parent's list (else the lists grow with the
    history and a forgotten slot is re-evaluated as if still cached)."""
    m, _, loads = fleet_manager(3)
    run_steps(m, loads, 30)
    assert all(m.pool_and_lock(n)[0].allocators[0].evictions > 0 for n in ("a", "d8"))
    with m.fleet.lock:
        members = [b for b in m.fleet._bits if b is not None]
        assert len(members) >= 4
        for b in members:
            want: dict[int, set[int]] = {}
            for s in b.cache.by_hash.values():
                p = int(b.cache.parent.item(int(s)))
                if p >= 0:
                    want.setdefault(p, set()).add(int(s))
            assert b.children == want


def test_a_table_keeps_every_rows_64_bit_hashes_and_tokens_exactly_when_it_grows():
    """_Table's rows hold full 64-bit page and parent hashes (uint64: a float would round them, and its
    parent check would pass a parent that differs in the low bits); grow keeps the contents."""
    from kvservice.manager.fleet_index import _Table

    rng = np.random.default_rng(2317)
    t = _Table(page_size=3, words=1)
    n = len(t.holders)
    h = rng.integers(2**60, 2**64 - 1, n, dtype=np.uint64) | np.uint64(1)
    ph = rng.integers(2**60, 2**64 - 1, n, dtype=np.uint64) | np.uint64(1)
    tok = rng.integers(1, 2**40, (n, 3))
    t.hash[:], t.parent_hash[:], t.tokens[:] = h, ph, tok
    t.used = n
    t.grow(4 * n, 2)
    assert len(t.holders) == 4 * n and t.mask.shape == (4 * n, 2)
    assert [int(x) for x in t.parent_hash[:n]] == [int(x) for x in ph]
    assert [int(x) for x in t.hash[:n]] == [int(x) for x in h]
    assert (t.tokens[:n] == tok).all() and not t.parent_hash[n:].any()
    assert not (t.parent_hash[:n] == (ph ^ np.uint64(1))).any()     # a parent one bit off is another parent
