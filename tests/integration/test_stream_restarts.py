"""Issue 27, item 2: StepStream clients ride through kill -9 of a durable manager, every Step applied exactly once.

A sync and an asyncio stream, each with the default client settings (README), run scheduler-like
loops against one manager (`kvservice serve --state-dir`) that is killed with SIGKILL and restarted
on the same address, over and over, as soon as both have acknowledged a few Steps since the last
restart (progress counted, never timed). Each loop keeps its own model of what it acknowledged;
a step that raised UNAVAILABLE or DEADLINE_EXCEEDED (a restart that outlasted its deadline) is
retried by the caller with the same arguments, as a scheduler would. A third loop (sync, with
RetryPolicy(attempts=1)) never reconnects by itself, so every kill reaches its caller and the
caller's retry goes through the pending request. At the end the manager's
sequences hold exactly the acknowledged tokens and the pool counted one step per acknowledged Step.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import RetryPolicy
from kvservice.client.deadline import RETRY_CODES
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing

from .test_durability import kill9, start, wait_for_progress

pytestmark = pytest.mark.integration
POOL = "streams"
SPEC = CacheSpec.uniform(2, 1, 64, page_size=16)
CYCLES = 20
STEPS_PER_CYCLE = 3            # acknowledged by each loop between two kills


class Model:
    """A loop's acknowledged state: seq id -> tokens; the next step's arguments from a seeded generator."""

    def __init__(self, name: str, base: int, seed: int) -> None:
        self.name, self.base = name, base
        self.rng = np.random.default_rng(seed)
        self.tokens: dict[int, int] = {}
        self.next_id = base
        self.acked = 0            # Steps acknowledged
        self.retried = 0          # Steps the caller sent again after UNAVAILABLE / DEADLINE_EXCEEDED
        self.errors: list[str] = []
        self.stop = threading.Event()

    def plan(self) -> tuple[dict, list[int], int, dict[int, int]]:
        """(step kwargs, freed ids, tokens per extended id, admitted id -> tokens); mostly steady decode steps."""
        live = sorted(self.tokens)
        if len(live) < 3 or self.rng.random() < 0.15:           # admit one (and free the oldest past 4)
            free = live[:1] if len(live) >= 4 else []
            sid, n = self.next_id, int(self.rng.integers(1, 40))
            self.next_id += 1
            ext = [i for i in live if i not in free]
            kw = {"free": free or None, "extend": ext or None, "extend_tokens": 1, "admit": [sid], "admit_tokens": [n]}
            return kw, free, 1, {sid: n}
        return {"extend": live, "extend_tokens": 1}, [], 1, {}

    def acknowledge(self, r, free: list[int], k: int, admit: dict[int, int]) -> None:
        before = dict(self.tokens)
        for i in free:
            del self.tokens[i]
        for i in self.tokens:
            self.tokens[i] += k
        self.tokens.update(admit)
        got = dict(zip(r.seq_ids.tolist(), r.num_tokens.tolist(), strict=True))
        if got != self.tokens:                # a Step applied twice (or lost) shows here at once
            self.errors.append(f"{self.name} step {self.acked + 1}: acknowledged {before}, expected {self.tokens}, "
                               f"the manager says {got}")
            self.stop.set()
        self.acked += 1

    def failed(self, err: ClientError) -> bool:
        """True if the caller retries the step (its outcome is unknown); records any other error."""
        if err.code in RETRY_CODES:
            self.retried += 1
            return True
        self.errors.append(f"{self.name}: {err}")
        self.stop.set()
        return False


def sync_loop(target: str, m: Model, out: dict, retry: RetryPolicy | None = None) -> None:
    with BlockManagerClient(target, retry=retry) as c, c.step_stream(POOL) as s:
        while not m.stop.is_set():
            kw, free, k, admit = m.plan()
            while True:
                try:
                    r = s.step(**kw)
                    break
                except ClientError as err:
                    if not m.failed(err):
                        return
                    time.sleep(0.05)              # the caller backs off, then retries the same step
            m.acknowledge(r, free, k, admit)
        out["reconnects"], out["resolved"] = s.reconnects, s.resolved


def async_loop(target: str, m: Model, out: dict) -> None:
    async def run() -> None:
        async with AsyncBlockManagerClient(target) as c:
            s = await c.step_stream(POOL)
            while not m.stop.is_set():
                kw, free, k, admit = m.plan()
                while True:
                    try:
                        r = await s.step(**kw)
                        break
                    except ClientError as err:
                        if not m.failed(err):
                            return
                m.acknowledge(r, free, k, admit)
            out["reconnects"], out["resolved"] = s.reconnects, s.resolved
            await s.close()
    asyncio.run(run())


def wait_for(models: list[Model], steps: int) -> None:
    """Until each loop acknowledged `steps` more Steps (progress counted, the wait bounded generously)."""
    want = [m.acked + steps for m in models]
    wait_for_progress(models, steps, bound=120.0)
    assert all(m.acked >= w for m, w in zip(models, want, strict=True)), \
        f"acknowledged {[m.acked for m in models]}, wanted {want}; errors {[m.errors for m in models]}"


def test_stream_clients_apply_every_step_once_across_kill9_restarts(tmp_path):
    state = tmp_path / "state"
    mgr = start(tmp_path, "run0", state, "--compact-every", "40")
    port = mgr.target.rsplit(":", 1)[1]
    with BlockManagerClient(mgr.target) as c:
        c.wait_ready()
        c.create_pool(POOL, SPEC, Sizing(num_slots=2048, max_seq_len=4096))
    # sync and asyncio with the default settings; a third (sync) that never reconnects by itself
    # (attempts=1): each kill reaches its caller, whose retry goes through the pending request.
    models = [Model("sync", 1, 1), Model("asyncio", 1_000_000, 2), Model("sync, attempts=1", 2_000_000, 3)]
    outs: list[dict] = [{}, {}, {}]
    loops = (sync_loop, async_loop, lambda t, m, o: sync_loop(t, m, o, RetryPolicy(attempts=1)))
    threads = [threading.Thread(target=loop, args=(mgr.target, m, o), daemon=True)
               for loop, m, o in zip(loops, models, outs, strict=True)]
    for t in threads:
        t.start()
    try:
        for cycle in range(1, CYCLES + 1):
            wait_for(models, STEPS_PER_CYCLE)          # both acknowledged a few Steps on this manager
            kill9(mgr)                                 # mid-step, most likely: a request is in flight
            mgr = start(tmp_path, f"run{cycle}", state, "--compact-every", "40", "--listen", f"127.0.0.1:{port}")
        wait_for(models, STEPS_PER_CYCLE)
    finally:
        for m in models:
            m.stop.set()
        for t in threads:
            t.join(60)
    try:
        assert not [e for m in models for e in m.errors], [m.errors for m in models]
        assert not any(t.is_alive() for t in threads)
        with BlockManagerClient(mgr.target) as c:
            live = {s.seq_id: s.num_tokens for s in c.sequences(POOL).sequences}
            steps = c.stats(POOL)[POOL].steps
        assert live == {k: v for m in models for k, v in m.tokens.items()}   # every acknowledged token, no other
        assert steps == sum(m.acked for m in models)                      # one applied Step per acknowledged one
        for m, out in zip(models[:2], outs[:2], strict=True):               # each stream reopened after each kill
            assert out["reconnects"] >= CYCLES, (m.name, out)
        assert models[2].retried >= CYCLES and outs[2]["resolved"] >= CYCLES, outs[2]   # each kill reached its caller
        print(f"\n{CYCLES} kill -9 cycles: acknowledged {[m.acked for m in models]} Steps (sync, asyncio, sync "
              "attempts=1), "
              f"pool steps {steps}, reconnects {[o['reconnects'] for o in outs]}, caller retries "
              f"{[m.retried for m in models]}, pending resolved {[o['resolved'] for o in outs]}")
    finally:
        mgr.stop()
