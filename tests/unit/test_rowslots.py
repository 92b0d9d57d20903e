"""RowSlots (ragged slot storage) against a dict-of-lists model, and its memory bound."""

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.rowslots import RowSlots


@pytest.mark.parametrize("seed", range(6))
def test_random_reserve_write_drop_copy_matches_a_plain_model(seed):
    rng = np.random.default_rng(seed)
    rs = RowSlots(np.int32, 4)
    model: dict[int, dict[int, int]] = {}        # row -> {column: slot}
    first: dict[int, int] = {}
    held: dict[int, int] = {}
    next_val = 1
    for _ in range(400):
        op = rng.integers(0, 5)
        live = sorted(model)
        if op == 0 or not live:                   # a new row with some pages
            row = max([*model, -1]) + 1 if rng.random() < 0.7 or not live else int(rng.integers(0, 40))
            if row in model:
                continue
            rs.grow_rows(row + 1)
            n = int(rng.integers(1, 30))
            r = np.array([row])
            rs.reserve(r, np.array([0]), np.array([n]))
            vals = np.arange(next_val, next_val + n)
            next_val += n
            flat, _ = rs.span(r, np.array([0]), np.array([n]))
            rs.arena[flat] = vals
            model[row], first[row], held[row] = dict(enumerate(vals.tolist())), 0, n
        elif op == 1:                             # grow some rows by a few pages
            rows = rng.choice(live, size=min(len(live), int(rng.integers(1, 5))), replace=False)
            add = rng.integers(1, 9, len(rows))
            lo = np.array([held[r] for r in rows])
            hi = lo + add
            rs.reserve(rows.astype(np.int64), np.array([first[r] for r in rows]), hi)
            flat, _ = rs.span(rows.astype(np.int64), lo, hi)
            vals = np.arange(next_val, next_val + int(add.sum()))
            next_val += len(vals)
            rs.arena[flat] = vals
            it = iter(vals.tolist())
            for r, a, b in zip(rows.tolist(), lo.tolist(), hi.tolist(), strict=True):
                for j in range(a, b):
                    model[r][j] = next(it)
                held[r] = b
        elif op == 2:                             # a window releases the front of a row
            r = int(rng.choice(live))
            nf = int(rng.integers(first[r], held[r] + 1))
            flat, _ = rs.span(np.array([r]), np.array([first[r]]), np.array([nf]))
            rs.arena[flat] = -1
            for j in range(first[r], nf):
                del model[r][j]
            first[r] = nf
        elif op == 3:                             # a row leaves
            r = int(rng.choice(live))
            rs.drop(np.array([r]))
            del model[r], first[r], held[r]
        else:                                     # fork: a new row copies a live one
            src = int(rng.choice(live))
            dst = max(model) + 1
            rs.grow_rows(dst + 1)
            rs.copy_rows(np.array([src]), np.array([dst]), np.array([first[src]]), np.array([held[src]]))
            model[dst], first[dst], held[dst] = dict(model[src]), first[src], held[src]
        for r in model:
            got = rs.gather(np.array([r]), np.array([first[r]]), np.array([held[r]])).tolist()
            assert got == [model[r][j] for j in range(first[r], held[r])], (r, got)
        assert rs.live == int(rs.cap[list(model)].sum()) if model else rs.live == 0
        assert len(rs.arena) <= 4 * max(rs.live, 64) + 2 * rs.dead + 64


def test_one_long_sequence_beside_65535_short_ones_costs_what_it_holds():
    # Issue #11: the dense rows x longest-sequence table kept 2.1 GiB resident for this step.
    spec = CacheSpec((LayerSpec(1, 64),), 16)
    pool = Pool("p", plan(spec, Sizing(num_slots=8192 + 65535, max_seq_len=131072)))
    ids = np.arange(65536, dtype=np.uint64)
    tokens = np.ones(65536, dtype=np.int64)
    tokens[0] = 131072
    pool.step(admit_ids=ids, admit_tokens=tokens, tables=False)
    held_pages, rows = 8192 + 65535, 65536
    # A few words per row and per held page (~6 MB), where a dense table would take 65,536 x 8,192 x 4 = 2 GiB.
    assert pool.slot_table_bytes() < 64 * (rows + held_pages)
    assert pool.sequence_slots(0).shape == (8192,) and pool.sequence_slots(65535).shape == (1,)


def test_a_dropped_row_is_like_a_fresh_one():
    """A row handle the pool reuses after a drop: no segment, and an empty reservation costs nothing."""
    rng = np.random.default_rng(12)
    rs = RowSlots(np.dtype(np.int32), rows=8)
    rows = np.arange(5, dtype=np.int64)
    first = rng.integers(0, 3, 5)
    hi = first + rng.integers(1, 9, 5)
    rs.reserve(rows, first, hi)
    rs.drop(rows[:3])
    assert rs.start[:3].tolist() == rs.lo[:3].tolist() == rs.cap[:3].tolist() == [0, 0, 0]
    live, used = rs.live, rs.used
    rs.reserve(rows[:3], np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64))
    assert (rs.live, rs.used) == (live, used) and rs.cap[:3].tolist() == [0, 0, 0]


def test_nbytes_counts_the_arena_and_three_int64_arrays_per_row():
    rs = RowSlots(np.dtype(np.int32), rows=16)
    assert rs.nbytes() == 64 * 4 + 3 * 16 * 8                    # 64-entry arena + start, lo, cap
    rs.grow_rows(40)
    rs.reserve(np.arange(3, dtype=np.int64), np.zeros(3, dtype=np.int64), np.array([50, 2, 7]))
    assert len(rs.arena) == 2 * (100 + 4 + 14) and rs.nbytes() == 236 * 4 + 3 * 40 * 8


def test_iota_is_a_prefix_of_a_doubling_range():
    rs = RowSlots(np.dtype(np.int32))
    assert rs.iota(5).tolist() == [0, 1, 2, 3, 4]
    assert rs.iota(1024).tolist() == list(range(1024)) and len(rs._iota) == 1024    # an exact fit: no growth
    got = rs.iota(1500)
    assert got.dtype == np.int64 and got.tolist() == list(range(1500))
    assert len(rs._iota) == 2048                            # doubled: growing costs O(log n) allocations


def test_an_exact_fit_after_compaction_uses_the_arena_without_growing_it():
    rs = RowSlots(np.dtype(np.int32), rows=8)
    z = np.zeros(1, dtype=np.int64)
    for r in range(3):                                   # three segments of 16 entries: 48 of 64 used
        rs.reserve(np.array([r]), z, np.array([8]))
    rs.arena[rs.flat(np.array([2, 2]), np.array([0, 7]))] = [31, 37]
    rs.drop(np.array([0, 1]))                            # 32 dead, 16 live
    rs.reserve(np.array([3]), z, np.array([24]))          # 48 more: fits exactly once the dead are packed
    assert (rs.used, len(rs.arena), rs.dead, rs.live) == (64, 64, 0, 64)
    got = rs.gather(np.array([2, 3]), np.zeros(2, dtype=np.int64), np.array([8, 24]))
    assert got.tolist() == [31, *[-1] * 6, 37] + [-1] * 24
