"""Snapshots of the journal: captured under its lock (the pause), encoded and written outside it.

``JournalSnapshots`` is a part of :class:`kvservice.state.journal.Journal` (a base class holding the snapshot
side of it; the state it works on is the journal's: its lock, position, store, manager and idempotency
window). A capture copies what a snapshot holds while every call waits (pools unchanged since the last
snapshot reuse its arrays, so an idle pool costs no pause); the copy is encoded
(kvservice/state/snapshot.py) and written to the store outside the lock, on the snapshot thread or the
caller's, while calls go on. The tail is bounded: with compact_every entries past the newest stored snapshot
and one being written, a call waits for it (``_tail_full``). A failed write keeps serving (the entries are
still in the store) and tries again sooner. See docs/DURABILITY.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvservice.core.pool_state import PoolState
from kvservice.manager.pools import BlockManager
from kvservice.state import snapshot as snap
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal_config import METHODS, JournalConfig
from kvservice.state.stores import JournalStore

log = logging.getLogger("kvservice.state.journal")


@dataclass(slots=True)
class Capture:
    """What a snapshot holds, copied under the journal lock (encoded and written outside it)."""

    seq: int
    appended: int
    pools: dict[str, Any]          # name -> PoolState (a pool unchanged since the last snapshot) or its finisher
    dirty: set[str]                # pools exported anew (the rest reuse the last snapshot's arrays)
    workers: list
    window_ids: list
    window_replies: list
    pause: float


class JournalSnapshots:
    """The snapshot side of the journal (a base class of Journal, which sets every attribute named here)."""

    manager: BlockManager
    store: JournalStore
    config: JournalConfig
    window: IdempotencyWindow
    seq: int
    snapshot_seq: int
    incarnation: int
    failed: str | None
    snapshots: int
    snapshot_pause_seconds: float
    snapshot_pause_max_seconds: float
    snapshot_seconds: float
    snapshot_bytes: int
    _lock: threading.Lock
    _writer_done: threading.Event
    _appended: int
    _snap_appended: int
    _compact_at: int
    _states: dict[str, Any]
    _dirty: set[str]
    _check_usable: Callable[[], None]          # raises once the journal failed

    def _tail_full(self) -> bool:
        """compact_every is the most entries a recovery replays, a bound: with that many past the newest stored
        snapshot and one being written, nothing more is appended until it is stored (a store slower than the
        tail's last quarter; a leader killed meanwhile leaves no longer a tail to its successor)."""
        return not self._writer_done.is_set() and self.seq - self.snapshot_seq >= self.config.compact_every


    @property
    def tail_bytes(self) -> int:
        """Request bytes journaled since the newest snapshot was captured."""
        return self._appended - self._snap_appended

    def _due(self) -> bool:
        return self._writer_done.is_set() and (self.seq >= self._compact_at
                                               or self.tail_bytes >= self.config.compact_bytes)

    def snapshot(self, force: bool = False) -> None:
        """Write a snapshot now (also done every compact_every entries and on a clean close); force: even if one
        exists at this position (a new lineage starts with one of its own)."""
        cap = self._capture_when_idle(check=True, force=force)
        if cap is not None:
            self._write_capture(cap)

    def _capture_when_idle(self, check: bool, force: bool = False) -> Capture | None:
        while True:
            self._writer_done.wait()
            with self._lock:
                if check:
                    self._check_usable()
                elif self.failed is not None:
                    return None
                if self._writer_done.is_set():
                    return self._capture_locked(force)

    def _capture_locked(self, force: bool = False) -> Capture | None:
        """Copy what a snapshot holds (journal lock held: this is the pause every call waits for).

        None if there is nothing new to snapshot (or a snapshot is being written). Otherwise the
        caller must pass the capture to _write_capture, outside the lock.
        """
        if not self._writer_done.is_set() or (not force and (self.store.readonly or self.seq == self.snapshot_seq)):
            return None
        t0 = time.perf_counter()
        pools: dict[str, Any] = {}
        dirty = set()
        for name in self.manager.pool_names():
            with self.manager.locked(name) as pool:
                old = self._states.get(name)
                if old is not None and name not in self._dirty:     # refusals still move two counters
                    pools[name] = PoolState(dict(old.meta, refused=int(pool.refused),
                                                 alloc_failures=dict(pool.alloc_failures)), old.arrays)
                else:
                    pools[name] = pool.capture_state()
                    dirty.add(name)
        self._dirty = set()
        ids, replies = self.window.capture()
        pause = time.perf_counter() - t0
        self.snapshot_pause_seconds = pause
        self.snapshot_pause_max_seconds = max(self.snapshot_pause_max_seconds, pause)
        self._compact_at = self.seq + self.config.snapshot_due_tail
        self._writer_done.clear()
        return Capture(self.seq, self._appended, pools, dirty, self.manager.workers.workers(), ids, replies, pause)

    def _write_capture(self, cap: Capture) -> None:
        """Encode and store a captured snapshot (no journal lock: calls go on meanwhile)."""
        t0 = time.perf_counter()
        try:
            states = {name: st if isinstance(st, PoolState) else st(runs=True) for name, st in cap.pools.items()}
            window = snap.WindowState(cap.window_ids, [(rid, m, msg.SerializeToString())
                                                       for rid, m, msg in cap.window_replies])
            enc = snap.encode(cap.seq, self.incarnation, time.time(), states, cap.workers, window, METHODS,
                              self.store.lineage)
            self.store.write_snapshot(cap.seq, enc)
        except Exception as err:          # the entries are still there: keep serving, try again later
            log.error("snapshot at %d failed (%s: %s); recovery replays the longer tail", cap.seq,
                      type(err).__name__, err)
            with self._lock:
                self._compact_at = self.seq + max(1, self.config.compact_every // 2)
                self._dirty |= cap.dirty
        else:
            with self._lock:
                self._states = states
                self.snapshot_seq = max(self.snapshot_seq, cap.seq)
                self._snap_appended = cap.appended
                self.snapshots += 1
                self.snapshot_seconds, self.snapshot_bytes = time.perf_counter() - t0, enc.nbytes
            log.info("snapshot at journal position %d: %d bytes; pause %.1f ms, encode + write %.1f ms", cap.seq,
                     enc.nbytes, 1e3 * cap.pause, 1e3 * self.snapshot_seconds)
        finally:
            self._writer_done.set()

    def snapshot_to(self, store: JournalStore) -> None:
        """Write this journal's state as a snapshot at its position into another store (any backend).

        Backups and moves between backends (kvservice export-state / import-state, docs/HA.md). The
        target must accept writes (begun); this journal's own store is not written.
        """
        self._writer_done.wait()
        with self._lock:
            ids, replies = self.window.capture()
            states: dict[str, Any] = {}
            for name in self.manager.pool_names():
                with self.manager.locked(name) as pool:
                    states[name] = pool.capture_state()
            workers, seq = self.manager.workers.workers(), self.seq
        states = {name: st if isinstance(st, PoolState) else st(runs=True) for name, st in states.items()}
        window = snap.WindowState(ids, [(rid, m, msg.SerializeToString()) for rid, m, msg in replies])
        store.write_snapshot(seq, snap.encode(seq, store.incarnation, time.time(), states, workers, window, METHODS,
                                              self.store.lineage))

    def wait_for_snapshot(self, timeout: float | None = None) -> bool:
        """Wait for a snapshot being written on the snapshot thread; False if still running after timeout."""
        return self._writer_done.wait(timeout)


__all__ = ["Capture", "JournalSnapshots"]
