"""PoolGate's rule (kvservice/state/gate.py): a read waits only while a change of its own pool is claimed; a read of
every pool ("") waits for any claimed pool; nothing waits on a fresh gate. Progress is observed through events,
with generous join limits that only bound a hang (no timing is asserted)."""

from __future__ import annotations

import threading

from kvservice.state.gate import PoolGate

HANG = 60.0          # seconds before a thread that should have finished counts as hung


def _read_in_thread(gate: PoolGate, pool: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        with gate.reading(pool):
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_nothing_waits_on_a_fresh_gate():
    gate = PoolGate()
    for pool in ("p", ""):
        t, done = _read_in_thread(gate, pool)
        t.join(HANG)
        assert done.is_set(), f"a read of {pool!r} waited on a gate nobody writes"


def test_a_claimed_pool_holds_its_own_and_the_all_pools_reads_only():
    gate = PoolGate()
    release = threading.Event()
    claimed = threading.Event()

    def write() -> None:
        with gate.writing("p"):
            claimed.set()
            release.wait(HANG)

    w = threading.Thread(target=write, daemon=True)
    w.start()
    assert claimed.wait(HANG)
    other, other_done = _read_in_thread(gate, "q")
    other.join(HANG)
    assert other_done.is_set()                              # another pool's read does not wait
    mine, mine_done = _read_in_thread(gate, "p")
    every, every_done = _read_in_thread(gate, "")
    assert not mine_done.wait(0.2) and not every_done.is_set()     # both still held while "p" is claimed
    release.set()
    for t in (w, mine, every):
        t.join(HANG)
    assert mine_done.is_set() and every_done.is_set()
