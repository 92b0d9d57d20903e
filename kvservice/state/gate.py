"""PoolGate: reads of a pool wait only for an uncommitted change of that pool, never for others or a snapshot."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class PoolGate:
    """Readers of a pool wait while a change of that pool is applied but not yet committed.

    Writers (serialised by the journal lock) claim a pool, then wait for its readers to finish;
    readers of other pools never wait. A read of every pool ("") waits for any claimed pool.
    """

    ALL = "\0all"

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._busy: str | None = None
        self._readers: Counter[str] = Counter()

    def writing(self, pool: str | None) -> _Writing:
        """Around a change of `pool` (None: a change that touches no pool's state): its readers wait till it
        ends (a context manager)."""
        return _Writing(self, pool)

    def _claim(self, pool: str) -> None:
        with self._cv:
            self._busy = pool
            if self._readers[pool] or self._readers[self.ALL]:
                self._cv.wait_for(lambda: not self._readers[pool] and not self._readers[self.ALL])

    def _release(self) -> None:
        with self._cv:
            self._busy = None
            self._cv.notify_all()

    @contextmanager
    def reading(self, pool: str) -> Iterator[None]:
        key = pool or self.ALL
        with self._cv:
            self._cv.wait_for(lambda: self._busy is None or (key != self.ALL and self._busy != key))
            self._readers[key] += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers[key] -= 1
                if not self._readers[key]:
                    self._cv.notify_all()


class _Writing:
    """PoolGate.writing's context manager (a class: a generator-based one costs a decode step ~0.5%)."""

    __slots__ = ("gate", "pool")

    def __init__(self, gate: PoolGate, pool: str | None) -> None:
        self.gate, self.pool = gate, pool

    def __enter__(self) -> None:
        if self.pool is not None:
            self.gate._claim(self.pool)

    def __exit__(self, kind: object, err: object, tb: object) -> bool:
        if self.pool is not None:
            self.gate._release()
        return False
