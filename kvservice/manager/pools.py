"""BlockManager: the named pools of one manager process, each behind its own lock.

Every pool has an *incarnation*: a 63-bit id, new each time a pool of that name is created.
Workers register with the incarnation they planned their memory from and heartbeat with it;
a pool deleted and created again (maybe with another geometry) tells its old workers to
register again instead of letting their appends land in memory planned for the old one.
Deleting a pool forgets its workers (and frees their worker_ids).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Plan, Sizing
from kvservice.core.allocator import generation_seed
from kvservice.core.hashing import DEFAULT_MODE, HASH_MODES, VLLM_DEFAULT_SEED
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.manager.event_log import EventHub
from kvservice.manager.fleet_index import FleetIndex
from kvservice.manager.workers import WorkerRecord, WorkerRegistry

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")      # fullmatch: `$` would also accept a trailing newline

#: Resident bytes of one slot unit of Limits.max_total_slots: a slot of a pool without prefix caching (its
#: allocator, rows and generations; 54 bytes measured with an empty prefix cache, bench/results/durability.md).
SLOT_UNIT_BYTES = 56
#: Resident bytes a cached page costs beside its slot, whatever its page size: the prefix cache's hash entry,
#: the fleet index's entries and the KV event that stored it (bench/bench_cached_pages.py, results in
#: bench/results/durability.md: 1.5-1.6 KB at page size 16 with 250-520 K pages cached, 2.9-3.6 KB at 64 with
#: 65-130 K; more per page in small caches, whose growing arrays still carry slack) ...
CACHED_PAGE_BYTES = 1_100
#: ... and per token of its page (the token ids the cache, the fleet index and the event keep).
CACHED_TOKEN_BYTES = 40


def slot_units(page_size: int, prefix_caching: bool) -> int:
    """Units of Limits.max_total_slots one slot (of one layer group) takes: 1 without prefix caching; with it,
    what the slot and a cached page in it cost, in SLOT_UNIT_BYTES (33 at page size 16, 67 at 64)."""
    if not prefix_caching:
        return 1
    return -(-(SLOT_UNIT_BYTES + CACHED_PAGE_BYTES + CACHED_TOKEN_BYTES * page_size) // SLOT_UNIT_BYTES)


class BlockManager:
    """Creates, finds and deletes pools; every call on a pool runs under that pool's lock."""

    def __init__(self, lease_seconds: float = 10.0) -> None:
        self.workers = WorkerRegistry(lease_seconds)
        self._pools: dict[str, Pool] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._incarnations: dict[str, int] = {}      # pool -> incarnation, in [1, 2^63)
        self._lock = threading.Lock()
        self.events = EventHub(self)         # KV event logs of the pools (manager/event_log.py)
        self.fleet = FleetIndex()            # hash -> pools serving it, for ScorePrefix (fleet_index.py)

    def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                    prefix_caching: bool = False, incarnation: int = 0,
                    model: str = "", prefix_hash: str = DEFAULT_MODE,
                    prefix_hash_seed: str = VLLM_DEFAULT_SEED) -> Pool:
        """Plan and create a pool; AlreadyExists if the name is taken.

        incarnation: the new pool's incarnation, in [1, 2^63) (0 = a random one). Callers that
        replay a journal pass the one recorded with the creation.
        prefix_hash, prefix_hash_seed: how prompt pages are hashed (hashing.py).
        """
        if prefix_hash not in HASH_MODES:
            raise InvalidArgument(f"prefix_hash {prefix_hash!r} is not a hash mode; use one of "
                                  f"{', '.join(HASH_MODES)}", reason="UNKNOWN_HASH_MODE")
        if not prefix_hash_seed or len(prefix_hash_seed) > 256 or not prefix_hash_seed.isprintable():
            raise InvalidArgument(f"prefix_hash_seed must be 1..256 printable characters, got {len(prefix_hash_seed)}")
        if not 0 <= incarnation < 2**63:
            raise InvalidArgument(f"incarnation must be in [0, 2^63), got {incarnation}")
        if not _NAME.fullmatch(name):
            raise InvalidArgument(f"pool name {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
        if len(model) > 256 or not model.isprintable():
            raise InvalidArgument(f"model name must be at most 256 printable characters, got {len(model)}")
        planned: Plan = plan(spec, sizing, backends)
        with self._lock:
            if name in self._pools:
                raise AlreadyExists(f"pool {name!r} already exists", pool=name)
            pool = Pool(name, planned, prefix_caching, model, prefix_hash, prefix_hash_seed)
            self._pools[name] = pool
            self._locks[name] = threading.Lock()
            self._incarnations[name] = pool.incarnation = incarnation or new_incarnation()
            for a in pool.allocators:          # a table of another incarnation names generations never held here
                a.generation[:] = generation_seed(pool.incarnation)
            _join(self.fleet, pool)
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
            if pool.prefix is not None and pool.prefix.fleet is not None:
                self.fleet.detach(pool.prefix.fleet)
            self._incarnations.pop(name, None)
            self.workers.drop_pool(name)
        self.events.pool_deleted(name)

    def incarnation(self, name: str) -> int:
        """The current incarnation of a pool; NotFound if it does not exist."""
        with self._lock:
            return self._incarnation_locked(name)

    def incarnations(self) -> dict[str, int]:
        """Pool -> incarnation of every pool (for snapshots: restore with restore_incarnation)."""
        with self._lock:
            return {name: self._incarnation_locked(name) for name in self._pools}

    def restore_incarnation(self, name: str, incarnation: int) -> None:
        """Set the incarnation of a pool installed from a snapshot."""
        if not 0 < incarnation < 2**63:
            raise InvalidArgument(f"incarnation must be in [1, 2^63), got {incarnation}")
        with self._lock:
            self._get(name).incarnation = incarnation
            self._incarnations[name] = incarnation

    def _incarnation_locked(self, name: str) -> int:
        self._get(name)
        inc = self._incarnations.get(name)
        if inc is None:
            # A pool installed by a snapshot that kept no incarnation: take the one its workers
            # registered with (records of a deleted pool are gone, so they are all current), or a new one.
            known = [w.incarnation for w in self.workers.workers(name) if w.incarnation]
            inc = self._incarnations[name] = self._pools[name].incarnation = known[0] if known else new_incarnation()
        return inc

    def register_worker(self, worker_id: str, pool: str, incarnation: int = 0, owner: str = "",
                        enforce: bool = True, **fields: object) -> WorkerRecord:
        """Register a worker of an existing pool (see WorkerRegistry.register for fields).

        incarnation: the pool incarnation the worker planned its memory from (0 = the current one);
        FailedPrecondition (reason STALE_INCARNATION) if the pool was created again since.
        owner: the registering token's name. enforce=False (journal replay) skips the incarnation
        and ownership checks: the registration was accepted when it was made.
        """
        with self._lock:
            num_layers = len(self._get(pool).plan.geometry.layers)
            if not enforce and incarnation and pool not in self._incarnations:
                self._incarnations[pool] = self._pools[pool].incarnation = incarnation   # a state without one
            current = self._incarnation_locked(pool)
        if enforce and incarnation and incarnation != current:
            raise _stale(pool, incarnation, current, worker_id)
        return self.workers.register(worker_id, pool, num_layers, incarnation=current, owner=owner,  # type: ignore[arg-type]
                                     enforce=enforce, **fields)

    def heartbeat(self, worker_id: str, epoch: int, pool: str = "", incarnation: int = 0) -> None:
        """Renew a worker's lease (WorkerRegistry.heartbeat), checking the pool and its incarnation.

        pool "" (older workers) = the pool the worker registered with. NotFound if the named pool
        does not exist or the worker is not registered in it; FailedPrecondition (STALE_INCARNATION)
        if the pool was created again since the worker registered.
        """
        if pool:
            current = self.incarnation(pool)
            if incarnation and incarnation != current:
                raise _stale(pool, incarnation, current, worker_id)
        else:
            rec = next((w for w in self.workers.workers() if w.worker_id == worker_id), None)
            current = self.incarnation(rec.pool) if rec is not None and rec.pool in self.pool_names() else 0
        self.workers.heartbeat(worker_id, epoch, pool, current)

    def total_slots(self) -> int:
        """Slot units summed over every pool: slots x layer groups x slot_units (what bounds their memory)."""
        with self._lock:
            return sum(sum(p.plan.group_slots) * slot_units(p.page_size, p.prefixes is not None)
                       for p in self._pools.values())

    def restore(self, pools: dict[str, Pool], workers: list[WorkerRecord] | None = None) -> None:
        """Replace every pool (and, if given, every worker record) with recovered ones: the journal's hook.

        Each pool gets a fresh lock. A caller still holding an old pool keeps its old object.
        """
        with self._lock:
            self._pools = dict(pools)
            self._locks = {name: threading.Lock() for name in pools}
            self.fleet = FleetIndex()        # built again from the recovered caches
            for pool in self._pools.values():
                _join(self.fleet, pool)
            # Each recovered pool carries its incarnation (0 from a state without one: derived on first use).
            self._incarnations = {name: p.incarnation for name, p in pools.items() if p.incarnation}
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
            # Other pools are not listed: they may belong to tenants the caller may not see.
            raise NotFound(f"pool {name!r} does not exist", pool=name)
        return pool


def _join(fleet: FleetIndex, pool: Pool) -> None:
    """Make a pool's prefix cache a member of the fleet index when it has exactly one, of full attention."""
    if pool.prefixes is not None and len(pool.prefixes) == 1 and not any(pool.windows):
        fleet.attach(pool.prefix)


def new_incarnation() -> int:
    """A random incarnation in [1, 2^63)."""
    return secrets.randbits(63) or 1


def _stale(pool: str, incarnation: int, current: int, worker_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"pool {pool!r} is incarnation {current}, not {incarnation}: it was deleted and created again since this "
        "worker read it; fetch the pool (GetPool), re-plan the worker's memory and register again",
        reason="STALE_INCARNATION", pool=pool, incarnation=current, worker_id=worker_id)
