"""The fleet index's member bits take one uint64 mask word per entry while there are at most 64 members, and a
second word from the 65th on (fleet_index.py: bit b of member b lives in word b // 64). Scores stay exact across
the growth. Oracle: pool i admitted the prompt's first n_i tokens, so it serves min(n_i // PS, (len - 1) // PS)
full pages (docs/DESIGN.md: only full pages are cached, and a hit leaves the prompt's last token to compute)."""

import numpy as np

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.fleet_index import FleetIndex
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import score_prefix
from tests.unit.test_fleet_index import PS, step


def _mask_words(m: BlockManager) -> set[int]:
    with m.fleet.lock:
        return {t.mask.shape[1] for t in m.fleet.tables.values()}


def test_a_new_index_has_one_mask_word_until_its_65th_member():
    assert FleetIndex().words == 1
    rng = np.random.default_rng(6581)
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    prompt = rng.integers(1, 30_000, 12 * PS)
    held = {}
    for i in range(65):
        name = f"p{i:02d}"
        m.create_pool(name, spec, Sizing(num_slots=16, max_seq_len=64), prefix_caching=True)
        held[name] = n = int(rng.integers(PS, 12 * PS + 1))
        with m.locked(name) as pool:
            step(pool, admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
        if i == 63:
            assert m.fleet.words == 1 and _mask_words(m) == {1}
    assert m.fleet.words == 2 and _mask_words(m) == {2}
    limit = (len(prompt) - 1) // PS
    got = {s.pool: s.cached_tokens for s in score_prefix(m, prompt)}
    assert got == {name: min(n // PS, limit) * PS for name, n in held.items()}
