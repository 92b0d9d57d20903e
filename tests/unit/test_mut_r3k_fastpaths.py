"""kvservice/core/fastpaths.py full_group_step's page count (_pages_needed) at the exact edge of the pool, for
every mix of a few (<= stepplan.FEW, summed as Python ints) and many (NumPy) extended rows and admissions.

The oracle is the documented count: a sequence of n tokens holds ceil(n / page_size) pages, so a step needs
sum(ceil(new / ps) - ceil(old / ps)) over its extended rows plus sum(ceil(n / ps)) over its admissions; a pool
with exactly that many free slots takes the step (and is then full), one with a slot fewer refuses it with the
documented ResourceExhausted and changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.stepplan import FEW

PS, MAX_LEN = 4, 64


def _pages(n: int) -> int:
    return -(-n // PS)


def _pool(slots: int) -> Pool:
    return Pool("p", plan(CacheSpec((LayerSpec(1, 64),), PS), Sizing(num_slots=slots, max_seq_len=MAX_LEN)))


@pytest.mark.parametrize("n_ext, n_adm", [(FEW + 2, 3), (3, FEW + 2), (FEW, FEW), (FEW + 1, FEW + 1), (FEW + 3, 0),
                                          (0, FEW + 3), (1, 1)])
def test_a_step_needs_exactly_the_pages_its_rows_gain(n_ext, n_adm):
    rng = np.random.default_rng(2000 + 31 * n_ext + n_adm)
    old = [int(v) for v in rng.integers(1, MAX_LEN - 20, n_ext)]
    gain = [int(v) for v in rng.integers(1, 21, n_ext)]
    adm = [int(v) for v in rng.integers(1, MAX_LEN + 1, n_adm)]
    held = sum(_pages(n) for n in old)
    need = sum(_pages(n + k) - _pages(n) for n, k in zip(old, gain, strict=True)) + sum(_pages(n) for n in adm)
    assert need > 0
    ext_ids, adm_ids = list(range(1, n_ext + 1)), list(range(100, 100 + n_adm))
    kw = {"extend_ids": ext_ids or None, "extend_tokens": gain or None, "admit_ids": adm_ids or None,
          "admit_tokens": adm or None}
    fits = _pool(held + need)
    short = _pool(held + need - 1)
    for p in (fits, short):
        if old:
            p.step(admit_ids=ext_ids, admit_tokens=old)
        p.step(admit_ids=[999], admit_tokens=[1])          # the next step is not the last batch again
        p.step(free_ids=[999])
    assert fits.allocators[0].num_free == need
    r = fits.step(**kw)
    assert fits.allocators[0].num_free == 0
    assert r.num_tokens.tolist() == [n + k for n, k in zip(old, gain, strict=True)] + adm
    before = [a.tolist() for a in short.sequences()]
    with pytest.raises(ResourceExhausted) as exc:
        short.step(**kw)
    total = held + need - 1
    assert exc.value.message == (f"pool 'p': this step needs {need} slots in layer group 0 but only {need - 1} are "
                                 f"free ({need - 1} free + 0 released by this step) of {total}; free or preempt "
                                 "sequences, or plan a bigger pool")
    assert exc.value.metadata == {"needed": str(need), "free": str(need - 1), "num_slots": str(total), "group": "0"}
    assert short.allocators[0].num_free == need - 1                  # nothing changed
    assert [a.tolist() for a in short.sequences()] == before
