"""kvservice/manager/fleet_index.py FleetMember._add: an entry's bits and stale count for every kind of parent
a registered page can have, against the module docstring's rule:

- linked (the member's bit set): the parent slot is -1 and the registered parent hash 0, or the parent slot
  now holds exactly the registered parent hash;
- stale: neither linked nor surely missed, a parent slot holding nothing registered being a sure miss;
- holders: every member that registered the hash at all; mixed: a holder's content differs from the canonical.
"""

from __future__ import annotations

import numpy as np

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import chained_hashes, score_prefix, score_prefix_per_pool
from tests.unit.test_fleet_index import PS, registered_by_hand


def _entries(m):
    """hash -> (holders, bits serving it, stale, mixed) of the one member pool's namespace."""
    with m.fleet.lock:
        snap = m.fleet.snapshot()
    assert list(snap) == [(PS, ("", ""))]
    return snap[(PS, ("", ""))]


def test_each_kind_of_parent_sets_the_bit_and_stale_count_the_docstring_says():
    """Seven pages in one cache: a first page (parent -1, parent hash 0: linked); a page with parent slot -1
    but a registered parent hash (not linked, and the pool must be asked: stale); a page whose parent slot
    holds its parent hash (linked); one whose parent slot holds another registered hash (stale); one whose
    parent slot holds nothing (a sure miss: neither); and a first page and its child registered with parent
    hashes that are random and non-zero (neither linked, the child stale)."""
    rng = np.random.default_rng(2003)
    prompt = rng.integers(1, 30000, 2 * PS + 1)
    h0, h1 = chained_hashes(prompt[:2 * PS].reshape(2, PS), 0).tolist()
    toks = [rng.integers(1, 30000, PS) for _ in range(5)]
    other = [int(x) for x in rng.integers(1, 2**63, 6, dtype=np.uint64)]
    m = registered_by_hand([
        (0, -1, prompt[:PS], h0, 0),                   # a first page in slot 0: linked
        (2, 0, prompt[PS:2 * PS], h1, h0),             # parent slot 0 holds h0, as registered: linked
        (3, -1, toks[0], other[0], other[1]),          # parent -1 but a parent hash: not linked, stale
        (4, 0, toks[1], other[2], other[3]),           # parent slot 0 holds h0, not other[3]: stale
        (5, 9, toks[2], other[4], other[5]),           # parent slot 9 holds nothing: a sure miss
        (6, 3, toks[3], 1234567, other[0]),            # under slot 3, which holds other[0]: linked
        (7, -1, toks[4], 7654321, 1),                  # parent -1, parent hash 1: not linked, stale
    ])
    assert _entries(m) == {
        h0: (1, frozenset({0}), 0, False),
        h1: (1, frozenset({0}), 0, False),
        other[0]: (1, frozenset(), 1, False),
        other[2]: (1, frozenset(), 1, False),
        other[4]: (1, frozenset(), 0, False),
        1234567: (1, frozenset({0}), 0, False),
        7654321: (1, frozenset(), 1, False),
    }
    assert score_prefix(m, prompt)[0].cached_tokens == 2 * PS == score_prefix_per_pool(m, prompt)[0].cached_tokens


def test_a_first_page_registered_with_a_parent_hash_is_asked_of_the_pool_not_served_from_the_index():
    """The prompt's own page 0 registered under parent slot -1 with a non-zero parent hash: the index holds it
    unlinked and stale (so ScorePrefix asks the pool), and its answer still equals the pool's own."""
    rng = np.random.default_rng(2004)
    prompt = rng.integers(1, 30000, PS + 3)
    (h0,) = chained_hashes(prompt[:PS].reshape(1, PS), 0).tolist()
    m = registered_by_hand([(4, -1, prompt[:PS], h0, int(rng.integers(1, 2**63)))])
    assert _entries(m) == {h0: (1, frozenset(), 1, False)}
    pool = m.pool_and_lock("p")[0]
    want = pool.cached_prefix_pages(prompt) * PS
    assert score_prefix(m, prompt)[0].cached_tokens == want == score_prefix_per_pool(m, prompt)[0].cached_tokens


def _cache(m, name, namespaces):
    """A member pool's prefix cache with these (salt, extra key) -> its own namespace ids."""
    m.create_pool(name, CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=16, max_seq_len=64),
                  prefix_caching=True)
    cache = m.pool_and_lock(name)[0].prefix
    cache.add_namespaces(namespaces)
    return cache


def _reg(cache, slot, parent, ns, tok, h, ph):
    cache.register(np.array([slot]), np.array([parent]), np.array([ns]), np.array([tok], dtype=np.int64),
                   np.array([h], dtype=np.uint64), np.array([ph], dtype=np.uint64))


def test_two_members_two_namespaces_canonical_content_and_forgetting():
    """Two member pools (bits 0 and 1, numbering their namespaces differently) register pages of two namespaces
    in one flush each. A parent slot holding nothing is a sure miss even when the registered parent hash is 0
    (the slot's "nothing"), and one holding the stored chain value 1 links a page registered under 1. A second
    holder whose tokens or parent hash differ from the first's makes the entry mixed, its bit unset. Forgetting
    pages takes each member's count, bit and stale count back out; mixed stays until the entry empties, and a
    namespace's table goes with its last entry."""
    rng = np.random.default_rng(2005)
    h1, h2, h3, h4 = (int(x) for x in rng.integers(2**63, 2**64, 4, dtype=np.uint64))     # the high bit set
    a, b, b2, c, d = (rng.integers(1, 30000, PS) for _ in range(5))
    m = BlockManager()
    p = _cache(m, "p", {("", ""): 0, ("s", "k"): 1})
    q = _cache(m, "q", {("s", "k"): 0, ("", ""): 1})
    assert (p.fleet.bit, q.fleet.bit) == (0, 1)
    _reg(p, 1, -1, 0, a, h1, 0)
    _reg(p, 2, -1, 1, b, h2, 0)
    _reg(p, 3, 0, 0, c, h3, 0)                         # parent slot 0 holds nothing: a sure miss
    _reg(p, 5, -1, 0, d, 1, 0)                         # a page stored as the chain value 1
    _reg(p, 4, 5, 0, c, h4, 1)                         # ... whose child is linked
    p.fleet.flush()
    _reg(q, 7, -1, 1, a, h1, 0)                        # the same page: q serves it too
    _reg(q, 8, -1, 0, b2, h2, 0)                       # other tokens: mixed, q's bit unset
    _reg(q, 9, -1, 1, c, h3, 77)                       # another parent hash: mixed; parent -1 with it: stale
    q.fleet.flush()

    def entries():
        with m.fleet.lock:
            return m.fleet.snapshot()

    plain, salted = (PS, ("", "")), (PS, ("s", "k"))
    assert entries() == {
        plain: {h1: (2, frozenset({0, 1}), 0, False), h3: (2, frozenset(), 1, True),
                1: (1, frozenset({0}), 0, False), h4: (1, frozenset({0}), 0, False)},
        salted: {h2: (2, frozenset({0}), 0, True)},
    }
    p.forget(1)
    q.forget(8)
    p.fleet.flush()
    q.fleet.flush()
    assert entries() == {
        plain: {h1: (1, frozenset({1}), 0, False), h3: (2, frozenset(), 1, True),
                1: (1, frozenset({0}), 0, False), h4: (1, frozenset({0}), 0, False)},
        salted: {h2: (1, frozenset({0}), 0, True)},
    }
    q.forget(9)
    p.forget(2)
    p.forget(5)                                         # h4's parent slot now holds nothing: a sure miss
    p.fleet.flush()
    q.fleet.flush()
    assert entries() == {plain: {h1: (1, frozenset({1}), 0, False), h3: (1, frozenset(), 0, True),   # sticky
                                 h4: (1, frozenset(), 0, False)}}
    with m.fleet.lock:
        assert list(m.fleet.tables) == [(PS, m.fleet.known_namespace(("", "")))]
