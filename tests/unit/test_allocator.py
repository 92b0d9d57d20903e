"""SlotAllocator against a plain-Python model (a set of free slots and a dict of refcounts)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.allocator import SlotAllocator
from kvservice.errors import InvalidArgument, ResourceExhausted


def test_allocate_free_roundtrip_values():
    a = SlotAllocator(8)
    s = a.allocate(3)
    assert sorted(s.tolist()) == [0, 1, 2] and a.num_free == 5 and a.peak_used == 3
    assert a.refcount(s).tolist() == [1, 1, 1]
    a.free(s[:2])
    assert a.num_free == 7 and a.refcount(s).tolist() == [0, 0, 1]
    a.check()


def test_exhaustion_says_needed_and_free_and_changes_nothing():
    a = SlotAllocator(4)
    a.allocate(3)
    with pytest.raises(ResourceExhausted, match="needed 2 slots, 1 free"):
        a.allocate(2)
    assert a.num_free == 1
    a.check()


@pytest.mark.parametrize("bad", [[5], [-1], [0, 0, 0]])
def test_bad_frees_are_errors_not_negative_refcounts(bad):
    a = SlotAllocator(5)
    a.allocate(2)            # slots 0, 1 held once
    before = a.refcount(np.arange(5)).tolist()
    with pytest.raises(InvalidArgument):
        a.free(np.array(bad))
    assert a.refcount(np.arange(5)).tolist() == before
    a.check()


def test_double_free():
    a = SlotAllocator(5)
    s = a.allocate(2)
    a.free(s)
    with pytest.raises(InvalidArgument, match="double free of slot"):
        a.free(s)
    assert a.num_free == 5


def test_shared_slots_need_one_free_per_owner():
    a = SlotAllocator(5)
    s = a.allocate(1)
    a._refcnt[s] += 1              # a second owner (sharing arrives with prefix caching)
    a.free(np.concatenate([s, s]))
    assert a.num_free == 5
    a.check()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_against_python_model(ops):
    a = SlotAllocator(16)
    free, held = set(range(16)), []
    for is_alloc, n in ops:
        if is_alloc:
            if n > len(free):
                with pytest.raises(ResourceExhausted):
                    a.allocate(n)
                continue
            got = a.allocate(n).tolist()
            assert set(got) <= free and len(set(got)) == n
            free -= set(got)
            held.extend(got)
        else:
            take, held = held[:n], held[n:]
            a.free(np.array(take, dtype=np.int64))
            free |= set(take)
        assert a.num_free == len(free) and set(a.free_slots().tolist()) == free
        a.check()
