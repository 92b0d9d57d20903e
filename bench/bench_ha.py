"""Replicated manager: failover time over a kill -9 loop, and the Step cost of the NATS journal against SQLite.

Writes a markdown report (default bench/results/ha.md), everything measured in one run:
  1. decode Step latency over gRPC at B=1 and B=256 (one token per sequence, tables returned,
     a request_id each) with the SQLite journal (sync=full, the default, and sync=normal) and
     the NATS JetStream journal (1 node R1; 3-node cluster R3), configurations interleaved;
  2. failover: two managers on a 3-node NATS cluster (R3, the default lease), three
     scheduler-like clients, the leader killed -9 at random moments N times; time from the kill
     to the first Step acknowledged by the new leader, and an exact check of the replicated
     state against what the clients were told after every takeover (lost, duplicated);
  3. a leader paused (SIGSTOP) past its lease, then resumed with a request waiting for it;
  4. a NATS node (the journal stream's leader) killed -9 mid-run.
Timings are measured, never asserted.
Usage: python bench/bench_ha.py [--out FILE] [--quick] [--kills N] [--latency-only] [--with-loop-path]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.bench_durability import grpc_step_times  # noqa: E402
from kvservice.server.app import serve  # noqa: E402
from kvservice.server.ha import serve_ha, stop_ha  # noqa: E402
from kvservice.state.journal import Journal, JournalConfig  # noqa: E402
from kvservice.state.nats.journal import NatsConfig, NatsLink, NatsStore  # noqa: E402
from kvservice.state.nats.leader import LeaseConfig  # noqa: E402
from tests.integration.ha_harness import HASystem, cluster_leader_node, kill_loop, pause_leader  # noqa: E402
from tests.natsutil import NatsCluster  # noqa: E402

BATCHES = (1, 256)
KINDS = ("sqlite-full", "sqlite-normal", "nats-r1", "nats-r3")
NAMES = {"sqlite-full": "SQLite, sync=full (default `--state-dir`)", "sqlite-normal": "SQLite, sync=normal",
         "nats-r1": "NATS JetStream, 1 node, R1", "nats-r3": "NATS JetStream, 3 nodes, R3 (production)",
         "nats-r3-loop": "NATS JetStream, 3 nodes, R3, appends through the nats-py loop (the path replaced)"}


def _loop_publish(store: NatsStore, payload: bytes, headers: dict[str, str]) -> tuple[int, bool]:
    """An append's publish as it was before kvservice/state/nats/direct.py: js.publish on the link's loop."""
    c = store.config
    ack = store.link.call(store.link.js.publish(c.subject, payload, timeout=c.request_seconds, stream=c.stream,
                                                headers=dict(headers)), c.request_seconds + 1.0)
    return int(ack.seq), bool(ack.duplicate)


def step_latency(kind: str, b: int, n: int, tmp: Path, clusters: dict[str, NatsCluster]) -> np.ndarray:
    if kind.startswith("sqlite"):
        d = tmp / uuid.uuid4().hex
        running = serve(journal=Journal.open(d, config=JournalConfig(sync=kind.split("-")[1])))
        try:
            return grpc_step_times(running.port, b, n)
        finally:
            running.stop(0)
            shutil.rmtree(d, ignore_errors=True)
    cluster = clusters[kind.removesuffix("-loop")]
    config = NatsConfig(tuple(cluster.urls), name="lat" + uuid.uuid4().hex[:8], replicas=len(cluster.nodes))
    running, ha = serve_ha(config, LeaseConfig(), "127.0.0.1:0")
    if kind.endswith("-loop"):
        ha.store._publish_once = types.MethodType(_loop_publish, ha.store)  # type: ignore[method-assign]
    try:
        deadline = time.monotonic() + 30
        while ha.role != "leader":
            if time.monotonic() > deadline:
                raise RuntimeError(f"no takeover: {ha.failed}")
            time.sleep(0.01)
        return grpc_step_times(running.port, b, n)
    finally:
        stop_ha(running, ha, grace=0)


def publish_rtt(cluster: NatsCluster, n: int) -> tuple[float, float, float, float]:
    """p50 ms of one JetStream publish (~300 bytes, acked) awaited on the loop, through NatsLink.call, on the
    journal's direct connection (what an append does), and of an empty NatsLink.call (the thread hop alone)."""
    config = NatsConfig(tuple(cluster.urls), name="rtt" + uuid.uuid4().hex[:8], replicas=len(cluster.nodes))
    link = NatsLink(config)
    try:
        NatsStore(link)                                   # creates the stream

        async def in_loop() -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                await link.js.publish(config.subject, b"x" * 300, headers={"Kvs-Kind": "bench"})
                out.append(time.perf_counter() - t0)
            return out

        async def nothing() -> None:
            return None
        loop_t = np.array(link.call(in_loop(), 120))
        hop_t, direct_t, empty_t = np.empty(n), np.empty(n), np.empty(n)
        for i in range(n):
            t0 = time.perf_counter()
            link.call(link.js.publish(config.subject, b"x" * 300, headers={"Kvs-Kind": "bench"}), 10)
            hop_t[i] = time.perf_counter() - t0
            t0 = time.perf_counter()
            reply = link.direct.request(config.subject, b"x" * 300, {"Kvs-Kind": "bench"}, 10)
            direct_t[i] = time.perf_counter() - t0
            assert b'"seq"' in reply.data, reply
            t0 = time.perf_counter()
            link.call(nothing(), 10)
            empty_t[i] = time.perf_counter() - t0
        link.call(link.js.delete_stream(config.stream), 10)
        return tuple(float(np.percentile(t, 50)) * 1e3 for t in (loop_t, hop_t, direct_t, empty_t))  # type: ignore
    finally:
        link.close()


def paused_leader(system: HASystem, rounds: int) -> list[str]:
    """SIGSTOP the leader past its lease with a Step waiting for it, SIGCONT: what did that Step get?"""
    out = []
    for _ in range(rounds):
        system.restart_dead()
        r = pause_leader(system)
        out.append(f"epoch {r.old_epoch} paused {r.paused_seconds:.1f} s; the Step waiting for it got "
                   f"{'an ACK' if r.acknowledged else (r.code.name if r.code else '?')}; the old leader exited "
                   f"with status {r.exit_status}; lost {r.lost}, duplicated {r.duplicated}")
        system.restart_dead()
    return out


def nats_node_loss(system: HASystem, cluster: NatsCluster) -> str:
    system.restart_dead()
    _, epoch = system.leader()
    time.sleep(1.0)
    victim = cluster_leader_node(cluster, system.nats_name)
    t_kill = time.monotonic()
    victim.kill()
    time.sleep(12.0)
    restarted = system.restart_dead()
    time.sleep(3.0)
    acks = sorted(at for ld in system.loaders for at, _ in ld.acks if at > t_kill - 2.0)
    before = [a for a in acks if a <= t_kill]
    after = [a for a in acks if a > t_kill]
    gap = (after[0] - t_kill) if after else float("inf")
    longest = max(np.diff([t_kill, *after]).tolist() or [float("inf")])
    _, new_epoch = system.leader()
    lost, dup, _ = system.check_exact()
    victim.start()
    cluster.wait_ready()
    return (f"killed {victim.name} (leader of the journal stream's Raft group): first Step acknowledged "
            f"{gap:.2f} s after the kill, longest pause between acknowledged Steps {longest:.2f} s; leader epoch "
            f"{epoch} -> {new_epoch} ({'a failover' if new_epoch != epoch else 'no failover'}"
            f"{', manager(s) ' + '/'.join(restarted) + ' fail-stopped and restarted' if restarted else ''}); "
            f"{len(before)} Steps in the 2 s before, {len(after)} in the 15 s after; lost {lost}, duplicated {dup}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/ha.md"))
    ap.add_argument("--quick", action="store_true", help="fewer steps and kills (a smoke run)")
    ap.add_argument("--kills", type=int, default=0, help="leader kills (default 40; 10 with --quick)")
    ap.add_argument("--with-loop-path", action="store_true",
                    help="one more latency row: R3 with appends through the nats-py loop, the path replaced")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the Step latency rows and the publish breakdown, printed (no report written)")
    args = ap.parse_args(argv)
    args.load_at_start = os.getloadavg()[0]
    n, rounds = (200, 2) if args.quick else (800, 4)
    kills = args.kills or (10 if args.quick else 40)
    lease = LeaseConfig()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        clusters = {"nats-r1": NatsCluster(tmp / "r1", 1).start(), "nats-r3": NatsCluster(tmp / "r3", 3).start()}
        try:
            rows = []
            for b in BATCHES:
                kinds = (*KINDS, "nats-r3-loop") if args.with_loop_path else KINDS
                samples: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
                for _ in range(rounds):                  # interleaved: machine drift hits every configuration alike
                    for kind in kinds:
                        samples[kind].append(step_latency(kind, b, n // rounds, tmp, clusters) * 1e3)
                for kind in kinds:
                    t = np.concatenate(samples[kind])
                    rows.append((b, kind, np.percentile(t, 50), np.percentile(t, 99)))
                    print(f"B={b:<4} {kind:<14} p50 {rows[-1][2]:.3f} ms  p99 {rows[-1][3]:.3f} ms", flush=True)
            rtt = {k: publish_rtt(clusters[k], n) for k in ("nats-r1", "nats-r3")}
            if args.latency_only:
                base = {b: p50 for b, k, p50, _ in rows if k == "sqlite-full"}
                for b, k, p50, _ in rows:
                    print(f"B={b:<4} {k:<14} {p50 / base[b]:.2f}x of sqlite-full")
                for k, v in rtt.items():
                    print(f"{k}: publish on the loop {v[0]:.3f} ms, through the link {v[1]:.3f} ms, "
                          f"direct {v[2]:.3f} ms, empty hop {v[3]:.3f} ms")
                return 0
            clusters["nats-r1"].stop()
            cluster = clusters["nats-r3"]
            system = HASystem(tmp / "managers", cluster.url, "bench" + uuid.uuid4().hex[:6],
                              extra=("--nats-replicas", "3"))
            system.start()
            try:
                takeovers = kill_loop(system, kills, np.random.default_rng(14), load_seconds=(0.3, 1.5),
                                      on_kill=lambda t: print(f"kill {t.kill}: epoch {t.old_epoch} -> {t.new_epoch}, "
                                                              f"failover {t.failover_seconds:.3f} s, lost {t.lost}, "
                                                              f"duplicated {t.duplicated}", flush=True))
                try:
                    pauses = paused_leader(system, 3 if not args.quick else 1)
                except Exception as err:          # report what happened rather than lose the run
                    pauses = [f"FAILED: {type(err).__name__}: {err}"]
                print(*pauses, sep="\n", flush=True)
                try:
                    node_loss = nats_node_loss(system, cluster)
                except Exception as err:
                    node_loss = f"FAILED: {type(err).__name__}: {err}"
                print(node_loss, flush=True)
                acked = sum(ld.acked for ld in system.loaders)
                stale = sum(ld.client.stale_replies for ld in system.loaders)
            finally:
                system.stop()
        finally:
            for c in clusters.values():
                c.stop()
    write_report(args, rows, rtt, takeovers, pauses, node_loss, acked, stale, lease, n, rounds)
    return 0


def write_report(args: argparse.Namespace, rows: list, rtt: dict[str, tuple[float, float, float, float]],
                 takeovers: list, pauses: list[str], node_loss: str, acked: int, stale: int, lease: LeaseConfig,
                 n: int, rounds: int) -> None:
    f = np.array([t.failover_seconds for t in takeovers])
    base = {b: p50 for b, k, p50, _ in rows if k == "sqlite-full"}
    load = os.getloadavg()[0]
    busy = max(load, args.load_at_start) > (os.cpu_count() or 1)
    shared = (" (above the CPU count: besides the bench's own NATS servers, managers and clients, other jobs "
              "may have run: compare rows of this run)") if busy else ""
    lines = [
        "# Replicated manager: failover and journal cost", "",
        f"{datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{_nats_version()}; every server on loopback. Command: `python bench/bench_ha.py"
        f"{' --quick' if args.quick else ''}{f' --kills {args.kills}' if args.kills else ''}`. 1-minute load "
        f"average at the start {args.load_at_start:.1f}, at the end {load:.1f}"
        f"{shared}.", "",
        "## Failover", "",
        f"Two managers (`kvservice serve --state nats://... --nats-replicas 3`, default lease: TTL "
        f"{lease.ttl_seconds:g} s, renewed every {lease.renew_seconds:g} s, standby looks every "
        f"{lease.poll_seconds:g} s) on a 3-node NATS JetStream cluster; three scheduler-like clients "
        "(`kvservice.client.ha.LeaderClient` over both addresses, 2 s deadline, retries with backoff 20-250 ms) "
        "doing random "
        "admissions, extensions and frees. "
        f"The leader is killed -9 {len(takeovers)} times, each after a random 0.3-1.5 s of load; the killed "
        "process is restarted at once and becomes the standby. Failover = kill to the first Step acknowledged by "
        "the new leader (as the clients see it, retries included). After every takeover the clients pause, the "
        "replicated state is recovered read-only from NATS, every invariant is checked, and each client's "
        "sequences are compared exactly with what it was acknowledged.", "",
        "| kills | failover p50 | p99 | max | min | lost acknowledged steps | duplicated | acknowledged steps |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(takeovers)} | {np.percentile(f, 50):.2f} s | {np.percentile(f, 99):.2f} s | {f.max():.2f} s | "
        f"{f.min():.2f} s | {sum(t.lost for t in takeovers)} | {sum(t.duplicated for t in takeovers)} | {acked} |",
        "", f"Invariants held after all {len(takeovers)} takeovers; epochs rose by one each time "
        f"({takeovers[0].old_epoch} to {takeovers[-1].new_epoch}); replies refused by clients as coming from a "
        f"lower epoch: {stale}.", "",
        "Paused leader (SIGSTOP past its lease while a Step waits in its socket, then SIGCONT):", "",
        *[f"- {p}" for p in pauses], "",
        "NATS node loss (kill -9 of one of three NATS servers mid-run):", "", f"- {node_loss}", "",
        "## Step latency: replicated journal against SQLite", "",
        f"Decode Step over gRPC (each of B sequences of 512+ tokens gains one token; page tables returned; 32 "
        f"layers, page 16; a request_id each), {n} steps per row ({rounds} rounds of {n // rounds}, configurations "
        "interleaved, 50 warm-up steps each, a fresh manager and state each round). NATS rows: one replicated "
        "manager holding the lease (its standby would run on another node).", "",
        "| B | journal | p50 ms | p99 ms | p50 vs SQLite sync=full |", "|---:|---|---:|---:|---:|"]
    for b, k, p50, p99 in rows:
        lines.append(f"| {b} | {NAMES[k]} | {p50:.3f} | {p99:.3f} | {p50 / base[b]:.2f}x |")
    lines += ["", f"Where the NATS journal's share goes ({n} publishes of 300 bytes, each awaited; p50 ms). A journal "
              "append uses the direct connection (kvservice/state/nats/direct.py: the appending thread sends and waits "
              "for the acknowledgement itself); the nats-py columns are the path it replaced:", "",
              "| cluster | nats-py, awaited on its loop | nats-py through NatsLink.call (sync caller) | "
              "direct connection (sync caller) | an empty NatsLink.call (thread hop) |", "|---|---:|---:|---:|---:|"]
    for k, (in_loop, hop, direct, empty) in rtt.items():
        lines.append(f"| {NAMES[k].removeprefix('NATS JetStream, ')} | {in_loop:.3f} | {hop:.3f} | {direct:.3f} | "
                     f"{empty:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def _nats_version() -> str:
    import subprocess

    from tests.natsutil import NATS_SERVER
    try:
        return subprocess.run([NATS_SERVER, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, TypeError, subprocess.SubprocessError):
        return "nats-server ?"


if __name__ == "__main__":
    sys.exit(main())
