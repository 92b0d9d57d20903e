"""WorkerRegistry.restore (the journal's recovery hook): every record replaced by the recovered ones, each field
kept as recovered except the lease, which restarts at the registry's clock now."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import FailedPrecondition, NotFound
from kvservice.manager.workers import WorkerRecord, WorkerRegistry
from tests.clocks import ManualClock


def _record(wid, pool, epoch, heartbeat, alive, **kw):
    return WorkerRecord(wid, pool, kw.get("begin", 0), kw.get("end", 4), kw.get("rank", 0), kw.get("size", 1), "cpu",
                        kw.get("device", ""), kw.get("mem", 0), kw.get("address", ""), epoch, heartbeat, alive,
                        kw.get("incarnation", 0), kw.get("owner", ""))


def test_restore_replaces_every_record_keeps_its_fields_and_restarts_each_lease():
    """Recovered records replace the registry's (an old one not among them is gone); epochs, alive flags and every
    other field are kept; last_heartbeat is the clock at restore, so an alive worker's lease runs lease_seconds
    from then, and a dead one stays dead."""
    clock = ManualClock(1000.0)
    reg = WorkerRegistry(lease_seconds=5, clock=clock)
    reg.register("old", "p", 8)
    a = _record("w-a", "p", 7, 3.0, True, begin=2, end=6, rank=1, size=2, device="H200", mem=123_456,
                address="127.0.0.1:7001", incarnation=991, owner="tok")
    b = _record("w-b", "q", 3, 999.0, False, end=8, incarnation=5)
    clock.now = 2000.0
    reg.restore([b, a])
    got = reg.workers()
    assert got == [
        WorkerRecord("w-a", "p", 2, 6, 1, 2, "cpu", "H200", 123_456, "127.0.0.1:7001", 7, 2000.0, True, 991, "tok"),
        WorkerRecord("w-b", "q", 0, 8, 0, 1, "cpu", "", 0, "", 3, 2000.0, False, 5, ""),
    ]
    assert reg.seconds_since_heartbeat(got[0]) == 0.0
    with pytest.raises(NotFound):
        reg.heartbeat("old", 1)
    clock.now = 2005.0
    reg.heartbeat("w-a", 7, pool="p", incarnation=991)     # the lease restarted at restore: 5 s, not yet lapsed
    with pytest.raises(FailedPrecondition) as exc:
        reg.heartbeat("w-b", 3)
    assert exc.value.reason == "LEASE_EXPIRED"
    clock.now = 2010.5
    assert [w.alive for w in reg.workers()] == [False, False]   # w-a silent 5.5 s since its last heartbeat


def test_restore_with_no_records_empties_the_registry():
    """Restoring an empty list leaves no worker."""
    reg = WorkerRegistry(lease_seconds=5, clock=ManualClock(1.0))
    reg.register("w", "p", 4)
    reg.restore([])
    assert reg.workers() == []
