"""Cost of durability: decode Step latency with and without the journal, in-process and over gRPC.

Writes a markdown report (default bench/results/durability.md): Step p50/p99 at B=64 and
B=256 (one token per sequence, tables returned) for
  - no journal (ManagerAPI.Step called directly; in-process only),
  - the in-memory journal (`--state memory`: the journal lock and the request-id window),
  - the SQLite journal, sync=normal (survives kill -9) and sync=full (fsync per commit: survives power loss),
plus the time of one snapshot and of a recovery replaying a journal tail.
Every journaled Step carries a request_id, as the clients send it. Timings are measured, never asserted.
Usage: python bench/bench_durability.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from kvservice.api import ManagerAPI  # noqa: E402
from kvservice.geometry import CacheSpec  # noqa: E402
from kvservice.journal import Journal, JournalConfig, create_request  # noqa: E402
from kvservice.manager import BlockManager  # noqa: E402
from kvservice.metrics import ManagerMetrics  # noqa: E402
from kvservice.planner import Sizing  # noqa: E402
from kvservice.server import serve  # noqa: E402
from kvservice.servicer import BlockManagerServicer  # noqa: E402
from kvservice.v1 import block_manager_pb2 as pb  # noqa: E402
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc  # noqa: E402
from kvservice.wire import to_tensor  # noqa: E402

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
        channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                        options=[("grpc.max_receive_message_length", 256 << 20)])
        try:
            stub = pb_grpc.BlockManagerStub(channel)
            stub.CreatePool(_pool_request(b), timeout=30)
            stub.Step(_admit(b), timeout=30)
            return _times(lambda r: stub.Step(r, timeout=30), _decode(b), n)
        finally:
            channel.close()
            stop(0)


def snapshot_and_recovery(b: int, entries: int) -> tuple[float, int, float]:
    """(seconds for one snapshot, its bytes, seconds to recover `entries` journaled decode steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        j = Journal.open(tmp, config=JournalConfig(sync="normal", compact_every=10**9))
        j.execute("CreatePool", _pool_request(b), j.api.CreatePool)
        j.execute("Step", _admit(b), j.api.Step)
        t0 = time.perf_counter()
        j.snapshot()
        snap = time.perf_counter() - t0
        size = j.store.db.execute("SELECT length(state) FROM snapshots").fetchone()[0]
        make = _decode(b)
        for _ in range(entries):
            j.execute("Step", make(), j.api.Step)
        j.close(snapshot=False)
        t0 = time.perf_counter()
        Journal.open(tmp, config=JournalConfig(sync="normal")).close(snapshot=False)
        return snap, size, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/durability.md"))
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    args = ap.parse_args(argv)
    n, rounds = (200, 2) if args.quick else (1200, 4)
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
              "| B | snapshot (pickle + write) | snapshot bytes | recovery of a "
              f"{entries}-entry tail (replay) |", "|---:|---:|---:|---:|"]
    for b, snap, size, rec in recov:
        lines.append(f"| {b} | {snap * 1e3:.1f} ms | {size:,} | {rec:.2f} s ({rec / entries * 1e3:.2f} ms/entry) |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
