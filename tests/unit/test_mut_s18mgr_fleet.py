"""The fleet index over a long history (issue #28: memory that grows with history): a 64-slot pool admits and frees
hundreds of random prompts in three salts without a flush between Steps. The notes pending a flush stay bounded,
each table's row arena never holds more rows than the cache has slots (freed rows are reused), the index then
equals the cache's own entries by salt (PrefixCache.by_hash, read directly), and deleting the pool leaves no table,
no membership and a member whose late flush changes nothing."""

import numpy as np

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import flush_fleet
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import _Chain

PS = 4
SLOTS = 64
SALTS = ("", "a", "b")


def _entries_by_salt(cache):
    """salt -> set of chained hashes the cache holds, from its own dict and namespace array."""
    names = {i: key for key, i in cache.namespaces._ids.items()}
    out: dict[tuple[str, str], set[int]] = {}
    for h, s in cache.by_hash.items():
        out.setdefault(names[int(cache.namespace[s])], set()).add(h)
    return out


def test_a_long_history_keeps_the_index_bounded_and_equal_to_the_cache():
    rng = np.random.default_rng(1950)
    m = BlockManager()
    m.create_pool("c", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS),
                  prefix_caching=True)
    pool, lock = m.pool_and_lock("c")
    cache = pool.prefix
    member = cache.fleet
    assert member is not None and member.index is m.fleet
    fams = [rng.integers(1, 30_000, 60) for _ in range(4)]
    most_notes, registered = 0, 0
    for i in range(1, 400):
        n = int(rng.integers(2 * PS, 15 * PS))
        fresh = rng.integers(1, 30_000, n)
        if rng.random() < 0.3:                                     # sometimes a shared beginning
            k = min(n, int(rng.integers(PS, 60)))
            fresh[:k] = fams[int(rng.integers(4))][:k]
        with lock:
            pool.step(admit_ids=[i], admit_tokens=[n], admit_token_ids=fresh, admit_salts=[str(rng.choice(SALTS))])
            pool.step(free_ids=[i])
        registered += n // PS
        most_notes = max(most_notes, len(member.dirty) + len(member.dirty_slots))
        assert most_notes <= 4 * SLOTS + 1024 + 2 * (n // PS)      # flushed once past the bound, not later
    assert registered > 4 * SLOTS + 1024                             # the bound was reached
    with m.fleet.lock:
        for t in m.fleet.tables.values():                            # rows of forgotten pages were reused
            assert t.used <= SLOTS and t.used - t.num_free == len(t.rows)
    for i in range(400, 600):                                        # then flushed after every Step, as served
        n = int(rng.integers(2 * PS, 15 * PS))
        with lock:
            pool.step(admit_ids=[i], admit_tokens=[n], admit_token_ids=rng.integers(1, 30_000, n),
                      admit_salts=[str(rng.choice(SALTS))])
            flush_fleet(pool)
            pool.step(free_ids=[i])
            flush_fleet(pool)
        with m.fleet.lock:
            assert all(t.used <= SLOTS for t in m.fleet.tables.values()), i
    with m.fleet.lock:
        snap = m.fleet.snapshot()
        assert all(t.used <= SLOTS for t in m.fleet.tables.values())
        for key in SALTS:
            k = (key, "")
            if k in {name for _, name in snap}:
                assert m.fleet.known_namespace(k) == m.fleet.namespace_id(k) >= 0
        assert m.fleet.known_namespace(("never", "")) == -1
    assert {name: set(d) for (ps, name), d in snap.items()} == _entries_by_salt(cache)
    assert all(ps == PS for ps, _ in snap)
    m.delete_pool("c")
    assert cache.fleet is None
    assert m.fleet.tables == {} and m.fleet.snapshot() == {}
    member.dirty.update(cache.by_hash)                               # a late flush of the departed member
    member.flush()
    assert m.fleet.tables == {}


def test_a_member_that_left_the_index_serves_nothing_and_must_be_asked():
    """served_pages for a departed member (a pool deleted while a query was under way): 0 pages, and check set so
    the caller asks the pool itself; a member still in the index gets its prompt's (n - 1) // ps pages."""
    rng = np.random.default_rng(1951)
    m = BlockManager()
    n = int(rng.integers(5 * PS + 1, 9 * PS))
    prompt = rng.integers(1, 30_000, n)
    members = []
    for name in ("x", "y"):
        m.create_pool(name, CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS),
                      prefix_caching=True)
        pool, lock = m.pool_and_lock(name)
        with lock:
            pool.step(admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt, admit_salts=[""])
            flush_fleet(pool)
        members.append(pool.prefix.fleet)
    m.delete_pool("x", force=True)
    with m.pool_and_lock("y")[1]:
        ns = int(m.pool_and_lock("y")[0].prefix.namespace_ids([""], [""])[0][0])
    limit = (n - 1) // PS
    chain = _Chain(prompt[:n // PS * PS].reshape(-1, PS).astype(np.int64), ns)
    with m.fleet.lock:
        served, check = m.fleet.served_pages(PS, chain.seed, chain.terms()[:limit], chain.pages, ("", ""), members)
    assert served.tolist() == [0, limit] and check.tolist() == [True, False]
