"""Worker registry: who holds which layers of which pool, under a lease with an epoch.

A worker registers (getting epoch e+1 for its id) and then heartbeats with that
epoch. A lease that lapses marks the worker dead; its later heartbeats are
refused until it registers again, which bumps the epoch, so a stale process can
never pass for the new one.

Fencing between tenants and pool incarnations: a worker_id belongs to the pool, and the
token (``owner``), that first registered it. Registering it into another pool is refused
for as long as the record exists (records of a pool go when the pool is deleted); another
token may take it over only once its lease lapsed. Each record keeps the pool incarnation
it registered under (BlockManager checks it against the pool's current one). Errors name
only the pool the caller named, never the pool a worker_id belongs to.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")     # fullmatch: `$` would also accept a trailing newline
BACKENDS = ("cuda", "cpu")


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    pool: str
    layer_begin: int
    layer_end: int                 # one past the last layer
    tp_rank: int
    tp_size: int
    backend: str
    device_name: str
    device_memory_bytes: int
    address: str
    epoch: int
    last_heartbeat: float          # clock() seconds
    alive: bool = True
    incarnation: int = 0           # incarnation of the pool it registered with (BlockManager.incarnation)
    owner: str = ""                # name of the token that registered it ("" without tokens)


class WorkerRegistry:
    """Thread-safe. lease_seconds: a worker silent this long is marked dead."""

    def __init__(self, lease_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_seconds <= 0:
            raise InvalidArgument(f"lease_seconds must be > 0, got {lease_seconds}")
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._lock = threading.Lock()

    def register(self, worker_id: str, pool: str, num_layers: int, layer_begin: int = 0, layer_end: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, backend: str = "cpu", device_name: str = "",
                 device_memory_bytes: int = 0, address: str = "", incarnation: int = 0, owner: str = "",
                 enforce: bool = True) -> WorkerRecord:
        """Add or re-add a worker of a pool with num_layers layers; returns its record with a new epoch.

        incarnation: the pool's current incarnation (stored in the record). owner: the registering
        token's name. enforce: refuse (AlreadyExists, reason WORKER_ID_TAKEN) a worker_id registered
        to another pool, or to another token while its lease holds; False when a journal replays a
        registration that was accepted before.
        """
        if not _ID.fullmatch(worker_id):
            raise InvalidArgument(f"worker_id {worker_id!r} must match [A-Za-z0-9_.:-]{{1,128}}")
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        layer_end = layer_end or num_layers
        if not 0 <= layer_begin < layer_end <= num_layers:
            raise InvalidArgument(f"layers [{layer_begin}, {layer_end}) are not inside pool {pool!r}'s "
                                  f"[0, {num_layers})")
        tp_size = tp_size or 1
        if tp_rank >= tp_size:
            raise InvalidArgument(f"tp_rank {tp_rank} must be < tp_size {tp_size}")
        with self._lock:
            self._sweep()
            old = self._workers.get(worker_id)
            if enforce and old is not None and (old.pool != pool or (old.owner != owner and old.alive)):
                whose = "another pool" if old.pool != pool else "another token, and its lease has not lapsed"
                raise AlreadyExists(f"worker_id {worker_id!r} is registered to {whose}; a worker_id belongs to the "
                                    "pool and token that first registered it: choose another worker_id",
                                    reason="WORKER_ID_TAKEN", worker_id=worker_id)
            rec = WorkerRecord(worker_id, pool, layer_begin, layer_end, tp_rank, tp_size, backend, device_name,
                               device_memory_bytes, address, (old.epoch if old else 0) + 1, self._clock(),
                               incarnation=incarnation, owner=owner)
            self._workers[worker_id] = rec
            return rec

    def heartbeat(self, worker_id: str, epoch: int, pool: str = "", incarnation: int = 0) -> None:
        """Renew a lease; FailedPrecondition if the epoch or incarnation is stale or the lease lapsed.

        pool: the pool the caller says the worker belongs to ("" = not checked); a worker_id of
        another pool is NotFound, as if unknown. incarnation: the pool's current incarnation
        (0 = not checked); a record registered under another one is told to register again.
        """
        with self._lock:
            self._sweep()
            rec = self._workers.get(worker_id)
            if rec is None or (pool and rec.pool != pool):
                where = f" in pool {pool!r}" if pool else ""
                raise NotFound(f"worker {worker_id!r} is not registered{where}; register first",
                               worker_id=worker_id)
            if epoch != rec.epoch:
                raise FailedPrecondition(
                    f"worker {worker_id!r} heartbeat with epoch {epoch}, current epoch is {rec.epoch}: "
                    "another registration replaced this one", reason="STALE_EPOCH", worker_id=worker_id)
            if incarnation and rec.incarnation != incarnation:
                raise FailedPrecondition(
                    f"worker {worker_id!r} registered with pool {rec.pool!r} incarnation {rec.incarnation}; the pool "
                    f"is now incarnation {incarnation}: fetch the pool, re-plan memory and register again",
                    reason="STALE_INCARNATION", worker_id=worker_id, incarnation=incarnation)
            if not rec.alive:
                raise FailedPrecondition(
                    f"worker {worker_id!r} missed its lease of {self.lease_seconds:g} s and was marked dead; "
                    "register again", reason="LEASE_EXPIRED", worker_id=worker_id)
            self._workers[worker_id] = replace(rec, last_heartbeat=self._clock())

    def drop_pool(self, pool: str) -> list[str]:
        """Forget every worker of a pool (it was deleted); returns their ids. Their worker_ids become free."""
        with self._lock:
            gone = sorted(w for w, rec in self._workers.items() if rec.pool == pool)
            for wid in gone:
                del self._workers[wid]
            return gone

    def workers(self, pool: str = "") -> list[WorkerRecord]:
        """Records (dead ones included), sorted by id, after marking lapsed leases dead."""
        with self._lock:
            self._sweep()
            return sorted((w for w in self._workers.values() if not pool or w.pool == pool),
                          key=lambda w: w.worker_id)

    def seconds_since_heartbeat(self, rec: WorkerRecord) -> float:
        return self._clock() - rec.last_heartbeat

    def _sweep(self) -> None:
        now = self._clock()
        for wid, rec in self._workers.items():
            if rec.alive and now - rec.last_heartbeat > self.lease_seconds:
                self._workers[wid] = replace(rec, alive=False)

    # ---- recovery (kvservice/state/journal.py) ----------------------------------------------------------------
    def restore(self, records: list[WorkerRecord]) -> None:
        """Replace every record with recovered ones: epochs and alive flags kept, each lease restarted now."""
        with self._lock:
            now = self._clock()
            self._workers = {r.worker_id: replace(r, last_heartbeat=now) for r in records}
