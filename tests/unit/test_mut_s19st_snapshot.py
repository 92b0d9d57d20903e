"""snapshot.verify_pools (the journal's check of live pools before a snapshot): every damaged pool's problems,
in pool order, each prefixed with the pool's name; a pool outside `names` is not looked at. The damage here is a
negative counter (docs/DESIGN.md: steps, admitted and refused count up from 0), which check_pool_state reports as
"a counter is negative"."""

from __future__ import annotations

import numpy as np

from kvservice.state import snapshot as snap

from .test_mut_m28e_snapshot import real_pool

NEGATIVE = "a counter is negative"


def test_verify_pools_lists_the_problems_of_every_damaged_pool_by_name():
    rng = np.random.default_rng(19_6)
    names = ["p-" + "".join(rng.choice(list("abcdefgh"), 5)) + str(k) for k in range(5)]
    pools = {name: real_pool(rng) for name in names}
    damaged = sorted(int(k) for k in rng.choice(5, size=3, replace=False))
    for k, counter in zip(damaged, ("steps", "admitted", "refused"), strict=True):
        setattr(pools[names[k]], counter, -int(rng.integers(1, 1000)))
    want = [f"pool {names[k]!r}: {NEGATIVE}" for k in damaged]
    assert snap.verify_pools(pools) == want
    assert snap.verify_pools(pools, set(names)) == want
    sound = [n for k, n in enumerate(names) if k not in damaged]
    assert snap.verify_pools(pools, set(sound)) == []
    assert snap.verify_pools(pools, {names[damaged[0]], names[damaged[2]], *sound}) == [want[0], want[2]]
