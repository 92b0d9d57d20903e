"""kvservice/manager/fleet_index.py FleetMember._add: an entry's bits and stale count for every kind of parent
a registered page can have, against the module docstring's rule:

- linked (the member's bit set): the parent slot is -1 and the registered parent hash 0, or the parent slot
  now holds exactly the registered parent hash;
- stale: neither linked nor surely missed, a parent slot holding nothing registered being a sure miss;
- holders: every member that registered the hash at all; mixed: a holder's content differs from the canonical.
"""

from __future__ import annotations

import numpy as np

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
