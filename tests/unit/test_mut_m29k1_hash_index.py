"""HashSlots' table against a plain-Python open-addressing model (kvservice/core/hash_index.py's docstring: a
power-of-two array of at least 2 x num_slots and 16 positions, linear probing from the key's home, 0 = empty,
a known key overwritten in place; rebuilt at most half full)."""

import numpy as np
import pytest

from kvservice.core.hash_index import HashSlots

MULT = 0x9E3779B97F4A7C15


class Table:
    """The probe model on Python ints: home = the top log2(capacity) bits of key x MULT mod 2^64."""

    def __init__(self, capacity: int):
        self.cap = capacity

    def home(self, k: int) -> int:
        return ((k * MULT) % 2**64) >> (64 - (self.cap.bit_length() - 1))



def check_probe_runs(t: HashSlots, model: Table, latest: dict[int, int]) -> None:
    """The table holds exactly the latest (key, slot) pairs, each key at a position reached from its home by
    linear probing over occupied positions only (a lookup stops at the first empty one)."""
    keys = t.keys.tolist()
    pairs = {(k, s) for k, s in zip(keys, t.slots.tolist(), strict=True) if k}
    assert pairs == set(latest.items()) and t.used == len(latest) == len(pairs)
    for p, k in enumerate(keys):
        if k:
            q = model.home(k)
            while q != p:
                assert keys[q] != 0, f"key {k:#x} at {p} is past an empty position {q} from its home"
                q = (q + 1) % model.cap


@pytest.mark.parametrize("num_slots", [1, 8, 9, 100, 1000])
def test_the_table_layout_is_linear_probing_from_the_top_bits_home(num_slots):
    """After insertions in batches (distinct keys per batch, keys reused across batches) the table holds every
    key's latest slot on its probe run, used counts the occupied positions, and lookups give every key's latest
    slot and -1 for absent keys."""
    cap = max(16, 1 << (2 * num_slots - 1).bit_length())
    rng = np.random.default_rng(num_slots)
    t = HashSlots(num_slots)
    assert (len(t.keys), t.mask, int(t.shift), t.used) == (cap, cap - 1, 64 - (cap.bit_length() - 1), 0)
    assert cap >= 2 * num_slots and cap & (cap - 1) == 0
    model = Table(cap)
    universe = rng.integers(1, 2**64 - 1, cap, dtype=np.uint64)       # more keys than 3/4 of the table
    latest: dict[int, int] = {}
    for _ in range(10 * cap):
        keys = np.unique(rng.choice(universe, int(rng.integers(1, 6)), replace=False))
        new = len(set(keys.tolist()) - set(latest))
        if t.full_after(new):
            break
        assert len(latest) <= cap * 3 // 4
        slots = rng.integers(0, 10 * num_slots, len(keys)).astype(np.int64)
        t.insert(keys, slots)
        t.flush()
        for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
            latest[k] = s
        check_probe_runs(t, model, latest)
    assert len(latest) > cap * 3 // 4 - 6                   # filled to the rebuild point
    absent = rng.integers(1, 2**64 - 1, 30, dtype=np.uint64)
    absent = absent[~np.isin(absent, universe)]
    probe = np.concatenate((np.array(list(latest), dtype=np.uint64), absent))
    assert t.lookup(probe).tolist() == [*latest.values(), *[-1] * len(absent)]


def test_a_rebuild_doubles_until_at_most_half_full_and_holds_exactly_the_given_pairs():
    rng = np.random.default_rng(77)
    t = HashSlots(8)                                   # 16 positions
    keys = np.unique(rng.integers(1, 2**64 - 1, 40, dtype=np.uint64))
    slots = rng.integers(0, 500, len(keys)).astype(np.int64)
    t.insert(keys[:3], slots[:3])
    t.rebuild(keys, slots)                             # 40 keys: 16 -> 32 -> 64 -> 128 positions... at most half full
    cap = 16
    while len(keys) > cap // 2:
        cap *= 2
    assert t.mask + 1 == cap and t.used == len(keys) and not t.pending and t.pending_n == 0
    check_probe_runs(t, Table(cap), dict(zip(keys.tolist(), slots.tolist(), strict=True)))
    assert t.lookup(keys).tolist() == slots.tolist()
