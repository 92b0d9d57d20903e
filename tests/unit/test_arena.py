"""core/arena.zeroed: large stores on their own mapping, without NumPy's huge-page advice."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest

from kvservice.core.arena import MAPPED_BYTES, zeroed


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding addr, from /proc/self/smaps (None where there is no such file)."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.int64), ((MAPPED_BYTES // 8 + 7,), np.uint64),
                                         ((1031, 512), np.int64), ((0, 512), np.int64), ((2, 3, 4), np.int32)])
def test_zeroed_is_an_ordinary_writable_array_of_zeros(shape, dtype):
    rng = np.random.default_rng(7)
    a = zeroed(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    if a.size:
        vals = rng.integers(1, 1 << 30, size=a.shape).astype(dtype)
        a[...] = vals
        assert (a == vals).all()
        b = pickle.loads(pickle.dumps(a))          # snapshots copy and serialize these arrays
        assert (b == vals).all() and b.dtype == a.dtype and b.shape == a.shape
        c = a[1:].copy()
        c[...] = 0
        assert (a == vals).all()                   # a copy is independent of the store


def test_large_stores_are_mapped_small_ones_are_not():
    small = zeroed((MAPPED_BYTES // 8 - 1,), np.int64)
    large = zeroed((MAPPED_BYTES // 8,), np.int64)
    assert small.base is None or not isinstance(small.base, memoryview)
    owner = large
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    assert not isinstance(owner, np.ndarray)       # the memory belongs to the mapping, not to NumPy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_large_stores_carry_no_huge_page_advice():
    """The point of the module: NumPy advises MADV_HUGEPAGE ("hg" in smaps) on arrays of 4 MiB or more; the
    store leaves the choice to the host's setting (no "hg"), so a host that cannot grant huge pages does not pay
    a failed attempt on every first write."""
    a = zeroed((2048, 512), np.int64)              # 8 MiB
    a[1000, 0] = 1                                 # commit a page in the middle (NumPy advises from the first
    flags = _vm_flags(a[1000].ctypes.data)         # 4 KiB boundary on, so the head may sit in another mapping)
    if flags is None:
        pytest.skip("no VmFlags for this mapping")
    assert "hg" not in flags and "wr" in flags
    ref = np.zeros((2048, 512), dtype=np.int64)
    ref[1000, 0] = 1
    ref_flags = _vm_flags(ref[1000].ctypes.data)
    if ref_flags is not None and "hg" not in ref_flags:
        pytest.skip("this NumPy does not advise huge pages here (NUMPY_MADVISE_HUGEPAGE=0 or an old kernel)")
    assert "hg" in ref_flags                       # the contrast: np.zeros of the same size is advised


def test_negative_dimension_is_refused_by_name():
    with pytest.raises(ValueError, match="negative dimension -1"):
        zeroed((4, -1), np.int64)
