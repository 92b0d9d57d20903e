"""Bounded soak: concurrent scheduler-like clients against a durable manager process for a fixed time (loopback).

Zero unexpected errors (running out of slots is expected and handled by preempting), no
slot leaked once every client freed its sequences, invariants intact in the state the
manager leaves on disk. KVSERVICE_SOAK_SECONDS sets the duration (default 15).
"""

import os
import threading
import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.state.journal import Journal
from tests.run_summary import SOAK as RESULTS

from ..integration.conftest import ManagerProcess

pytestmark = pytest.mark.integration
SECONDS = float(os.environ.get("KVSERVICE_SOAK_SECONDS", "15"))
POOLS = ("s0", "s1")
SLOTS = 512
CLIENTS_PER_POOL = 3


class Scheduler(threading.Thread):
    """Admits, decodes (1 token each), extends in chunks and frees; preempts half its batch when refused."""

    def __init__(self, idx: int, target: str, pool: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"sched{idx}")
        self.idx, self.pool, self.stop = idx, pool, stop
        self.client = BlockManagerClient(target, timeout=10)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.refused = 0
        self.live: dict[int, int] = {}

    def run(self) -> None:
        rng = np.random.default_rng(self.idx)
        next_id = (self.idx + 1) * 10_000_000
        try:
            while not self.stop.is_set():
                done = [s for s, n in self.live.items() if n > 600 or rng.random() < 0.03]
                ext = [s for s in self.live if s not in done]
                k = 1 if rng.random() < 0.8 else int(rng.integers(2, 64))
                admit = list(range(next_id, next_id + int(rng.integers(0, 3)))) if len(self.live) < 24 else []
                next_id += len(admit)
                n = rng.integers(1, 300, len(admit))
                self._step(done, ext, k, admit, n)
        finally:
            if self.live:
                self._step(list(self.live), [], 1, [], np.zeros(0, np.int64))

    def _step(self, free, ext, k, admit, n) -> None:
        t0 = time.perf_counter()
        try:
            r = self.client.step(self.pool, free=free or None, extend=ext or None, extend_tokens=k,
                                 admit=admit or None, admit_tokens=n if admit else None)
        except ClientError as err:
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.errors.append(str(err))
                self.stop.set()
                return
            self.refused += 1
            victims = sorted(self.live)[len(self.live) // 2:]          # preempt the youngest half
            if victims:
                self._step(victims, [], 1, [], np.zeros(0, np.int64))
            return
        self.latencies.append(time.perf_counter() - t0)
        for s in free:
            del self.live[s]
        self.live.update(zip(r.seq_ids.tolist(), r.num_tokens.tolist(), strict=True))


class Reader(threading.Thread):
    """An operator polling stats, sequences and pools while the schedulers run."""

    def __init__(self, target: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="reader")
        self.client, self.stop, self.errors, self.calls = BlockManagerClient(target, timeout=10), stop, [], 0

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.client.stats()
                self.client.sequences(POOLS[self.calls % 2], limit=10)
                self.client.list_pools()
                self.calls += 3
            except ClientError as err:
                self.errors.append(str(err))


def test_soak(tmp_path):
    state = tmp_path / "state"
    m = ManagerProcess(tmp_path, "--no-pools", "--state-dir", str(state), "--compact-every", "2000")
    try:
        with BlockManagerClient(m.target) as c:
            c.wait_ready()
            for p in POOLS:
                c.create_pool(p, CacheSpec.uniform(4, 2, 64, page_size=16), Sizing(num_slots=SLOTS, max_seq_len=2048))
        stop = threading.Event()
        scheds = [Scheduler(i, m.target, POOLS[i % len(POOLS)], stop) for i in range(CLIENTS_PER_POOL * len(POOLS))]
        reader = Reader(m.target, stop)
        t0 = time.perf_counter()
        for t in (*scheds, reader):
            t.start()
        stop.wait(SECONDS)
        stop.set()
        for t in (*scheds, reader):
            t.join(60)
        elapsed = time.perf_counter() - t0
        errors = [e for t in (*scheds, reader) for e in t.errors]
        with BlockManagerClient(m.target) as c:
            stats = c.stats()
    finally:
        m.stop()
    lat = np.array([x for s in scheds for x in s.latencies]) * 1e3
    RESULTS.update({
        "duration": f"{elapsed:.1f} s, {len(scheds)} schedulers on {len(POOLS)} pools + 1 reader",
        "acknowledged steps": f"{len(lat)} ({len(lat) / elapsed:.0f}/s), durable journal (sync=full)",
        "Step latency p50 / p99": f"{np.percentile(lat, 50):.2f} ms / {np.percentile(lat, 99):.2f} ms",
        "refused (out of slots)": f"{sum(s.refused for s in scheds)} (handled by preemption)",
        "unexpected errors": f"{len(errors)}",
        "reads": f"{reader.calls}",
    })
    assert not errors, errors[:5]
    assert len(lat) > 100 * SECONDS / 15
    for p in POOLS:                                                    # no slot leaked
        assert (stats[p].num_sequences, stats[p].num_free_slots) == (0, SLOTS), stats[p]
    j = Journal.open(state, readonly=True)                             # ... and none on disk either
    try:
        for p in POOLS:
            with j.manager.locked(p) as pool:
                assert_invariants(pool)
                assert pool.num_sequences == 0 and all(a.num_free == SLOTS for a in pool.allocators)
    finally:
        j.close(snapshot=False)
