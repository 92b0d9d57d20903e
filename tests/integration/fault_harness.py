"""A fault lab in the spirit of Jepsen: 3 NATS nodes, 3 managers, scheduler load, and faults injected between.

Every connection between two processes that a fault may cut runs through a loopback link of
tests/faultnet.py: each NATS node dials each other node through its own link (routes), and
each manager reaches each NATS node through its own link. The faults:

- ``kill_leader`` (kill -9 of the leading manager; its pod comes back as a standby),
- ``pause_leader`` (SIGSTOP past its lease, a Step waiting in its socket, then SIGCONT),
- ``kill_nats(i)`` / ``kill_all_nats`` (kill -9 of one NATS node, or of all three at the same
  instant: a coordinated crash; with ``sync_interval: always`` nothing acknowledged may be lost),
- ``partition_manager`` (the leading manager cut off from every NATS node, clients still reach it),
- ``partition_nats(i)`` (one NATS node cut off from its peers and from every manager).

After each fault: the loaders pause, the replicated state is recovered read-only (directly, not
through the links) and compared exactly with every loader's record of acknowledged Steps
(``HASystem.check_exact``); at the end every epoch must have been acknowledged by one process.
What the test asserts is safety; what the bench reports from the same lab is timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..faultnet import FaultNet, Link
from ..natsutil import NatsCluster
from .ha_harness import HASystem, ManagerSlot, cluster_leader_node, epoch_of, epoch_writers, manager_replays


@dataclass
class Outcome:
    fault: str
    detail: str
    old_epoch: int
    new_epoch: int
    seconds: float                      # fault to the first Step acknowledged after it (by a new leader: failover)
    lost: int
    duplicated: int
    problems: list[str] = field(default_factory=list)
    longest_pause: float = 0.0          # the longest time without an acknowledged Step, from the fault until 1 s of
                                        # acknowledgements after it (what the clients saw)
    wall: float = 0.0                   # time.time() of the fault (to place it among the managers' log lines)


class FaultLab:
    def __init__(self, root: Path, managers: int = 3, loaders: int = 3, extra: tuple[str, ...] = (),
                 nats_name: str = "faults") -> None:
        self.net = FaultNet()
        self.routes: dict[tuple[int, int], Link] = {}

        def route_via(i: int, j: int, port: int) -> int:
            self.routes[(i, j)] = self.net.link(port, f"n{i}->n{j}")
            return self.routes[(i, j)].port
        self.cluster = NatsCluster(root / "nats", 3, route_via=route_via)
        self.clients: dict[tuple[int, int], Link] = {}          # (manager slot, nats node) -> link
        self.system = HASystem(root / "managers", self.cluster.url, nats_name, managers=managers,
                               loaders=loaders, extra=("--nats-replicas", "3", *extra))
        for k, slot in enumerate(self.system.slots):
            for j, node in enumerate(self.cluster.nodes):
                self.clients[(k, j)] = self.net.link(node.port, f"{slot.name}->n{j}")
            slot.state = ",".join(f"nats://127.0.0.1:{self.clients[(k, j)].port}" for j in range(3))
        self.outcomes: list[Outcome] = []

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> FaultLab:
        self.cluster.start()
        self.system.start(together=True)
        return self

    def stop(self) -> None:
        try:
            self.system.stop()
        finally:
            self.cluster.stop()
            self.net.close()

    # ---- observing ---------------------------------------------------------------------------------
    def leader(self, timeout: float = 60.0) -> tuple[ManagerSlot, int]:
        return self.system.leader(timeout)

    def settle(self, t_fault: float, epoch: int, fault: str, detail: str, timeout: float = 90.0,
               failover: bool = False) -> Outcome:
        """Wait for a Step acknowledged after the fault (by a newer leader than `epoch` if failover), restart
        dead managers, check everything exactly."""
        t_ack = self.system.first_ack_after(t_fault, epoch if failover else epoch - 1, timeout)
        self.system.restart_dead()
        _, new_epoch = self.leader(timeout)
        pause = self._longest_pause(t_fault, timeout)
        lost, dup, problems = self.system.check_exact(timeout)
        out = Outcome(fault, detail, epoch, new_epoch, t_ack - t_fault, lost, dup, problems[:5], pause)
        self.outcomes.append(out)
        return out

    def _longest_pause(self, t_fault: float, timeout: float) -> float:
        """Longest gap between acknowledged Steps after t_fault, once acknowledgements have flowed for 1 s."""
        deadline = time.monotonic() + timeout
        while True:
            acks = sorted(at for ld in self.system.loaders for at, _, _ in list(ld.acks) if at > t_fault)
            gaps = np.diff([t_fault, *acks])
            if (len(acks) > 1 and acks[-1] - acks[int(np.argmax(gaps))] > 1.0) or time.monotonic() > deadline:
                return float(gaps.max()) if len(gaps) else float("inf")
            self.system.raise_loader_errors()
            time.sleep(0.1)

    def epochs_with_two_writers(self) -> dict[int, set[str]]:
        return {e: w for e, w in epoch_writers(self.system.loaders).items() if len(w) > 1}

    def replays(self) -> list[int]:
        return manager_replays(self.system.slots) + self.system.replays

    def failed_snapshots(self) -> int:
        """Snapshot writes the managers logged as failed (each is retried half a compaction interval later)."""
        import re
        return sum(len(re.findall(r"snapshot at \d+ failed", log.read_text(errors="replace")))
                   for s in self.system.slots for log in s.root.glob(f"{s.name}-*/manager.log"))

    # ---- faults ------------------------------------------------------------------------------------
    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Until the journal stream and the lease bucket each have a leader and every replica is current
        (after a NATS fault the cluster re-elects and catches up; a leader kill is measured on a healthy one)."""
        from kvservice.state.nats.journal import NatsConfig, NatsLink
        config = NatsConfig(tuple(self.cluster.urls), name=self.system.nats_name)
        deadline = time.monotonic() + timeout
        link = NatsLink(config, client_name="fault-lab")
        try:
            while True:
                try:
                    infos = [link.call(link.js.stream_info(s), 5, f"stream info {s}")
                             for s in (config.stream, f"KV_{config.leader_bucket}")]
                    if all(i.cluster and i.cluster.leader and all(r.current and not r.offline
                                                                  for r in i.cluster.replicas or ())
                           for i in infos):
                        return
                except Exception:               # electing: ask again
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"NATS streams not healthy within {timeout:g} s")
                time.sleep(0.2)
        finally:
            link.close()

    def kill_leader(self, rng: np.random.Generator, load: tuple[float, float] = (0.3, 1.0)) -> Outcome:
        """kill -9 the leader after a random time under load, on a healthy NATS cluster."""
        self.system.restart_dead()
        self.wait_healthy()
        slot, epoch = self.leader()
        time.sleep(float(rng.uniform(*load)))
        t, wall = time.monotonic(), time.time()
        slot.kill9()
        slot.start()                                   # the pod comes back, as a standby
        out = self.settle(t, epoch, "kill -9 leader", slot.name, failover=True)
        out.wall = wall
        return out

    def pause_leader(self, beyond: float = 0.5) -> Outcome:
        from .ha_harness import pause_leader
        self.system.restart_dead()
        r = pause_leader(self.system, beyond)          # checks exactly itself
        new = self.leader()[1]
        detail = (f"paused {r.paused_seconds:.1f} s; the Step waiting for it got "
                  f"{'an ACK' if r.acknowledged else (r.code.name if r.code else '?')}; exit status {r.exit_status}")
        out = Outcome("SIGSTOP leader past its lease", detail, r.old_epoch, new, r.paused_seconds, r.lost,
                      r.duplicated, r.problems[:5], r.paused_seconds)
        if r.acknowledged or r.exit_status != 3:
            out.problems.append(f"the paused leader {detail}")
        self.system.restart_dead()
        self.outcomes.append(out)
        return out

    def kill_nats(self, which: int | None = None) -> Outcome:
        """kill -9 one NATS node (default: the one leading the journal stream), then start it again."""
        self.system.restart_dead()
        _, epoch = self.leader()
        node = cluster_leader_node(self.cluster, self.system.nats_name) if which is None else self.cluster.nodes[which]
        t = time.monotonic()
        node.kill()
        out = self.settle(t, epoch, "kill -9 one NATS node", node.name)
        node.start()
        self.cluster.wait_ready()
        return out

    def kill_all_nats(self, down: float = 1.0) -> Outcome:
        """kill -9 all three NATS nodes at the same instant (a coordinated crash), start them again."""
        self.system.restart_dead()
        _, epoch = self.leader()
        t = time.monotonic()
        for n in self.cluster.nodes:
            n.proc.kill()
        for n in self.cluster.nodes:
            n.kill()                                   # reaps them
        time.sleep(down)
        for n in self.cluster.nodes:
            n.start()
        self.cluster.wait_ready(120)
        return self.settle(t, epoch, "kill -9 all NATS nodes at once", f"down {down:g} s", timeout=150)

    def partition_manager(self, seconds: float) -> Outcome:
        """Cut the leading manager off from every NATS node (clients still reach it) for `seconds`, then heal."""
        self.system.restart_dead()
        slot, epoch = self.leader()
        k = self.system.slots.index(slot)
        links = [lk for (m, _), lk in self.clients.items() if m == k]
        t = time.monotonic()
        for lk in links:
            lk.cut()
        try:
            self.system.first_ack_after(t, epoch, 90)  # a standby took over while it is cut off
            time.sleep(max(0.0, t + seconds - time.monotonic()))
        finally:
            for lk in links:
                lk.heal()
        out = self.settle(t, epoch, "partition: the leader manager cut off from NATS", f"{slot.name}, {seconds:g} s",
                          failover=True)
        if epoch_of(slot.target) == epoch:
            out.problems.append(f"{slot.name} still answers as leader of epoch {epoch} after the partition")
        return out

    def partition_nats(self, which: int | None = None, seconds: float = 5.0) -> Outcome:
        """Cut one NATS node (default: the journal stream's leader) off from its peers and every manager."""
        self.system.restart_dead()
        _, epoch = self.leader()
        node = cluster_leader_node(self.cluster, self.system.nats_name) if which is None else self.cluster.nodes[which]
        i = self.cluster.nodes.index(node)
        links = [lk for (a, b), lk in self.routes.items() if i in (a, b)]
        links += [lk for (_, j), lk in self.clients.items() if j == i]
        t = time.monotonic()
        for lk in links:
            lk.cut()
        try:
            time.sleep(seconds)
        finally:
            for lk in links:
                lk.heal()
        return self.settle(t, epoch, "partition: one NATS node cut off from everyone", f"{node.name}, {seconds:g} s")


def summary(outcomes: list[Outcome]) -> list[str]:
    """One line per outcome that is not clean (empty when all are)."""
    return [f"{o.fault} ({o.detail}): lost {o.lost}, duplicated {o.duplicated}; {o.problems}"
            for o in outcomes if o.lost or o.duplicated or o.problems]


__all__ = ["FaultLab", "Outcome", "summary"]
