"""The fleet index's walk restricted to the pools a caller may read (issue 27, FleetIndex.served_pages and _walk),
once the members' bits take more than one mask word (over 64 member pools): each asked pool's bit is read in its
own word (bit b in word b // 64), for a caller reading one pool of either word and for one reading pools of both
words. Oracle: pool i admitted the prompt's first n_i tokens, so it serves min(n_i // PS, (len - 1) // PS) pages
(docs/DESIGN.md: only full pages are cached, and a hit leaves the prompt's last token to compute)."""

import numpy as np

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import score_prefix, score_prefix_per_pool
from tests.unit.test_fleet_index import PS, step


def test_a_caller_reading_some_of_70_pools_gets_each_pools_own_pages_from_its_own_mask_word():
    rng = np.random.default_rng(7072)
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    prompt = rng.integers(1, 30_000, 16 * PS)
    held = {}
    for i in range(70):
        name = f"p{i:02d}"
        m.create_pool(name, spec, Sizing(num_slots=20, max_seq_len=64), prefix_caching=True)
        held[name] = n = int(rng.integers(PS, 16 * PS + 1))
        with m.locked(name) as pool:
            step(pool, admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
    assert m.fleet.words == 2
    limit = (len(prompt) - 1) // PS
    want = {name: min(n // PS, limit) * PS for name, n in held.items()}
    assert len(set(want.values())) > 5
    names = sorted(held)
    asked = [[n] for n in names] + [[names[int(rng.integers(64))], names[int(rng.integers(64, 70))]]
                                    for _ in range(8)]
    for readable in asked:
        got = score_prefix(m, prompt, readable=frozenset(readable))
        assert [(s.pool, s.cached_tokens) for s in got] == sorted((n, want[n]) for n in set(readable)), readable
        assert got == score_prefix_per_pool(m, prompt, readable=frozenset(readable))
