"""Cost of durability: decode Step latency with and without the journal, in-process and over gRPC.

Writes a markdown report (default bench/results/durability.md): Step p50/p99 at B=64 and
B=256 (one token per sequence, tables returned) for
  - no journal (ManagerAPI.Step called directly; in-process only),
  - the in-memory journal (`--state memory`: the journal lock and the request-id window),
  - the SQLite journal, sync=normal (survives kill -9) and sync=full (fsync per commit: survives power loss),
plus the time of one snapshot and of a recovery replaying a journal tail, and, for a pool at the
default maximum size (Limits.max_pool_slots slots), idle and nearly full: snapshot bytes, the pause
(journal lock held to capture it), the encode + write time (outside the lock), the largest latency of
another pool's Steps while snapshots run, and the time a restart takes to recover it.
Every journaled Step carries a request_id, as the clients send it. Timings are measured, never asserted.
--mark-only measures only what the acknowledged high-water mark (state dir ACKED, docs/DURABILITY.md)
costs a decode Step at sync=full, B=1 and B=256, in-process and over gRPC: without it, with it, and with
the sequential design not taken, three state dirs stepping alternately in one run; it rewrites that
section of the report.
Usage: python bench/bench_durability.py [--out FILE] [--quick] [--mark-only]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.contract.wire import to_tensor  # noqa: E402
from kvservice.manager.api import ManagerAPI  # noqa: E402
from kvservice.manager.pools import BlockManager  # noqa: E402
from kvservice.server.app import serve  # noqa: E402
from kvservice.server.limits import Limits  # noqa: E402
from kvservice.server.metrics import ManagerMetrics  # noqa: E402
from kvservice.server.servicer import BlockManagerServicer  # noqa: E402
from kvservice.state.ackmark import AckMark  # noqa: E402
from kvservice.state.journal import Journal, JournalConfig  # noqa: E402
from kvservice.state.startup import create_request  # noqa: E402
from kvservice.v1 import block_manager_pb2 as pb  # noqa: E402
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402

SPEC = CacheSpec.uniform(32, 8, 128, "float16", 16)     # Llama-3-8B-like, per-layer layout
BATCHES = (64, 256)
PROMPT = 512                                            # tokens each sequence starts with


def _admit(b: int) -> pb.StepRequest:
    return pb.StepRequest(pool="bench", admit_seq_ids=to_tensor(np.arange(b, dtype=np.uint64)),
                          admit_num_tokens=to_tensor(np.full(b, PROMPT, dtype=np.int64)))


def _decode(b: int) -> Callable[[], pb.StepRequest]:
    ids, ones = to_tensor(np.arange(b, dtype=np.uint64)), to_tensor(np.ones(b, dtype=np.int64))

    def make() -> pb.StepRequest:
        return pb.StepRequest(pool="bench", extend_seq_ids=ids, extend_num_tokens=ones, request_id=uuid.uuid4().hex)
    return make


def _pool_request(b: int) -> pb.CreatePoolRequest:
    return create_request("bench", SPEC, Sizing(max_batch=b, max_seq_len=4096), ())


def _times(step: Callable[[pb.StepRequest], object], make: Callable[[], pb.StepRequest], n: int) -> np.ndarray:
    for _ in range(min(50, n)):
        step(make())
    out = np.empty(n)
    for i in range(n):
        req = make()
        t0 = time.perf_counter()
        step(req)
        out[i] = time.perf_counter() - t0
    return out


def _journal(kind: str, tmp: str) -> Journal:
    if kind == "memory":
        return Journal(BlockManager())
    return Journal.open(Path(tmp) / kind, config=JournalConfig(sync=kind))


def in_process(b: int, kind: str, n: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "none":
            api = ManagerAPI(BlockManager())
            api.CreatePool(_pool_request(b))
            api.Step(_admit(b))
            return _times(api.Step, _decode(b), n)
        j = _journal(kind, tmp)
        try:
            j.execute("CreatePool", _pool_request(b), j.api.CreatePool)
            j.execute("Step", _admit(b), j.api.Step)
            return _times(lambda r: j.execute("Step", r, j.api.Step), _decode(b), n)
        finally:
            j.close(snapshot=False)


def _bare_server() -> tuple[grpc.Server, int]:
    """The servicer as it was before the journal: no journal, no limits, the generated registration."""
    manager = BlockManager()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_send_message_length", 256 << 20)])
    pb_grpc.add_BlockManagerServicer_to_server(
        BlockManagerServicer(ManagerAPI(manager), ManagerMetrics(manager), None), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def over_grpc(b: int, kind: str, n: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "none":
            server, port = _bare_server()
            stop = server.stop
        else:
            running = serve(journal=_journal(kind, tmp))
            port, stop = running.port, running.stop
        try:
            return grpc_step_times(port, b, n)
        finally:
            stop(0)


def grpc_step_times(port: int, b: int, n: int) -> np.ndarray:
    """Seconds per decode Step of b sequences (n timed) against the manager at 127.0.0.1:port."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 256 << 20)])
    try:
        stub = pb_grpc.BlockManagerStub(channel)
        stub.CreatePool(_pool_request(b), timeout=30)
        stub.Step(_admit(b), timeout=30)
        return _times(lambda r: stub.Step(r, timeout=30), _decode(b), n)
    finally:
        channel.close()


class _SequentialMark(AckMark):
    """The design not taken: the mark's pwrite and fdatasync on the reply's path (exact, one more fsync per Step)."""

    def advance(self, lineage: int, seq: int) -> None:
        os.pwrite(self._fd, self.record(lineage, seq), (seq & 1) * self.SLOT)   # type: ignore[arg-type]
        os.fdatasync(self._fd)                                                   # type: ignore[arg-type]


MARK_KINDS = ("without", "with", "sequential")


def mark_times(where: str, b: int, n: int) -> dict[str, np.ndarray]:
    """Seconds per decode Step at sync=full without the high-water mark, with it, and with a sequential one, in-process
    or over gRPC: three state dirs side by side, their Steps alternating one by one (all see the same machine)."""
    with tempfile.TemporaryDirectory() as tmp:
        journals = {k: Journal.open(Path(tmp) / k, config=JournalConfig(sync="full")) for k in MARK_KINDS}
        kept = {k: j.store.mark for k, j in journals.items()}
        journals["without"].store.mark = None       # what every commit cost before the mark
        seq_mark = _SequentialMark(kept["sequential"].path)      # type: ignore[union-attr]
        journals["sequential"].store.mark = seq_mark
        stops, steps = [], {}
        try:
            for k, j in journals.items():
                if where == "in-process":
                    j.execute("CreatePool", _pool_request(b), j.api.CreatePool)
                    j.execute("Step", _admit(b), j.api.Step)
                    steps[k] = lambda r, j=j: j.execute("Step", r, j.api.Step)
                else:
                    running = serve(journal=j)
                    stops.append(running.stop)
                    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
                    stops.append(lambda _grace, channel=channel: channel.close())
                    stub = pb_grpc.BlockManagerStub(channel)
                    stub.CreatePool(_pool_request(b), timeout=30)
                    stub.Step(_admit(b), timeout=30)
                    steps[k] = lambda r, stub=stub: stub.Step(r, timeout=30)
            make = _decode(b)
            out = {k: np.empty(n) for k in steps}
            for i in range(-50, n):                  # 50 warm-up rounds
                for k in (MARK_KINDS if i % 2 else MARK_KINDS[::-1]):
                    req = make()
                    t0 = time.perf_counter()
                    steps[k](req)
                    if i >= 0:
                        out[k][i] = time.perf_counter() - t0
            return out
        finally:
            for k, j in journals.items():
                j.store.mark = kept[k]
            seq_mark.close()
            for stop in reversed(stops):
                stop(0)
            if where == "in-process":
                for j in journals.values():
                    j.close(snapshot=False)


MARK_BATCHES = (1, 256)
MARK_BEGIN, MARK_END = "<!-- ackmark: begin -->", "<!-- ackmark: end -->"


def mark_section(n: int) -> list[str]:
    """The report section on the high-water mark's cost."""
    rows = []
    for where in ("in-process", "gRPC"):
        for b in MARK_BATCHES:
            t = {k: v * 1e3 for k, v in mark_times(where, b, n).items()}
            p50 = {k: np.percentile(v, 50) for k, v in t.items()}
            p99 = {k: np.percentile(v, 99) for k, v in t.items()}
            paired = {k: np.median(t[k] - t["without"]) for k in ("with", "sequential")}
            rows.append((where, b, p50, p99, paired, os.getloadavg()[0]))
            print(f"mark {where:<10} B={b:<4} p50 without {p50['without']:.3f} ms, with {p50['with']:.3f} ms (paired "
                  f"{paired['with'] * 1e3:+.0f} us), sequential {p50['sequential']:.3f} ms (paired "
                  f"{paired['sequential'] * 1e3:+.0f} us)", flush=True)
    lines = [MARK_BEGIN, "## The acknowledged high-water mark", "",
             f"`python bench/bench_durability.py --mark-only` ({datetime.date.today()}, {platform.node()}, "
             f"{os.cpu_count()} CPUs; state dirs on {tempfile.gettempdir()}): a decode Step at sync=full without "
             "the high-water mark `ACKED`, with it (a 40-byte pwrite and an fdatasync on its writer thread, "
             "overlapping the next commit; kvservice/state/ackmark.py, docs/DURABILITY.md), and with the design "
             "not taken (the same write and fdatasync on the reply's path). Three state dirs side by side, their "
             f"Steps alternating one by one, {n} of each per row after 50 warm-up rounds; \"paired\" is the "
             "median of the per-round differences from the row's Step without the mark.", "",
             "| path | B | p50 without | p50 with | paired cost | p50 sequential | paired cost | p99 without / with / "
             "sequential | load average |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for where, b, p50, p99, paired, load in rows:
        lines.append(f"| {where} | {b} | {p50['without']:.3f} ms | {p50['with']:.3f} ms | "
                     f"{paired['with'] * 1e3:+.0f} µs | {p50['sequential']:.3f} ms | "
                     f"{paired['sequential'] * 1e3:+.0f} µs | {p99['without']:.2f} / {p99['with']:.2f} / "
                     f"{p99['sequential']:.2f} ms | {load:.0f} |")
    return [*lines, MARK_END]


def write_mark_section(out: Path, section: list[str]) -> None:
    text = out.read_text() if out.exists() else ""
    block = "\n".join(section)
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        text = head + block + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    out.write_text(text)


def snapshot_and_recovery(b: int, entries: int) -> tuple[float, int, float]:
    """(seconds for one snapshot, its bytes, seconds to recover `entries` journaled decode steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        j = Journal.open(tmp, config=JournalConfig(sync="normal", compact_every=10**9))
        j.execute("CreatePool", _pool_request(b), j.api.CreatePool)
        j.execute("Step", _admit(b), j.api.Step)
        t0 = time.perf_counter()
        j.snapshot()
        snap = time.perf_counter() - t0
        size = j.snapshot_bytes
        make = _decode(b)
        for _ in range(entries):
            j.execute("Step", make(), j.api.Step)
        j.close(snapshot=False)
        t0 = time.perf_counter()
        Journal.open(tmp, config=JournalConfig(sync="normal")).close(snapshot=False)
        return snap, size, time.perf_counter() - t0


def big_pool(rounds: int) -> list[tuple]:
    """Snapshots of a pool at the default maximum size, idle then nearly full, under a concurrent Step load.

    Returns rows (state, snapshot bytes, largest pause ms, encode + write ms, probe Step p50 ms, probe Step
    max ms between snapshots, probe Step max ms during snapshots, recovery s). The probe: decode Steps of 64
    sequences on another pool, nonstop.
    """
    slots = Limits().max_pool_slots
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = JournalConfig(sync="normal", compact_every=10**9)
        j = Journal.open(Path(tmp) / "big", config=config)
        j.execute("CreatePool", create_request("big", SPEC, Sizing(num_slots=slots), ()), j.api.CreatePool)
        j.execute("CreatePool", create_request("probe", SPEC, Sizing(max_batch=64, max_seq_len=4096), ()),
                  j.api.CreatePool)
        j.execute("Step", pb.StepRequest(pool="probe", admit_seq_ids=to_tensor(np.arange(64, dtype=np.uint64)),
                                         admit_num_tokens=to_tensor(np.full(64, 16, dtype=np.int64))), j.api.Step)
        ones = to_tensor(np.ones(64, dtype=np.int64))
        lat: list[tuple[float, float]] = []
        stop = threading.Event()

        def probe() -> None:
            base, n = 0, 0
            while not stop.is_set():
                ids = np.arange(base, base + 64, dtype=np.uint64)
                n += 1
                if n % 200:                                  # decode; every 200 steps, fresh sequences
                    req = pb.StepRequest(pool="probe", extend_seq_ids=to_tensor(ids), extend_num_tokens=ones)
                else:
                    base += 64
                    req = pb.StepRequest(pool="probe", free_seq_ids=to_tensor(ids), admit_num_tokens=ones,
                                         admit_seq_ids=to_tensor(ids + np.uint64(64)))
                req.request_id = uuid.uuid4().hex
                t0 = time.perf_counter()
                j.execute("Step", req, j.api.Step)
                lat.append((t0, time.perf_counter() - t0))

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        for state in ("idle", "nearly full"):
            if state == "nearly full":                  # 15 x 1024 sequences of 1024 pages: 94% of the slots
                pages = 1024
                for k in range(15):
                    ids = np.arange(k * 1024, (k + 1) * 1024, dtype=np.uint64) + 10**6
                    j.execute("Step", pb.StepRequest(pool="big", admit_seq_ids=to_tensor(ids), omit_tables=True,
                                                     admit_num_tokens=to_tensor(np.full(1024, pages * 16 - 3,
                                                                                        dtype=np.int64))),
                              j.api.Step)
            time.sleep(0.5)
            lat.clear()                                 # the probe's waits for the fill above do not count
            time.sleep(0.5)
            windows, pauses, writes = [], [], []
            for _ in range(rounds):
                if state == "nearly full":                 # busy: the big pool changes before every snapshot
                    ids = np.arange(1024, dtype=np.uint64) + 10**6
                    j.execute("Step", pb.StepRequest(pool="big", extend_seq_ids=to_tensor(ids), omit_tables=True,
                                                     extend_num_tokens=to_tensor(np.ones(1024, dtype=np.int64))),
                              j.api.Step)
                t0 = time.perf_counter()
                j.snapshot()
                windows.append((t0, time.perf_counter()))
                pauses.append(j.snapshot_pause_seconds)
                writes.append(j.snapshot_seconds)
                time.sleep(0.3)
            during = [d for t, d in lat if any(a <= t + d and t <= b for a, b in windows)]
            base = [d for t, d in lat if not any(a - 0.05 <= t + d and t <= b + 0.05 for a, b in windows)]
            rows.append([state, j.snapshot_bytes, 1e3 * max(pauses), 1e3 * float(np.median(writes)),
                         1e3 * float(np.percentile(base, 50)), 1e3 * max(base), 1e3 * max(during), 0.0])
            lat.clear()
        stop.set()
        thread.join()
        j.close(snapshot=True)                          # what a restart of a stopped manager loads
        t0 = time.perf_counter()
        Journal.open(Path(tmp) / "big", config=config).close(snapshot=False)
        rows[-1][-1] = time.perf_counter() - t0
        idle = Journal.open(Path(tmp) / "idle", config=config)
        idle.execute("CreatePool", create_request("big", SPEC, Sizing(num_slots=slots), ()), idle.api.CreatePool)
        idle.close(snapshot=True)
        t0 = time.perf_counter()
        Journal.open(Path(tmp) / "idle", config=config).close(snapshot=False)
        rows[0][-1] = time.perf_counter() - t0
    return [tuple(r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/durability.md"))
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--mark-only", action="store_true", help="only the high-water mark's cost (its section)")
    args = ap.parse_args(argv)
    n, rounds = (200, 2) if args.quick else (1200, 4)
    if args.mark_only:
        write_mark_section(Path(args.out), mark_section(n))
        print(f"wrote {args.out}")
        return 0
    rows = []
    for where, fn, kinds in (("in-process", in_process, ("none", "memory", "normal", "full")),
                             ("gRPC", over_grpc, ("none", "memory", "normal", "full"))):
        for b in BATCHES:
            samples: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
            for _ in range(rounds):                      # configurations interleaved: machine drift hits all alike
                for kind in kinds:
                    samples[kind].append(fn(b, kind, n // rounds) * 1e3)
            for kind in kinds:
                t = np.concatenate(samples[kind])
                rows.append((where, b, kind, np.percentile(t, 50), np.percentile(t, 99)))
                print(f"{where:<10} B={b:<4} {kind:<7} p50 {rows[-1][3]:.3f} ms  p99 {rows[-1][4]:.3f} ms", flush=True)
    entries = 500 if args.quick else 2000
    recov = [(b, *snapshot_and_recovery(b, entries)) for b in BATCHES]
    big = big_pool(2 if args.quick else 4)
    for row in big:
        print("big pool", row, flush=True)
    names = {"none": "no journal", "memory": "memory journal (`--state memory`)",
             "normal": "SQLite, sync=normal", "full": "SQLite, sync=full (default)"}
    lines = [
        "# Durability cost", "",
        f"{datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; state dir on {tempfile.gettempdir()}. "
        f"Command: `python bench/bench_durability.py{' --quick' if args.quick else ''}`.", "",
        f"Decode Step (each of B sequences of {PROMPT}+ tokens gains one; page tables returned; "
        f"{SPEC.num_layers if hasattr(SPEC, 'num_layers') else len(SPEC.layers)} layers, page 16), "
        f"{n} steps per row ({rounds} rounds of {n // rounds}, configurations interleaved, 50 warm-up steps "
        "each). Each journaled Step carries a request_id.", "",
        "| path | B | journal | p50 ms | p99 ms | p50 cost vs baseline |", "|---|---:|---|---:|---:|---:|"]
    base = {(w, b): p50 for w, b, k, p50, _ in rows if k == "none"}
    for w, b, k, p50, p99 in rows:
        extra = p50 - base[(w, b)]
        lines.append(f"| {w} | {b} | {names[k]} | {p50:.3f} | {p99:.3f} | "
                     f"{'baseline' if abs(extra) < 1e-12 else f'{extra * 1e3:+.0f} µs'} |")
    lines += ["", "No journal over gRPC = the servicer before issue 6 (no journal, no limits, generated handler "
              "registration); `kvservice serve` always has at least the memory journal (idempotent retries), "
              "request limits and the lenient request parser.", "",
              "| B | snapshot (capture + encode + write) | snapshot bytes | recovery of a "
              f"{entries}-entry tail (replay) |", "|---:|---:|---:|---:|"]
    for b, snap, size, rec in recov:
        lines.append(f"| {b} | {snap * 1e3:.1f} ms | {size:,} | {rec:.2f} s ({rec / entries * 1e3:.2f} ms/entry) |")
    slots = Limits().max_pool_slots
    lines += ["", f"A pool at the default maximum size ({slots:,} slots, `--max-pool-slots`), idle and then with "
              "15,360 sequences holding 94% of its slots (and changed before every snapshot); meanwhile another pool "
              "takes decode Steps (B=64) without pause. Pause = the journal lock held to capture the snapshot: "
              "array copies of the pools changed since the last snapshot (the idle pool's only after it was "
              "created; unchanged pools reuse the last snapshot's arrays). Every mutating call waits for it, reads "
              "of other pools do not. Encode + write runs outside the lock. "
              "Restart = `Journal.open` of the stopped state dir (decode, invariant checks, rebuild). Before "
              "issue 11 the idle pool's snapshot was 420 MB and 9 s, all of it under the lock (max Step 11 s).", "",
              "| big pool | snapshot bytes | largest pause | encode + write | probe Step p50 | probe Step max, "
              "between snapshots | probe Step max, during snapshots | restart recovery |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for state, size, pause, write, p50, calm, worst, rec in big:
        lines.append(f"| {state} | {size:,} | {pause:.1f} ms | {write:.0f} ms | {p50:.2f} ms | {calm:.1f} ms | "
                     f"{worst:.1f} ms | {f'{rec:.2f} s' if rec else '-'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    old = Path(args.out).read_text() if Path(args.out).exists() else ""
    tail = old[old.index("<!-- bench_limits: begin -->"):] if "<!-- bench_limits: begin -->" in old else ""
    Path(args.out).write_text("\n".join(lines) + "\n\n" + "\n".join(mark_section(n)) + "\n"
                              + ("\n" + tail if tail else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
