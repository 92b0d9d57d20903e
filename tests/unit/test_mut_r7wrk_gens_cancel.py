"""Two small contracts of the worker's kernel wrappers, pinned whole: check_generations
(kvservice/worker/generations.py: both or neither, what each array is checked against, the names and documented
shapes it hands check_array, its answer) and pointers; and a kernel call's bound reaching its deadline on a
hand-moved clock (kvservice/worker/cancel.py: the kernel stops AT the deadline), and a thread without a bound."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from kvservice.worker import cancel
from kvservice.worker.generations import NULL, check_generations, pointers
from kvservice.worker.kernel_api import check_array
from tests.clocks import ManualClock


class Recorder:
    """A stand-in for kernel_api.check_array that records every call's (name, array, shape, dtype, doc)."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, name, a, shape, dtype, doc):
        self.calls.append((name, a, tuple(shape), dtype, doc))


PAGES_DOC = "[num_pages] (one per page of the layer)"


def test_neither_array_checks_nothing_and_says_so():
    rec = Recorder()
    assert check_generations("generations", None, 5, None, 9, "[nnz]", rec) is False
    assert rec.calls == []


@pytest.mark.parametrize("which", ["gens", "record"])
def test_one_array_without_the_other_is_refused_by_name(which):
    """gens without the record, or the record without gens: ValueError naming the table's argument."""
    g = np.zeros(3, np.uint32)
    rec = Recorder()
    with pytest.raises(ValueError) as e:
        check_generations("slot_generations", g if which == "gens" else None, 3,
                          None if which == "gens" else g, 3, "[n]", rec)
    assert str(e.value) == "slot_generations and the page generation record go together: give both or neither"
    assert rec.calls == []


def test_one_record_is_checked_as_page_gen_and_a_sequence_by_its_place():
    """gens is checked as uint32 of shape (n,) (an int) or n (a tuple) with the caller's doc; one record as
    "page_gen", a sequence of records as "page_gen[i]", each uint32 [num_pages] with the documented words. True."""
    rng = np.random.default_rng()
    n, pages = int(rng.integers(1, 50)), int(rng.integers(1, 500))
    g, pg = np.zeros(n, np.uint32), np.zeros(pages, np.uint32)
    rec = Recorder()
    assert check_generations("generations", g, n, pg, pages, "[nnz]", rec) is True
    assert rec.calls == [("generations", g, (n,), np.uint32, "[nnz]"),
                         ("page_gen", pg, (pages,), np.uint32, PAGES_DOC)]
    g2 = np.zeros((n, 2), np.uint32)
    pgs = [np.zeros(pages, np.uint32) for _ in range(3)]
    rec = Recorder()
    assert check_generations("generations", g2, (n, 2), pgs, pages, "[n, 2]", rec) is True
    assert rec.calls == [("generations", g2, (n, 2), np.uint32, "[n, 2]")] + \
        [(f"page_gen[{i}]", pgs[i], (pages,), np.uint32, PAGES_DOC) for i in range(3)]


def test_with_the_real_check_array_the_errors_name_the_argument_and_its_shape():
    """Through kernel_api.check_array: a record of the wrong length, dtype, or the third of a sequence, each named."""
    g = np.zeros(4, np.uint32)
    with pytest.raises(ValueError) as e:
        check_generations("generations", g, 4, np.zeros(6, np.uint32), 7, "[nnz]", check_array)
    assert str(e.value) == f"page_gen: expected shape {PAGES_DOC} = (7,), got (6,)"
    with pytest.raises(TypeError) as e:
        check_generations("generations", g, 4, np.zeros(7, np.int32), 7, "[nnz]", check_array)
    assert str(e.value) == "page_gen: expected dtype uint32, got int32"
    with pytest.raises(ValueError) as e:
        check_generations("generations", np.zeros((2, 2), np.uint32), (2, 2),
                          [np.zeros(7, np.uint32)] * 2 + [np.zeros(8, np.uint32)], 7, "[n, 2]", check_array)
    assert str(e.value) == f"page_gen[2]: expected shape {PAGES_DOC} = (7,), got (8,)"
    with pytest.raises(TypeError) as e:
        check_generations("slot_generations", np.zeros(4, np.int64), 4, np.zeros(7, np.uint32), 7, "[n]",
                          check_array)
    assert str(e.value) == "slot_generations: expected dtype uint32, got int64"


def test_pointers_are_the_arrays_or_null():
    a, b = np.zeros(2, np.uint32), np.ones(3, np.uint32)
    got = pointers(a, None, b, None)
    assert got[0] is a and got[2] is b and got[1] is NULL and got[3] is NULL and len(got) == 4
    assert NULL == 0 and NULL.dtype == np.uint64


def test_a_bound_expires_at_its_deadline_not_after_it(monkeypatch):
    """CallBound.expired on a hand-moved monotonic clock: not before the deadline, yes AT it and after; a bound
    without a deadline never expires by time; cancel() expires any bound."""
    clock = ManualClock(1000.0)
    monkeypatch.setattr(cancel, "time", types.SimpleNamespace(monotonic=clock))
    b = cancel.CallBound(1005.0)
    clock.now = 1004.999
    assert not b.expired()
    clock.now = 1005.0
    assert b.expired()
    clock.now = 1e9
    assert b.expired() and not cancel.CallBound().expired()
    with cancel.bounded(1005.0):
        clock.now = 1005.0
        with pytest.raises(cancel.KernelCancelled) as e:
            cancel.check("kv_append")
        assert str(e.value) == "kv_append: stopped, the call's deadline passed or its caller went away"
    late = cancel.CallBound(2e9)
    late.cancel()
    assert late.expired() and late.flag.value == 1


def test_a_thread_that_never_set_a_bound_has_none_and_runs_on():
    """A fresh thread (no bounded() ever entered in it): current() is None and check() never stops its kernels; a
    bound set in another thread is not seen."""

    seen = []

    def run():
        seen.append(cancel.current())
        cancel.check("kv_decode")
        seen.append("ran")

    with cancel.bounded(0.0):                      # this thread's bound: long expired
        t = threading.Thread(target=run)
        t.start()
        t.join(30)
    assert seen == [None, "ran"]
