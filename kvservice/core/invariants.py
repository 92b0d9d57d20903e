"""assert_invariants(pool): docs/DESIGN.md's invariants, checked from scratch (tests call it after every op)."""

from __future__ import annotations

import numpy as np

from kvservice.contract.pagetable import validate_page_table
from kvservice.core.pool import Pool


def assert_invariants(pool: Pool) -> None:
    """Raise AssertionError naming the first broken invariant."""
    geo = pool.plan.geometry
    ps = pool.page_size
    ids, tokens = pool.sequences()
    assert len(set(ids.tolist())) == len(ids), "a sequence id is live twice"
    assert (tokens > 0).all(), "a live sequence holds no tokens"
    for g, alloc in enumerate(pool.allocators):
        alloc.check()
        num_slots = geo.groups[g].num_slots
        assert alloc.num_slots == num_slots, f"group {g}: allocator of {alloc.num_slots} slots, plan {num_slots}"
        owners = np.zeros(num_slots, dtype=np.int64)
        window = pool.windows[g]
        for seq_id, n in zip(ids.tolist(), tokens.tolist(), strict=True):
            held = pool.sequence_slots(seq_id, g)
            first = pool.first_page(seq_id, g)
            # 3. n tokens own exactly ceil(n / page_size) slots per full group; a sliding group only
            #    the pages from `first` on, and every released page lies wholly before the window
            #    of the next query (position n attends tokens n + 1 - window .. n).
            assert len(held) == -(-n // ps) - first, f"seq {seq_id} holds {len(held)} slots for {n} tokens"
            assert first == 0 or (window and first * ps <= max(0, n + 1 - window)), \
                f"seq {seq_id} released page {first - 1} of group {g} while inside the window"
            assert (held >= 0).all() and (held < num_slots).all(), f"seq {seq_id} holds a bad slot id"
            np.add.at(owners, held, 1)
        rc = alloc.refcount(np.arange(num_slots))
        # 1. refcount == number of owners; 2. free xor owned, counts add up.
        assert (rc == owners).all(), f"group {g}: refcount != owners at slot {np.flatnonzero(rc != owners)[:5]}"
        assert alloc.num_free + int((owners > 0).sum()) == num_slots, f"group {g}: free + owned != num_slots"
    for g, cache in enumerate(pool.prefixes or ()):
        alloc = pool.allocators[g]
        assert cache.allocator is alloc, f"group {g}: prefix cache over another group's allocator"
        for h, slot in cache.by_hash.items():
            assert int(cache.hash[slot]) == h and alloc.cacheable[slot], \
                f"group {g}: cache entry {h:#x} -> slot {slot} is stale"
        assert int(alloc.cacheable.sum()) == len(cache.by_hash), f"group {g}: cacheable slots != cache entries"
    # 4. every emitted index lies inside and on the lattice of its own space.
    if len(ids):
        for st in pool.tables_for(ids):
            report = validate_page_table(st.table, st.space, ps, pool_pages=geo.pool_pages)
            assert report.ok, f"index space {st.space.id}: {report.violations[:3]}"
