"""kernel_api's duplicate checks on DEVICE arrays (CuPy's: no implicit conversion to NumPy, a host copy only through
get()), with a stand-in array type that counts its get() calls: a refused slot mapping or copy reads back exactly
what names the offending value (the sorted slots, the sorted destinations, the pairs), once, and names it with the
same whole message as on the host; a clean call reads nothing back."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from kvservice.worker import kernel_api as api


class Dev(np.ndarray):
    """A NumPy array standing for a device array: get() returns a host copy and is counted (Dev.gets)."""

    gets: ClassVar[list[str]] = []

    def get(self) -> np.ndarray:
        Dev.gets.append("get")
        return np.array(self.view(np.ndarray), copy=True)


def dev(values, dtype=np.int64) -> Dev:
    return np.asarray(values, dtype=dtype).view(Dev)


@pytest.fixture(autouse=True)
def _no_gets_yet():
    Dev.gets.clear()
    yield
    Dev.gets.clear()


def test_a_repeated_slot_on_the_device_is_read_back_once_and_named():
    rng = np.random.default_rng()
    slots = rng.choice(10**6, 6, replace=False)
    api.check_distinct_slots(np, dev([*slots, -1, -1]))
    assert Dev.gets == []
    twice = int(slots[3])
    sm = rng.permutation([*slots, twice, -1, -1])
    with pytest.raises(ValueError) as e:
        api.check_distinct_slots(np, dev(sm))
    assert str(e.value) == (f"slot_mapping: slot {twice} appears more than once; every token needs its own slot "
                            "(duplicate writes are unordered on a GPU), nothing was written")
    assert Dev.gets == ["get"]


def test_a_repeated_destination_on_the_device_is_read_back_once_and_named():
    api.check_copy_pairs(np, dev([[1, 2], [1, 3], [4, 5]]))
    assert Dev.gets == []
    with pytest.raises(ValueError) as e:
        api.check_copy_pairs(np, dev([[9, 12], [1, 30], [2, 12], [6, 8]]), "slot")
    assert str(e.value) == ("pairs: destination slot 12 appears more than once; destinations must be distinct, "
                            "nothing was copied")
    assert Dev.gets == ["get"]


def test_a_page_both_source_and_destination_on_the_device_is_read_back_once_and_named():
    """The first pair (in the caller's order) whose source is also some pair's destination is named."""
    with pytest.raises(ValueError) as e:
        api.check_copy_pairs(np, dev([[3, 4], [7, 6], [5, 9], [9, 7]]))
    assert str(e.value) == "pairs: page 7 is both a source and a destination; copy in two calls, nothing was copied"
    assert Dev.gets == ["get"]
