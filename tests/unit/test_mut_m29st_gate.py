"""PoolGate from the writer's side (kvservice/state/gate.py; docs/DURABILITY.md: reads wait only for an uncommitted
change of their own pool): a writer claiming a pool waits for the readers of that pool and of every pool ("")
already inside, never for another pool's; a change that touches no pool (None) waits for nobody and holds
nobody. Ordering is observed with events; a short wait is only used to see that something did NOT happen yet
(it cannot fail on a correct gate), and generous limits only bound a hang.
"""

from __future__ import annotations

import threading

from kvservice.state.gate import PoolGate

HANG = 60.0
NOT_YET = 0.2


class Reader:
    """A thread inside gate.reading(pool) until released."""

    def __init__(self, gate: PoolGate, pool: str) -> None:
        self.inside, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

        def run() -> None:
            with gate.reading(pool):
                self.inside.set()
                self.release.wait(HANG)
            self.done.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.inside.wait(HANG)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(HANG)
        assert self.done.is_set()


class Writer:
    """A thread that enters gate.writing(pool), says so, and leaves when released."""

    def __init__(self, gate: PoolGate, pool: str | None) -> None:
        self.inside, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

        def run() -> None:
            with gate.writing(pool):
                self.inside.set()
                self.release.wait(HANG)
            self.done.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.release.set()
        self.thread.join(HANG)
        assert self.done.is_set()


def test_a_writer_waits_for_the_readers_of_its_pool_already_inside():
    for inside in ("p", ""):                               # a reader of the pool, a reader of every pool
        gate = PoolGate()
        r = Reader(gate, inside)
        w = Writer(gate, "p")
        assert not w.inside.wait(NOT_YET)                   # held while the reader is inside
        r.finish()
        assert w.inside.wait(HANG)                          # the last reader out lets it in
        w.finish()


def test_a_writer_does_not_wait_for_another_pools_reader_and_blocks_only_its_own():
    gate = PoolGate()
    r = Reader(gate, "q")
    w = Writer(gate, "p")
    assert w.inside.wait(HANG)                              # the reader of q is no obstacle
    other = Reader(gate, "q")                               # a new reader of q enters while p is claimed
    mine = threading.Event()

    def read_p() -> None:
        with gate.reading("p"):
            mine.set()
    t = threading.Thread(target=read_p, daemon=True)
    t.start()
    assert not mine.wait(NOT_YET)
    w.finish()
    t.join(HANG)
    assert mine.is_set()
    r.finish()
    other.finish()


def test_a_change_that_touches_no_pool_waits_for_nobody_and_holds_nobody():
    gate = PoolGate()
    everyone = Reader(gate, "")
    p = Reader(gate, "p")
    w = Writer(gate, None)
    assert w.inside.wait(HANG)                              # not held by the readers inside
    late = Reader(gate, "")                                 # nor does it hold a reader coming in
    late_p = Reader(gate, "p")
    for r in (everyone, p, late, late_p):
        r.finish()
    w.finish()
    again = Writer(gate, "p")                               # and it left no claim behind
    assert again.inside.wait(HANG)
    again.finish()
    Reader(gate, "p").finish()
