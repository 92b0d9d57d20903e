"""BlockManager: the named pools of one manager process, each behind its own lock."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from .geometry import CacheSpec
from .planner import Plan, Sizing, plan
from .pool import Pool
from .workers import WorkerRecord, WorkerRegistry

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class BlockManager:
    """Creates, finds and deletes pools; every call on a pool runs under that pool's lock."""

    def __init__(self, lease_seconds: float = 10.0) -> None:
        self.workers = WorkerRegistry(lease_seconds)
        self._pools: dict[str, Pool] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                    prefix_caching: bool = False) -> Pool:
        """Plan and create a pool; AlreadyExists if the name is taken."""
        if not _NAME.match(name):
            raise InvalidArgument(f"pool name {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
        planned: Plan = plan(spec, sizing, backends)
        with self._lock:
            if name in self._pools:
                raise AlreadyExists(f"pool {name!r} already exists", pool=name)
            pool = Pool(name, planned, prefix_caching)
            self._pools[name] = pool
            self._locks[name] = threading.Lock()
            return pool

    def delete_pool(self, name: str, force: bool = False) -> None:
        """Drop a pool; FailedPrecondition while sequences are live, unless force."""
        with self._lock:
            pool = self._get(name)
            if pool.num_sequences and not force:
                raise FailedPrecondition(
                    f"pool {name!r} still holds {pool.num_sequences} sequences; free them or pass force",
                    pool=name, sequences=pool.num_sequences)
            del self._pools[name]
            del self._locks[name]

    def register_worker(self, worker_id: str, pool: str, **fields: object) -> WorkerRecord:
        """Register a worker of an existing pool (see WorkerRegistry.register for fields)."""
        with self._lock:
            num_layers = len(self._get(pool).plan.geometry.layers)
        return self.workers.register(worker_id, pool, num_layers, **fields)  # type: ignore[arg-type]

    def restore(self, pools: dict[str, Pool], workers: list[WorkerRecord] | None = None) -> None:
        """Replace every pool (and, if given, every worker record) with recovered ones: the journal's hook.

        Each pool gets a fresh lock. A caller still holding an old pool keeps its old object.
        """
        with self._lock:
            self._pools = dict(pools)
            self._locks = {name: threading.Lock() for name in pools}
        if workers is not None:
            self.workers.restore(workers)

    def pool_names(self) -> list[str]:
        with self._lock:
            return sorted(self._pools)

    def pool_and_lock(self, name: str) -> tuple[Pool, threading.Lock]:
        """A pool and its lock (hot path; `locked` is the convenient form)."""
        with self._lock:
            return self._get(name), self._locks[name]

    @contextmanager
    def locked(self, name: str) -> Iterator[Pool]:
        """Hold a pool's lock while using it: `with manager.locked("p") as pool: pool.step(...)`."""
        with self._lock:
            pool = self._get(name)
            lock = self._locks[name]
        with lock:
            yield pool

    def _get(self, name: str) -> Pool:
        pool = self._pools.get(name)
        if pool is None:
            known = ", ".join(sorted(self._pools)) or "none"
            raise NotFound(f"pool {name!r} does not exist (pools: {known})", pool=name)
        return pool
