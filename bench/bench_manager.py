"""Manager benchmarks: allocator throughput, decode Step in-process, over unary gRPC and over StepStream
(full and incremental tables) vs the unary and streaming echo floors, and 16 concurrent schedulers.

Writes a markdown report (default bench/results/manager.md). Timings are
measured, never asserted; compare the ratios measured in one run.
Usage: python bench/bench_manager.py [--out FILE] [--quick]
       python bench/bench_manager.py --stream [--batches 1,256] [--rounds 8]: only StepStream deltas vs EchoStream
       (the issue 12 ratio) and the in-process breakdown, printed (and written to --out if given); about 20 s.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.received import Received  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.core.allocator import SlotAllocator  # noqa: E402
from kvservice.core.planner import plan  # noqa: E402
from kvservice.core.pool import Pool  # noqa: E402
from kvservice.tools.launch import wait_for_ports  # noqa: E402

SPEC = CacheSpec.uniform(32, 8, 128, "float16", 16)     # Llama-3-8B-like, per-layer layout
BATCHES = (1, 64, 256, 1024)


class DequeAllocator:
    """Baseline in the style of nano-vllm / vLLM's free-block queue: Python objects per block."""

    def __init__(self, n: int) -> None:
        self.free_ids = collections.deque(range(n))
        self.ref_count = [0] * n

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.free_ids.popleft()
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_ids.append(b)


def rate(fn, n_blocks: int, seconds: float) -> float:
    """Blocks per second (allocated and freed) over repeated cycles for `seconds`."""
    for _ in range(100):
        fn()
    cycles, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(100):
            fn()
        cycles += 100
    return cycles * n_blocks / elapsed


def bench_allocator(seconds: float) -> list[tuple[str, float]]:
    a = SlotAllocator(1 << 20)
    d = DequeAllocator(1 << 20)
    return [
        ("SlotAllocator, pool path (free of a sequence's own slots)", rate(lambda: a.free(a.allocate(512), unique=True),
                                                                        512, seconds)),
        ("SlotAllocator, checked public free (range + repeat checks)", rate(lambda: a.free(a.allocate(512)), 512,
                                                                         seconds)),
        ("Python deque + refcount list (nano-vllm/vLLM style baseline)", rate(lambda: d.free(d.allocate(512)), 512,
                                                                            seconds)),
    ]


def percentiles(samples: list[float]) -> tuple[float, float]:
    a = np.array(samples) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def decode_pool(b: int, steps: int, seed: int = 0) -> tuple[Pool, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    ctx = rng.integers(256, 1024, b)
    slots = int((-(-(ctx + steps) // 16)).sum()) + b + (1024 + steps) // 16
    pool = Pool("bench", plan(SPEC, Sizing(num_slots=slots, max_seq_len=1024 + steps)))
    ids = np.arange(1, b + 1, dtype=np.uint64)
    pool.step(admit_ids=ids, admit_tokens=ctx)
    return pool, ids, int(ctx.sum())


def bench_step_inprocess(steps: int) -> list[tuple[int, float, float, int]]:
    out = []
    for b in BATCHES:
        pool, ids, _ = decode_pool(b, steps)
        ones = np.ones(b, dtype=np.int64)
        lat = []
        for _ in range(steps):
            t0 = time.perf_counter()
            r = pool.step(extend_ids=ids, extend_tokens=ones)
            lat.append(time.perf_counter() - t0)
        p50, p99 = percentiles(lat[steps // 10:])
        out.append((b, p50, p99, len(r.tables[0].table.indices)))
    return out


def start_server(tmp: Path, metrics: bool = False) -> tuple[subprocess.Popen, str]:
    """A `kvservice serve` process on a free port; metrics: also serve /metrics (its port: METRICS_PORT[target])."""
    port_file = tmp / "ports"
    cpus = SERVER_CPUS
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0",
                             "--metrics-port", "0" if metrics else "-1", "--no-pools", "--port-file", str(port_file),
                             "--log-level", "WARNING"], cwd=ROOT,
                            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    port, metrics_port = wait_for_ports(proc, port_file, 30, what="manager")
    METRICS_PORT[f"127.0.0.1:{port}"] = metrics_port
    return proc, f"127.0.0.1:{port}"


METRICS_PORT: dict[str, int] = {}
SERVER_CPUS: set[int] | None = None     # --pin: the manager process's CPUs (None: the scheduler's, all by default)


def served_step_seconds(target: str) -> tuple[float, float]:
    """(sum of seconds, count) of the manager's kvservice_rpc_duration_seconds{method="Step"} (every status code):
    each StepStream request's server-side time (stream.step_one) as measured inside the serving process."""
    import re
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT[target]}/metrics", timeout=10).read().decode()
    got = [sum(float(v) for v in re.findall(r"kvservice_rpc_duration_seconds_" + k +
                                           r'\{code="[A-Z_]+",method="Step"\} (\S+)', text))
           for k in ("sum", "count")]
    return got[0], got[1]


MODES = ("unary Step", "StepStream, full tables", "StepStream, deltas")


def _decode_pools(c: BlockManagerClient, b: int, steps: int, tag: str, modes: int = len(MODES)) -> np.ndarray:
    """Pools TAGb{B}m{0..modes-1} holding the same B sequences (contexts uniform in [256, 1024)); returns their ids."""
    rng = np.random.default_rng(0)
    ctx = rng.integers(256, 1024, b)
    slots = int((-(-(ctx + steps) // 16)).sum()) + b + (1024 + steps) // 16
    ids = np.arange(1, b + 1, dtype=np.uint64)
    for m in range(modes):
        c.create_pool(f"{tag}b{b}m{m}", SPEC, Sizing(num_slots=slots, max_seq_len=1024 + steps))
        c.step(f"{tag}b{b}m{m}", admit=ids, admit_tokens=ctx, tables=False)
    return ids


def _unary_reply_bytes(c: BlockManagerClient, pool: str, ids: np.ndarray) -> int:
    """Bytes of one decode Step reply with full tables (the stub called directly, to size the reply)."""
    from kvservice.client import codec
    req = codec.step_request(pool, extend=ids, extend_tokens=1)
    req.request_id = "size-" + pool
    return c._stub.Step(req, timeout=30).ByteSize()


def _decode_calls(c: BlockManagerClient, es: object, b: int, ids: np.ndarray, streams: dict) -> dict:
    """The timed calls of one batch size: a decode step per mode, and both echo floors."""
    names = [f"tb{b}m{m}" for m in range(len(MODES))]
    return {0: lambda: c.step(names[0], extend=ids, extend_tokens=1),
            1: lambda: streams[1].step(extend=ids, extend_tokens=1),
            2: lambda: streams[2].step(extend=ids, extend_tokens=1),
            "Echo": c.echo, "EchoStream": es.echo}   # type: ignore[attr-defined]


def bench_transport(steps: int, rounds: int = 8, batches: tuple[int, ...] = BATCHES,
                    modes: tuple[int, ...] = (0, 1, 2), sized_echo: bool = False,
                    served: dict[int, float] | None = None) -> tuple[list[tuple], dict[str, tuple[float, float]]]:
    """Decode steps over a manager process: unary Step, StepStream with full tables and with deltas, and the
    unary and streaming Echo floors, interleaved in rounds so that machine noise hits every mode alike.

    sized_echo: also EchoStream round trips whose payload is as long as a delta request of B ("sized{B}").
    served: filled with B -> mean us of a Step request inside the manager process during the timed rounds
        (its /metrics histogram); only with modes (2,), where nothing else observes method="Step".
    Returns ([(B, mode, p50 us, p99 us, reply bytes)], {"Echo": (p50, p99), "EchoStream": (p50, p99), ...}).
    """
    per_round = max(1, steps // rounds)
    rows: list[tuple] = []
    echo: dict[str, list[float]] = {"Echo": [], "EchoStream": []}
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_server(Path(tmp), metrics=served is not None)
        try:
            with BlockManagerClient(target, timeout=30) as c, c.echo_stream() as es:
                c.wait_ready()
                for b in batches:
                    ids = _decode_pools(c, b, steps + 20, "t")
                    streams = {1: c.step_stream(f"tb{b}m1", deltas=False), 2: c.step_stream(f"tb{b}m2")}
                    calls = {k: fn for k, fn in _decode_calls(c, es, b, ids, streams).items() if k not in (0, 1, 2)
                             or k in modes}
                    if sized_echo:      # EchoStream carrying as many bytes as a delta request: same transport
                        pad = bytes(len(streams[2].request_bytes(None, ids, 1, None, None, True, False, {})))
                        streams[2].seq -= 1
                        calls["sized"] = lambda pad=pad: es.echo(pad)
                    lat: dict = {k: [] for k in calls}
                    for fn in calls.values():              # warm-up: 20 calls each
                        for _ in range(20):
                            fn()
                    before = served_step_seconds(target) if served is not None else None
                    for _ in range(rounds):
                        for k, fn in calls.items():
                            for _ in range(per_round):
                                t0 = time.perf_counter()
                                fn()
                                lat[k].append(time.perf_counter() - t0)
                    if before is not None:
                        assert modes == (2,), "served times need the delta stream alone"
                        after = served_step_seconds(target)
                        served[b] = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e6
                    sizes = {m: _unary_reply_bytes(c, f"tb{b}m0", ids) if m == 0 else streams[m].last_reply.ByteSize()
                             for m in modes}
                    rows += [(b, MODES[m], *percentiles(lat[m]), sizes[m]) for m in modes]
                    if sized_echo:
                        echo[f"sized{b}"] = lat["sized"]
                    echo["Echo"] += lat["Echo"]
                    echo["EchoStream"] += lat["EchoStream"]
                    for st in streams.values():
                        st.close()
        finally:
            proc.terminate()
            proc.wait(10)
    return rows, {k: percentiles(v) for k, v in echo.items()}


def _scheduler(target: str, pool: str, ids: np.ndarray, stream: bool, steps: int, start: object,
               lat: list[float]) -> None:
    """One decode loop of bench_concurrent: its own channel (and stream); latencies appended to lat."""
    with BlockManagerClient(target, timeout=60) as c:
        s = c.step_stream(pool) if stream else None
        fn = (lambda: s.step(extend=ids, extend_tokens=1)) if s else (lambda: c.step(pool, extend=ids,
                                                                                     extend_tokens=1))
        for _ in range(5):
            fn()
        start.wait()          # type: ignore[attr-defined]
        mine = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t0)
        lat.extend(mine)
        if s is not None:
            s.close()


def bench_concurrent(steps: int, schedulers: int = 16, b: int = 64) -> list[tuple[str, float, float]]:
    """Aggregate decode Steps/s of `schedulers` threads, each driving its own pool, unary vs StepStream with deltas.

    Returns [(mode, steps/s, p50 us per step)].
    """
    import threading
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_server(Path(tmp))
        try:
            with BlockManagerClient(target, timeout=60) as c:
                c.wait_ready()
                for mode in ("unary Step", "StepStream, deltas"):
                    tag = "u" if mode.startswith("unary") else "s"
                    lat: list[float] = []
                    start = threading.Barrier(schedulers + 1)
                    threads = [threading.Thread(target=_scheduler, args=(
                        target, f"{tag}{i}xb{b}m0", _decode_pools(c, b, steps + 20, f"{tag}{i}x", 1), tag == "s", steps,
                        start, lat)) for i in range(schedulers)]
                    for t in threads:
                        t.start()
                    start.wait()
                    t0 = time.perf_counter()
                    for t in threads:
                        t.join()
                    elapsed = time.perf_counter() - t0
                    out.append((mode, schedulers * steps / elapsed, percentiles(lat)[0]))
        finally:
            proc.terminate()
            proc.wait(10)
    return out


def bench_stream_breakdown(steps: int, batches: tuple[int, ...] = BATCHES,
                           gap: float = 0.0) -> list[tuple[int, float, float, float, float]]:
    """Where a StepStream decode request's time goes, in-process (no transport): per B, p50 us of
    Pool.step alone (no CSR tables), of the server's whole request (stream.step_one: session, Limits,
    memory journal, step, delta encoding, reply serialization) and of the client's work (request bytes,
    reply parsing, applying the delta to the mirror). The manager is set up as `kvservice serve` sets it up
    (reply size bound, deferred KV events, memory journal, default Limits).
    gap: seconds the thread sleeps before each server request (a served request follows an idle wait).
    Returns [(B, pool step, server, client, reply bytes)].
    """
    from kvservice.client import codec
    from kvservice.client.stream_core import StreamCore
    from kvservice.contract.errors import JournalUnavailable
    from kvservice.contract.transport import MAX_MESSAGE_BYTES
    from kvservice.events.publish import configure_events
    from kvservice.manager.api import ManagerAPI
    from kvservice.manager.event_log import EventsConfig
    from kvservice.manager.pools import BlockManager
    from kvservice.server.limits import Limits
    from kvservice.server.metrics import ManagerMetrics
    from kvservice.server.servicer import BlockManagerServicer
    from kvservice.server.stream import StreamSession, step_one
    from kvservice.state.journal import Journal
    from kvservice.v1 import block_manager_pb2 as pb

    out = []
    for b in batches:
        manager = BlockManager()
        api = ManagerAPI(manager, max_reply_bytes=MAX_MESSAGE_BYTES, fence=True)     # as serve() builds it
        configure_events(manager, EventsConfig())
        sv = BlockManagerServicer(api, ManagerMetrics(manager), Journal(manager), Limits())
        rng = np.random.default_rng(0)
        ctx = rng.integers(256, 1024, b)
        slots = int((-(-(ctx + 2 * steps) // 16)).sum()) + b + 64
        ids = np.arange(1, b + 1, dtype=np.uint64)
        for name in ("s", "p"):
            api.CreatePool(codec.create_pool_request(name, SPEC, Sizing(num_slots=slots, max_seq_len=1024 + 2 * steps)))
            api.Step(codec.step_request(name, admit=ids, admit_tokens=ctx, tables=False))
        session, core = StreamSession("bench"), StreamCore("s", 16, True, "bench")
        def observe(seconds: float, reply: pb.StepReply | None, metrics=sv.metrics) -> None:   # as step_stream's
            metrics.observe_reply("Step", seconds, reply)
        pool = manager.pool_and_lock("p")[0]
        ones = np.ones(b, dtype=np.int64)
        lat: dict[str, list[float]] = {"pool": [], "server": [], "client": []}
        size = 0
        for i in range(steps):
            t0 = time.perf_counter()
            pool.step(extend_ids=ids, extend_tokens=ones, tables=False)
            t1 = time.perf_counter()
            data = core.request_bytes(None, ids, 1, None, None, True, False, {})
            t1b = time.perf_counter()
            if gap:
                time.sleep(gap)
            t2 = time.perf_counter()
            reply = step_one(sv, session, Received(pb.StepRequest.FromString(data), data), JournalUnavailable, observe)
            wire = reply.SerializeToString()
            t3 = time.perf_counter()
            core.result(pb.StepReply.FromString(wire), True, False)
            t4 = time.perf_counter()
            if i >= steps // 10:
                lat["pool"].append(t1 - t0)
                lat["server"].append(t3 - t2)
                lat["client"].append(t4 - t3 + t1b - t1)
            size = len(wire)
        out.append((b, percentiles(lat["pool"])[0], percentiles(lat["server"])[0], percentiles(lat["client"])[0],
                    size))
    return out


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, NumPy {np.__version__}, "
            f"grpcio {__import__('grpc').__version__}")


def stream_only(batches: tuple[int, ...], rounds: int, out: str | None, pin: str | None = None) -> int:
    """The issue 12 ratio alone: StepStream with deltas vs EchoStream (interleaved), and the in-process breakdown.

    pin: "SERVER_CPUS:CLIENT_CPUS" (e.g. "0:1"): the manager and this process on CPUs of their own.
    """
    global SERVER_CPUS
    if pin:
        server, client = ({int(c) for c in part.split(",")} for part in pin.split(":"))
        SERVER_CPUS = server
        os.sched_setaffinity(0, client)
    steps = 50 * rounds
    breakdown = bench_stream_breakdown(steps, batches)
    idle = {b: server for b, _, server, _, _ in bench_stream_breakdown(steps, batches, gap=200e-6)}
    served: dict[int, float] = {}
    transport, echo = bench_transport(steps, rounds, batches, modes=(2,), sized_echo=True, served=served)
    e50 = echo["EchoStream"][0]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# StepStream vs EchoStream ({now}, {machine()})", "",
             f"`python bench/bench_manager.py --stream --batches {','.join(map(str, batches))} --rounds {rounds}"
             f"{' --pin ' + pin if pin else ''}`; "
             f"EchoStream p50 {e50:.0f} us (p99 {echo['EchoStream'][1]:.0f}).", "",
             "EchoStream with a payload as long as the StepStream request: the same bytes on the wire both ways, "
             "no work.", "",
             "In-process figures: the server's request and the client's work back to back, and the server's "
             "request after its thread slept 200 us (as a served request follows an idle wait).", "",
             "Served: the mean of the same requests' server-side time (stream.step_one) measured inside the "
             "manager process during the timed rounds (its kvservice_rpc_duration_seconds{method=\"Step\"}).", "",
             "| B | StepStream deltas p50 us | p99 us | / EchoStream p50 | sized EchoStream / EchoStream | "
             "server request us (in-process) | ... after 200 us idle | served, mean us | client us (in-process) | "
             "reply bytes |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    parts = {b: (server, client) for b, _, server, client, _ in breakdown}
    for b, _, p50, p99, size in transport:
        lines.append(f"| {b} | {p50:.0f} | {p99:.0f} | {p50 / e50:.2f}x | {echo[f'sized{b}'][0] / e50:.2f}x | "
                     f"{parts[b][0]:.0f} | {idle[b]:.0f} | {served[b]:.0f} | {parts[b][1]:.0f} | {size:,} |")
    lines.append("")
    print("\n".join(lines))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench/results/manager.md"))
    ap.add_argument("--quick", action="store_true", help="short run (smoke test)")
    ap.add_argument("--stream", action="store_true", help="only StepStream deltas vs EchoStream and the in-process "
                    "breakdown (the issue 12 ratio), printed; written to --out only if it is given")
    ap.add_argument("--batches", default="1,256", help="with --stream: batch sizes")
    ap.add_argument("--rounds", type=int, default=8, help="with --stream: interleaved rounds of 50 steps")
    ap.add_argument("--pin", help="with --stream: SERVER_CPUS:CLIENT_CPUS, e.g. 0:1 (manager and scheduler on "
                    "cores of their own)")
    args = ap.parse_args()
    if args.stream:
        return stream_only(tuple(int(b) for b in args.batches.split(",")), args.rounds,
                           args.out if "--out" in sys.argv else None, args.pin)
    seconds, steps = (0.2, 60) if args.quick else (2.0, 400)
    alloc = bench_allocator(seconds)
    inproc = bench_step_inprocess(steps)
    breakdown = bench_stream_breakdown(steps)
    idle = {b: server for b, _, server, _, _ in bench_stream_breakdown(steps, gap=200e-6)}
    transport, echo = bench_transport(steps)
    concurrent = bench_concurrent(steps // 4)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Manager benchmarks", "",
        f"Run {now} on {machine()}.",
        f"Command: `make bench` (`python bench/bench_manager.py{' --quick' if args.quick else ''}`). "
        "Timings are measured, not asserted; the machines are shared, so compare ratios within this run.", "",
        "## Slot allocation + free, batch 512, in-process", "",
        "| allocator | M blocks/s | vs baseline |", "|---|---:|---:|",
    ]
    base = alloc[-1][1]
    lines += [f"| {name} | {r / 1e6:.1f} | {r / base:.1f}x |" for name, r in alloc]
    lines += ["", "Targets: >= 50 M blocks/s; anchor: vLLM's BlockPool about 5 M/s on these machines.", "",
              "## Decode Step, in-process (`Pool.step`, +1 token per sequence, CSR tables returned)", "",
              "Geometry: 32 layers, 8 KV heads, head_dim 128, float16, page_size 16, per-layer layout; contexts "
              f"uniform in [256, 1024) tokens at the start, +1 per step for {steps} steps (the first 10% are "
              "warm-up and not counted). Table entries: CSR indices in the last step's reply.", "",
              "| B | p50 us | p99 us | table entries |", "|---:|---:|---:|---:|"]
    lines += [f"| {b} | {p50:.1f} | {p99:.1f} | {nnz:,} |" for b, p50, p99, nnz in inproc]
    lines += ["", "Target: B=256 p50 <= 100 us.", "",
              "## Decode Step over gRPC, side by side (loopback, manager in its own process)", "",
              "The same decode step (+1 token for each of B sequences, same geometry) by unary `Step`, over one "
              "`StepStream` with full tables, and over one `StepStream` with incremental tables (`delta_tables`; "
              "the time includes applying the delta to the client's `PageTableMirror`). Each mode has its own "
              f"pool; modes run interleaved in 8 rounds of {steps // 8} steps after 20 warm-up steps, so machine "
              "noise hits all alike. Reply bytes: one serialized reply. The manager runs `kvservice serve` "
              "defaults (memory journal, limits, lenient parser).", "",
              f"Transport floors, all rounds: unary `Echo` p50 {echo['Echo'][0]:.0f} us (p99 {echo['Echo'][1]:.0f}); "
              f"`EchoStream` p50 {echo['EchoStream'][0]:.0f} us (p99 {echo['EchoStream'][1]:.0f}).", "",
              "| B | path | p50 us | p99 us | p50 / EchoStream p50 | p50 / Echo p50 | reply bytes |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    inproc_p50 = {b: p50 for b, p50, _, _ in inproc}
    for b, mode, p50, p99, size in transport:
        lines.append(f"| {b} | {mode} | {p50:.0f} | {p99:.0f} | {p50 / echo['EchoStream'][0]:.2f}x | "
                     f"{p50 / echo['Echo'][0]:.2f}x | {size:,} |")
        if mode == MODES[-1]:
            lines.append(f"| {b} | in-process `Pool.step` (tables) | {inproc_p50[b]:.0f} | | | | |")
    d256 = next(r for r in transport if r[0] == 256 and r[1] == MODES[2])
    u256 = next(r for r in transport if r[0] == 256 and r[1] == MODES[0])
    lines += ["", f"Targets (issue 12), this run: StepStream with deltas at B=256 p50 = "
              f"{d256[2] / echo['EchoStream'][0]:.2f}x the EchoStream p50 (target <= 1.3x); reply "
              f"{d256[4]:,} bytes per decode step (target <= 10 KB; unary full tables {u256[4]:,} bytes).", "",
              f"## Aggregate decode throughput: {len(concurrent) and 16} schedulers on 16 pools (B = 64 each)", "",
              "Each scheduler is a thread of one client process with its own channel and pool, all against one "
              "manager process; steps/s over all of them.", "",
              "| path | steps/s (all schedulers) | p50 us per step |", "|---|---:|---:|"]
    lines += [f"| {mode} | {rate:,.0f} | {p50:.0f} |" for mode, rate, p50 in concurrent]
    lines += ["", "## Where a StepStream decode request's time goes (in-process, no transport)", "",
              "The same steps without gRPC: `Pool.step` alone (no CSR tables, as the delta path asks), the server's "
              "whole request (`kvservice.server.stream.step_one`: session, Limits, memory journal, the step, delta "
              "encoding, reply serialization) and the client's work (request bytes, reply parsing, applying the "
              "delta to the mirror), back to back; and the server's request after its thread slept 200 us, as "
              "a served request follows an idle wait (code that runs right after its core idled runs slower on "
              "these machines). Transport floor + server + client is a lower bound of a stream round trip; the "
              "measured round trips above also pay the idle-gap cost on both ends (docs/ARCHITECTURE.md, "
              "Streams: Latency).", "",
              "| B | Pool.step p50 us | server request p50 us | ... after 200 us idle | client p50 us | "
              "EchoStream p50 + both | as x EchoStream |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for b, p_step, p_server, p_client, _ in breakdown:
        total = echo["EchoStream"][0] + p_server + p_client
        lines.append(f"| {b} | {p_step:.0f} | {p_server:.0f} | {idle[b]:.0f} | {p_client:.0f} | {total:.0f} | "
                     f"{total / echo['EchoStream'][0]:.2f}x |")
    lines += [""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
