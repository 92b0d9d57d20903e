"""Seed 27's core survivor: fastpaths.decode_step declines (None) only a step that would fail (its docstring), so
the steady decode loop keeps its fast path up to the pool's last free slot.

The oracle is the documented count (a sequence of n tokens holds ceil(n / page_size) pages): a decode step whose
rows gain exactly as many pages as the pool has free is served by the fast path and leaves the pool full, with the
same result as a twin pool that takes the general path (fast paths off); one slot fewer, and the fast path
declines and the general path refuses it with ResourceExhausted, nothing changed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core import fastpaths
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

PS = 4


def _pages(n: int) -> int:
    return -(-n // PS)


def _pool(slots: int, fast: bool = True) -> Pool:
    p = Pool("p", plan(CacheSpec((LayerSpec(1, 64),), PS), Sizing(num_slots=slots, max_seq_len=12 * PS)))
    p._fast = fast
    return p


@pytest.mark.parametrize("seed", range(3))
def test_the_decode_fast_path_takes_a_step_that_uses_the_last_free_slot(seed, monkeypatch):
    rng = np.random.default_rng(2750 + seed)
    b = int(rng.integers(4, 9))
    ids = list(range(1, b + 1))
    start = [int(n) for n in rng.integers(3 * PS, 6 * PS, b)]
    first = [int(k) for k in rng.integers(1, 2 * PS, b)]
    mid = [n + k for n, k in zip(start, first, strict=True)]
    last = [int(k) for k in rng.integers(1, 3 * PS, b)]
    end = [n + k for n, k in zip(mid, last, strict=True)]
    if sum(map(_pages, end)) == sum(map(_pages, mid)):
        last[0] += PS                                      # the last step gains at least one page
        end[0] += PS
    need = sum(map(_pages, end)) - sum(map(_pages, mid))
    calls: list[object] = []
    real = fastpaths.decode_step

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]
    monkeypatch.setattr(fastpaths, "decode_step", spy)
    slots = sum(map(_pages, end))
    results = []
    for fast in (True, False):
        p = _pool(slots, fast)
        p.step(admit_ids=ids, admit_tokens=start)
        p.step(extend_ids=ids, extend_tokens=first)
        assert p.allocators[0].num_free == need
        calls.clear()
        results.append(p.step(extend_ids=ids, extend_tokens=last))
        assert p.allocators[0].num_free == 0
        assert p.sequences()[1].tolist() == end
        if fast:
            assert len(calls) == 1 and calls[0] is not None and calls[0] is results[-1]   # the fast path served it
        else:
            assert calls == []
    fast_res, plain = results
    for f in ("seq_ids", "num_tokens", "new_token_indptr"):
        np.testing.assert_array_equal(getattr(fast_res, f), getattr(plain, f), err_msg=f)
    assert len(fast_res.tables) == len(plain.tables)
    for a, b_ in zip(fast_res.tables, plain.tables, strict=True):
        np.testing.assert_array_equal(a.slot_mapping, b_.slot_mapping)
        np.testing.assert_array_equal(a.table.indptr, b_.table.indptr)
        np.testing.assert_array_equal(a.table.indices, b_.table.indices)
        np.testing.assert_array_equal(a.table.last_page_len, b_.table.last_page_len)

    short = _pool(slots - 1)
    short.step(admit_ids=ids, admit_tokens=start)
    short.step(extend_ids=ids, extend_tokens=first)
    before = [a.tolist() for a in short.sequences()]
    calls.clear()
    with pytest.raises(ResourceExhausted):
        short.step(extend_ids=ids, extend_tokens=last)
    assert calls == [None]                                  # declined: the general path refused it
    assert [a.tolist() for a in short.sequences()] == before
    assert short.allocators[0].num_free == need - 1
