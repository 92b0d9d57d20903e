"""Replicated managers on a NATS cluster under scheduler-like load, leaders killed: for test_ha.py and bench_ha.py.

ManagerSlot is one manager "pod": a `kvservice serve --state nats://...` process that is
restarted on the same port after it dies (what a StatefulSet does). Loaders are the
durability test's scheduler-like clients, here with a LeaderClient over every slot; each
acknowledged Step is recorded with the time and the leader epoch it came from.
`check_exact` pauses the loaders (nothing in flight), recovers the replicated state read-only
from NATS, checks every invariant and compares it with what the loaders were told.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.client import RetryPolicy
from kvservice.client.ha import LeaderClient, leader_epoch
from kvservice.contract.sizing import Sizing
from kvservice.server.ha import open_journal
from kvservice.state.nats.journal import NatsConfig, NatsLink, StoreError, parse_state_url
from kvservice.tools.launch import wait_for_ports
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

from ..natsutil import NatsCluster
from .conftest import ROOT
from .test_durability import POOL, SEQ_BASE, SLOTS, SPEC, Loader, recovered_from

#: Loader clients: a silent (paused) leader is left after 2 s, many quick retries, and a call that meets no manager
#: keeps trying for 2 minutes (failovers under the fault suite's load on a 2-core machine).
LOADER_RETRY = RetryPolicy(attempts=400, initial_backoff=0.02, max_backoff=0.25, attempt_timeout=2.0, grpc_attempts=1,
                           failover=120.0)


class ManagerSlot:
    """One manager process slot: start, kill -9, SIGSTOP/SIGCONT, restart on the same port."""

    def __init__(self, root: Path, name: str, state: str, nats_name: str, extra: tuple[str, ...] = ()) -> None:
        self.root, self.name, self.state, self.nats_name, self.extra = root, name, state, nats_name, extra
        self.port = 0
        self.runs = 0
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.metrics_port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.runs += 1
        d = self.root / f"{self.name}-{self.runs}"
        d.mkdir(parents=True)
        self.log = open(d / "manager.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", f"127.0.0.1:{self.port}",
             "--metrics-port", "0", "--port-file", str(d / "ports"), "--no-pools", "--state", self.state,
             "--nats-name", self.nats_name, "--node-id", f"{self.name}-{self.runs}", *self.extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.port, self.metrics_port = wait_for_ports(self.proc, d / "ports", timeout, d / "manager.log",
                                                      f"manager {self.name}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def log_tail(self, n: int = 3000) -> str:
        d = self.root / f"{self.name}-{self.runs}" / "manager.log"
        return d.read_text()[-n:] if d.exists() else ""


def epoch_of(target: str, timeout: float = 1.0) -> int | None:
    """The epoch a manager answers with, or None (a standby, a dead or paused process)."""
    with grpc.insecure_channel(target) as ch:
        try:
            _, call = pb_grpc.BlockManagerStub(ch).Echo.with_call(pb.EchoRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return leader_epoch(call.initial_metadata())


class HALoader(Loader):
    """The durability Loader over a LeaderClient (the public client, as a scheduler uses it): its model of
    every acknowledged Step is the independent record, and each acknowledgement is also logged as
    (monotonic time, epoch, node id of the manager that answered)."""

    def __init__(self, idx: int, targets: list[str], stop: threading.Event) -> None:
        super().__init__(idx, "", stop, client=LeaderClient(targets, timeout=10.0, retry=LOADER_RETRY))
        self.acks: list[tuple[float, int, str]] = []

    def _acknowledge(self, r, free, ext, k) -> None:
        super()._acknowledge(r, free, ext, k)
        self.acks.append((time.monotonic(), self.client.epoch, self.client.leader_node))


def epoch_writers(loaders: list[HALoader]) -> dict[int, set[str]]:
    """epoch -> the node ids (process incarnations: --node-id is slot-run) that acknowledged a Step under it."""
    out: dict[int, set[str]] = {}
    for ld in loaders:
        for _, epoch, node in list(ld.acks):
            out.setdefault(epoch, set()).add(node)
    return out


@dataclass
class Takeover:
    kill: int
    old_epoch: int
    new_epoch: int
    failover_seconds: float
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)


class HASystem:
    """`managers` replicated managers on `state` (nats://...), a pool, and `loaders` loaders."""

    def __init__(self, root: Path, state: str, nats_name: str, managers: int = 2, loaders: int = 3,
                 extra: tuple[str, ...] = ()) -> None:
        self.state, self.nats_name = state, nats_name
        self.slots = [ManagerSlot(root, chr(ord("a") + i), state, nats_name, extra) for i in range(managers)]
        self.stop_loaders = threading.Event()
        self.num_loaders = loaders
        self.loaders: list[HALoader] = []
        self.replays: list[int] = []            # entries replayed by each read-only recovery of check_exact

    @property
    def targets(self) -> list[str]:
        return [s.target for s in self.slots]

    def start(self, together: bool = False) -> None:
        """together: start every manager at once (a fresh deployment with podManagementPolicy: Parallel)."""
        if together:
            threads = [threading.Thread(target=s.start, args=(180.0,)) for s in self.slots]
            for th in threads:
                th.start()
            for th in threads:
                th.join(200)
            dead = [s.name for s in self.slots if not s.alive()]
            assert not dead, f"managers {dead} did not come up:\n" + "\n".join(s.log_tail() for s in self.slots)
        else:
            for s in self.slots:
                s.start()
        with LeaderClient(self.targets, timeout=5.0, failover=120) as c:
            c.create_pool(POOL, SPEC, Sizing(num_slots=SLOTS, max_seq_len=1024))
        self.loaders = [HALoader(i, self.targets, self.stop_loaders) for i in range(self.num_loaders)]
        for ld in self.loaders:
            ld.start()

    def leader(self, timeout: float = 30.0) -> tuple[ManagerSlot, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for s in self.slots:
                if s.alive():
                    e = epoch_of(s.target)
                    if e is not None:
                        return s, e
            time.sleep(0.05)
        logs = "\n".join(s.log_tail() for s in self.slots)
        raise AssertionError(f"no leader within {timeout:g} s:\n{logs}")

    def restart_dead(self) -> list[str]:
        restarted = []
        for s in self.slots:
            if not s.alive():
                s.start()
                restarted.append(s.name)
        return restarted

    def first_ack_after(self, t: float, epoch: int, timeout: float = 30.0) -> float:
        """Monotonic time of the first Step acknowledged after t by a leader of an epoch above `epoch`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            times = [at for ld in self.loaders for at, e, _ in list(ld.acks) if at > t and e > epoch]
            if times:
                return min(times)
            self.raise_loader_errors()
            time.sleep(0.01)
        raise AssertionError(f"no Step acknowledged by a new leader within {timeout:g} s:\n"
                             + "\n".join(s.log_tail() for s in self.slots))

    def raise_loader_errors(self) -> None:
        errors = [e for ld in self.loaders for e in ld.errors]
        assert not errors, errors
        dead = [ld.idx for ld in self.loaders if not ld.is_alive() and not self.stop_loaders.is_set()]
        assert not dead, f"loaders {dead} stopped"

    def check_exact(self, timeout: float = 60.0) -> tuple[int, int, list[str]]:
        """Pause the loaders, recover the replicated state read-only, compare: (lost, duplicated, problems)."""
        for ld in self.loaders:
            ld.hold.set()
        try:
            deadline = time.monotonic() + timeout
            for ld in self.loaders:
                if not ld.idle.wait(max(0.0, deadline - time.monotonic())):
                    raise AssertionError(f"loader {ld.idx} did not finish its step in {timeout:g} s")
            self.raise_loader_errors()
            while True:          # NATS may be electing a stream or meta leader (a node was just killed)
                try:
                    seqs, replayed = recovered(self.state, self.nats_name)
                    self.replays.append(replayed)
                    break
                except StoreError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
            return compare(seqs, self.loaders)
        finally:
            for ld in self.loaders:
                ld.hold.clear()

    def stop(self) -> None:
        self.stop_loaders.set()
        for ld in self.loaders:
            ld.join(30)
            ld.client.close()
        for s in self.slots:
            s.stop()


def recovered(state: str, nats_name: str) -> tuple[dict[int, tuple[int, list[int]]], int]:
    """The pool as a takeover would rebuild it from NATS (read-only), after checking every invariant; and how
    many entries that recovery replayed after the newest snapshot."""
    j = open_journal(parse_state_url(state, name=nats_name), readonly=True)
    return recovered_from(j), j.replayed_entries


def manager_replays(slots: list[ManagerSlot]) -> list[int]:
    """Entries replayed by every recovery the managers logged (each start, each reload of a standby)."""
    import re
    out = []
    for s in slots:
        for log in s.root.glob(f"{s.name}-*/manager.log"):
            out += [int(m) for m in re.findall(r"(\d+) entries replayed", log.read_text(errors="replace"))]
    return out


def compare(seqs: dict[int, tuple[int, list[int]]], loaders: list[HALoader]) -> tuple[int, int, list[str]]:
    """(lost, duplicated, problems) of recovered sequences against the loaders' acknowledged models (none in flight).

    lost: an acknowledged sequence or tokens missing; duplicated: more tokens or pages than acknowledged,
    or a sequence acknowledged as freed still there.
    """
    lost = dup = 0
    problems = []
    for ld in loaders:
        with ld.lock:
            model = dict(ld.model)
        mine = {s: v for s, v in seqs.items() if s // SEQ_BASE == ld.idx}
        for s, (tokens, pages) in model.items():
            got = mine.get(s)
            if got is None or got[0] < tokens:
                lost += 1
                problems.append(f"loader {ld.idx} seq {s}: acknowledged {tokens} tokens, recovered {got}")
            elif got[0] > tokens or got[1] != pages:
                dup += 1
                problems.append(f"loader {ld.idx} seq {s}: acknowledged {(tokens, pages)}, recovered {got}")
        for s in set(mine) - set(model):
            dup += 1
            problems.append(f"loader {ld.idx} seq {s}: not acknowledged (or freed), recovered {mine[s]}")
    return lost, dup, problems


def kill_loop(system: HASystem, kills: int, rng: np.random.Generator, load_seconds: tuple[float, float] = (0.3, 1.0),
              on_kill=None) -> list[Takeover]:
    """kill -9 the leader `kills` times at random moments under load; restart it as the standby; check each time."""
    out = []
    for k in range(kills):
        system.restart_dead()
        slot, epoch = system.leader()
        time.sleep(float(rng.uniform(*load_seconds)))
        t_kill = time.monotonic()
        slot.kill9()
        slot.start()                                       # the pod comes back, as the standby
        t_ack = system.first_ack_after(t_kill, epoch)
        _, new_epoch = system.leader()
        lost, dup, problems = system.check_exact()
        out.append(Takeover(k, epoch, new_epoch, t_ack - t_kill, lost, dup, problems[:5]))
        if on_kill is not None:
            on_kill(out[-1])
    return out


@dataclass
class PauseResult:
    old_epoch: int
    paused_seconds: float
    acknowledged: bool                  # the Step that waited for the paused leader got an OK reply
    code: grpc.StatusCode | None        # ... or this error
    exit_status: int | None             # of the paused process after SIGCONT
    lost: int
    duplicated: int
    problems: list[str]


def pause_leader(system: HASystem, extra_seconds: float = 0.5) -> PauseResult:
    """SIGSTOP the leader; send it a Step (it waits in the socket); once the standby has taken over and
    `extra_seconds` more passed, SIGCONT. What did that Step get, and what became of the old leader?"""
    slot, epoch = system.leader()
    pinned = BlockManagerClient(slot.target, timeout=30, retries=0)
    pinned.get_pool(POOL)                                   # connected before the pause
    got: dict[str, object] = {}

    def late_step() -> None:
        try:
            got["reply"] = pinned.step(POOL, admit=[SEQ_BASE * 1000 + slot.runs], admit_tokens=[5])
        except ClientError as err:
            got["code"] = err.code
    t0 = time.monotonic()
    slot.pause()
    th = threading.Thread(target=late_step, daemon=True)
    th.start()
    try:
        system.first_ack_after(t0, epoch)                   # the standby took over meanwhile
        time.sleep(extra_seconds)
    finally:
        slot.resume()
    paused = time.monotonic() - t0
    th.join(60)
    try:
        status = slot.proc.wait(30)
    except subprocess.TimeoutExpired:
        status = None
    pinned.close()
    lost, dup, problems = system.check_exact()
    return PauseResult(epoch, paused, "reply" in got, got.get("code"), status, lost, dup, problems)  # type: ignore[arg-type]


def cluster_leader_node(cluster: NatsCluster, nats_name: str):
    config = NatsConfig(tuple(cluster.urls), name=nats_name)
    link = NatsLink(config)
    try:
        info = link.call(link.js.stream_info(config.stream), 10)
        leader = info.cluster.leader if info.cluster else None
    finally:
        link.close()
    return next((n for n in cluster.nodes if n.name == leader), cluster.nodes[0])
