"""Peak memory of the manager for the largest Step its default limits allow (issue #11).

Starts a real `kvservice serve` process with the shipped manager's limits (message limit of the
base overlay, default Limits: 65,536 sequences and 8,388,608 new tokens per Step, 2^24 slots per
pool), creates the largest pool those limits allow, sends the largest Step they allow, and reads
the process's peak resident set (VmHWM from /proc) before and after. Cases:

  - prefix-cached admission: 65,536 prompts of 128 tokens (8,388,608 tokens, with their token ids)
    into a 2^24-slot pool of 32 per_layer layers, tables returned;
  - one 131,072-token sequence beside 65,535 one-token sequences (the ragged slot-table case);
  - a 16-index-space interleaved pool with the biggest admission its reply limit lets through.

With --mix (issue 27), two more, at the base settings (128 MiB messages, 8 threads, 64 streams, the
memory budget derived for the base pod's 4 GiB: kvservice/server/budget.py):

  - the worst legal mix, all at once: 12 StepStreams and 4 unary Steps, each the largest admission
    the limits allow (65,536 prompts x 128 tokens with their token ids: a 64 MiB request, a ~100 MiB
    reply) into one 2^24-slot pool (without, then with prefix caching), 4 WatchEvents from sequence 0
    and 4 ScorePrefix calls of 1,048,576 tokens; peak RSS (VmHWM) against the pod's 4 GiB, and how
    each call ended;
  - 30 streams whose sessions keep the most a refused request leaves (a 32 MiB extend_num_tokens),
    closed together: seconds until the budget's charged bytes (kvservice_memory_budget_charged_bytes)
    are back where they were, and RSS one second after the close.

--tree DIR runs the manager of another checkout (e.g. /work/main, to compare). Writes the figures into
bench/results/durability.md (marked sections, replaced on each run) and prints them.
Usage: python bench/bench_limits.py [--results FILE] [--mix] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec, LayerSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.manager.pools import slot_units  # noqa: E402
from kvservice.server.limits import Limits  # noqa: E402
from kvservice.tools.launch import wait_for_ports  # noqa: E402

MESSAGE_BYTES = 128 << 20          # deploy/base: --max-message-bytes
DEPLOY_MEMORY = 4 << 30            # deploy/base manager-statefulset.yaml: limits.memory
BEGIN, END = "<!-- bench_limits: begin -->", "<!-- bench_limits: end -->"
#: glibc malloc settings of the manager's container (deploy/base manager-statefulset.yaml env), from the environment
MALLOC_ENV = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
MIX_BEGIN, MIX_END = "<!-- bench_limits mix: begin -->", "<!-- bench_limits mix: end -->"


def peak_rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024


def rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def run_case(name: str, spec: CacheSpec, sizing: Sizing, prefix: bool, admit_tokens: np.ndarray,
             token_ids: np.ndarray | None, tmp: Path) -> dict:
    ports = tmp / f"{name}.ports"
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0",
                             "--metrics-port", "-1", "--port-file", str(ports), "--max-message-bytes",
                             str(MESSAGE_BYTES)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = wait_for_ports(proc, ports, 60, tmp / f"{name}.log", "manager")[0]
        target = f"127.0.0.1:{port}"
        with BlockManagerClient(target, timeout=600) as c:
            c.wait_ready()
            for info in c.list_pools():                       # the embedded default pool: room for the largest
                c.delete_pool(info.name, force=True)
            c.create_pool("p", spec, sizing, prefix_caching=prefix)
            before = peak_rss(proc.pid)
            ids = np.arange(1, len(admit_tokens) + 1, dtype=np.uint64)
            t0 = time.perf_counter()
            outcome = "ok"
            try:
                r = c.step("p", admit=ids, admit_tokens=admit_tokens, admit_token_ids=token_ids)
                reply_tokens = int(r.new_token_indptr[-1])
            except Exception as err:                          # a refusal is a result too: say which
                outcome, reply_tokens = f"refused: {getattr(err, 'code', type(err).__name__)}", 0
            seconds = time.perf_counter() - t0
            after = peak_rss(proc.pid)
            now = rss(proc.pid)
        return {"case": name, "outcome": outcome, "sequences": len(admit_tokens), "tokens": int(admit_tokens.sum()),
                "reply_tokens": reply_tokens, "seconds": seconds, "rss_before": before, "peak": after, "rss_after": now}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def start_manager(tree: Path, tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, int, int, object]:
    """A `kvservice serve` of `tree` at the base settings; returns (process, gRPC port, metrics port, log)."""
    ports = tmp / f"{name}.ports"
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0",
                             "--metrics-port", "0", "--port-file", str(ports), "--max-message-bytes",
                             str(MESSAGE_BYTES), "--no-pools", "--state", "memory", *extra],
                            cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", **MALLOC_ENV})
    found = wait_for_ports(proc, ports, 60, tmp / f"{name}.log", "manager")
    return proc, found[0], found[1], log


def stop_manager(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:          # a manager still busy with its requests
        proc.kill()
        proc.wait(30)


def charged(metrics_port: int) -> int | None:
    """kvservice_memory_budget_charged_bytes now (None: a manager without a budget)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    m = re.search(r"^kvservice_memory_budget_charged_bytes (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else None


class ReplyError(Exception):
    """A StepStream request refused in its reply (the stream went on)."""

    def __init__(self, status: object) -> None:
        super().__init__(status.message)
        self.status = status


def _outcome(err: BaseException | None) -> str:
    if err is None:
        return "ok"
    if isinstance(err, ReplyError):
        from google.rpc import code_pb2
        budget = " MEMORY_BUDGET" if err.status.reason == "MEMORY_BUDGET" else f" {err.status.reason}"
        return f"error reply {code_pb2.Code.Name(err.status.code)}{budget}"
    code = getattr(err, "code", None)
    code = code() if callable(code) else code
    text = (err.details() if hasattr(err, "details") else str(err)) or ""
    return f"{getattr(code, 'name', type(err).__name__)}{' MEMORY_BUDGET' if 'memory budget' in text else ''}"


def worst_mix(tree: Path, tmp: Path, prefix: bool) -> dict:
    import grpc

    from kvservice.client.codec import step_request
    from kvservice.contract.transport import STREAM_ID_KEY
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import block_manager_pb2 as pb
    from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
    proc, port, mport, log = start_manager(tree, tmp, f"mix-{prefix}")
    outcomes: dict[str, list[str]] = {}
    try:
        target = f"127.0.0.1:{port}"
        opts = [("grpc.max_send_message_length", MESSAGE_BYTES), ("grpc.max_receive_message_length", MESSAGE_BYTES)]
        # The largest pool the default limits allow: 2^24 slots, or 2^24 slot units of a prefix-cached pool's
        # (slot_units(16) = 33 each: 508,400 slots), its cache filled first (two rounds of prompts admitted and
        # freed: every slot then holds a cached page); admissions the largest that fit in the pool.
        slots = Limits().max_total_slots // slot_units(16, prefix)
        tokens = min(128, slots // 65_536 * 16)
        rng = np.random.default_rng(1)
        n = np.full(65_536, tokens, dtype=np.int64)
        with BlockManagerClient(target, timeout=600) as c:
            c.wait_ready()
            c.create_pool("p", CacheSpec.uniform(32, 8, 128, "float16", 16), Sizing(num_slots=slots),
                          prefix_caching=prefix)
            for k in range(2 if prefix else 0):
                ids = np.arange(1, 65_537, dtype=np.uint64) + (k + 100) * 65_536
                c.step("p", admit=ids, admit_tokens=n, admit_token_ids=rng.integers(1, 50_000, int(n.sum())))
                c.step("p", free=ids)
        rss_before = rss(proc.pid)

        def admission(k: int) -> pb.StepRequest:
            ids = np.arange(k * 65_536 + 1, (k + 1) * 65_536 + 1, dtype=np.uint64)
            return step_request("p", admit=ids, admit_tokens=n,             # token ids only where they are cached
                                admit_token_ids=rng.integers(1, 50_000, int(n.sum())).astype(np.int64) if prefix
                                else None)
        requests = [admission(k) for k in range(16)]
        channel = grpc.insecure_channel(target, options=opts)
        stub = pb_grpc.BlockManagerStub(channel)
        lock = threading.Lock()
        stop = threading.Event()

        def record(kind: str, err: BaseException | None) -> None:
            with lock:
                outcomes.setdefault(kind, []).append(_outcome(err))

        def stream(k: int) -> None:
            r = requests[k]
            r.stream_seq = 1
            try:
                for reply in stub.StepStream(iter([r]), metadata=((STREAM_ID_KEY, f"mix-{k}"),), timeout=600):
                    record("StepStream", None if not reply.HasField("error") else ReplyError(reply.error))
            except grpc.RpcError as err:
                record("StepStream", err)

        def unary(k: int) -> None:
            try:
                stub.Step(requests[k], timeout=600)
                record("Step", None)
            except grpc.RpcError as err:
                record("Step", err)

        def watch(k: int) -> None:
            call = stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=600)
            try:
                for _ in call:
                    if stop.is_set():
                        break
                record("WatchEvents", None)
            except grpc.RpcError as err:
                record("WatchEvents", None if err.code() == grpc.StatusCode.CANCELLED else err)
            finally:
                call.cancel()

        def score(k: int) -> None:
            ids = rng.integers(1, 50_000, 1_048_576).astype(np.int64)
            try:
                stub.ScorePrefix(pb.ScorePrefixRequest(token_ids=to_tensor(ids)), timeout=600)
                record("ScorePrefix", None)
            except grpc.RpcError as err:
                record("ScorePrefix", err)
        workers = [threading.Thread(target=f, args=(k,)) for f, ks in
                   ((watch, range(4)), (stream, range(12)), (unary, range(12, 16)), (score, range(4))) for k in ks]
        t0 = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers[4:]:
            t.join()
        stop.set()
        seconds = time.perf_counter() - t0
        channel.close()                                      # ends the watchers
        for t in workers[:4]:
            t.join(60)
        return {"outcomes": outcomes, "seconds": seconds, "rss_before": rss_before, "peak": peak_rss(proc.pid),
                "slots": slots, "tokens": tokens,
                "rss_after": rss(proc.pid), "charged_after": charged(mport)}
    finally:
        stop_manager(proc)
        log.close()


def closed_streams(tree: Path, tmp: Path, steady: bool, count: int = 30) -> dict:
    """count streams whose sessions keep the most, closed together. steady: a decode loop's session (65,536
    sequences extended with delta tables: its arrays, their key and the held tables); else what a refused
    32 MiB request leaves (the red team's shape: its decoded arrays and key were kept)."""
    import grpc

    from kvservice.client.codec import step_request
    from kvservice.contract.transport import STREAM_ID_KEY
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
    proc, port, mport, log = start_manager(tree, tmp, f"closed-{steady}")
    rows = 65_536
    try:
        target = f"127.0.0.1:{port}"
        with BlockManagerClient(target, timeout=600) as c:
            c.wait_ready()
            c.create_pool("p", CacheSpec.uniform(2, 1, 64, "float16", 16), Sizing(num_slots=count * rows + 4096))
            c.step("p", admit=[1], admit_tokens=[1])
            for k in range(count if steady else 0):
                c.step("p", admit=np.arange(2 + k * rows, 2 + (k + 1) * rows, dtype=np.uint64), admit_tokens=1,
                       tables=False)
        base_charged = charged(mport)
        rss_before = rss(proc.pid)
        if not steady:      # passes Limits (32 MiB of token counts), refused by the pool (the lengths differ)
            big = step_request("p", extend=[1])
            big.extend_num_tokens.CopyFrom(to_tensor(np.zeros(4 << 20, dtype=np.int64)))
            big.delta_tables = True
        opts = [("grpc.max_send_message_length", MESSAGE_BYTES), ("grpc.max_receive_message_length", MESSAGE_BYTES)]
        channel = grpc.insecure_channel(target, options=opts)
        stub = pb_grpc.BlockManagerStub(channel)
        gates, calls = [], []
        for k in range(count):                   # one at a time: each session's keep, not requests in flight
            gate = threading.Event()

            def requests(gate: threading.Event = gate, k: int = k) -> object:
                r = big if not steady else step_request(
                    "p", extend=np.arange(2 + k * rows, 2 + (k + 1) * rows, dtype=np.uint64),
                    extend_tokens=np.ones(rows, dtype=np.int64))
                r.stream_seq = 1
                r.delta_tables = True
                yield r
                gate.wait()
            call = stub.StepStream(requests(), metadata=((STREAM_ID_KEY, f"closed-{k}"),), timeout=600)
            next(call)
            gates.append(gate)
            calls.append(call)
        held = charged(mport)
        for _ in range(50):                      # the last request's charge goes once its handler waits again
            time.sleep(0.1)
            now = charged(mport)
            if now == held:
                break
            held = now
        held_rss = rss(proc.pid)
        t0 = time.perf_counter()
        for gate in gates:
            gate.set()                           # each client ends its stream
        for call in calls:
            for _ in call:
                pass
        freed_s = None
        while time.perf_counter() - t0 < 30:
            now = charged(mport)
            if now is not None and now <= base_charged:
                freed_s = time.perf_counter() - t0
                break
            if now is None and time.perf_counter() - t0 > 1:
                break
            time.sleep(0.01)
        time.sleep(max(0.0, 1 - (time.perf_counter() - t0)))
        channel.close()
        return {"count": count, "steady": steady, "rss_before": rss_before, "rss_open": held_rss, "charged_open": held,
                "freed_s": freed_s, "rss_1s": rss(proc.pid), "peak": peak_rss(proc.pid)}
    finally:
        stop_manager(proc)
        log.close()


def mix_section(tree: Path, mixes: dict[bool, dict], closeds: list[dict]) -> str:
    mib = 2**20
    lines = [MIX_BEGIN, "## The worst legal mix at the base settings, and closed streams (issue 27)", "",
             f"`python bench/bench_limits.py --mix{'' if tree == ROOT else ' --tree ' + str(tree)}` "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {platform.node() or 'this machine'}): a real "
             f"`kvservice serve` with the base settings ({MESSAGE_BYTES >> 20} MiB messages, 8 threads, 64 streams, "
             "the memory budget derived for the base pod's 4 GiB: 2,304 MiB), one pool, the largest the default "
             "limits allow (2^24 slot units: 2^24 slots, or 508,400 prefix-cached slots of page size 16, whose "
             "cache is filled first). RSS before: after the pool was created (and its cache filled); after: when "
             "every call has ended (what the pool's state holds then).", "",
             "| case | figure |", "|---|---|"]
    for prefix, mix in mixes.items():
        outcomes = "; ".join(f"{kind}: " + ", ".join(f"{n} {o}" for o, n in sorted(
            {o: v.count(o) for o in set(v)}.items())) for kind, v in mix["outcomes"].items())
        ok = mix["peak"] < DEPLOY_MEMORY
        lines += [f"| worst legal mix, {'prefix-cached' if prefix else 'no prefix caching'} ({mix['slots']:,} "
                  f"slots): 12 StepStreams + 4 unary Steps of the largest admission (65,536 x {mix['tokens']} "
                  "tokens; prefix-cached with their token ids), 4 WatchEvents "
                  f"from 0, 4 ScorePrefix of 1,048,576 tokens, all at once | peak RSS {mix['peak'] / mib:,.0f} MiB "
                  f"of the pod's {DEPLOY_MEMORY >> 30} GiB ({'within' if ok else 'OVER'}); RSS before "
                  f"{mix['rss_before'] / mib:,.0f} MiB, after {mix['rss_after'] / mib:,.0f} MiB; "
                  f"{mix['seconds']:.0f} s; budget charged after: {mix['charged_after']} |",
                  f"| how each call ended | {outcomes} |"]
    for closed in closeds:
        what = "a decode loop's session (65,536 sequences extended with delta tables)" if closed["steady"] else \
            "a session after a refused 32 MiB extend (1 id, 4 M counts)"
        lines.append(f"| {closed['count']} streams, each {what}, closed together | charged "
                     f"{_mib(closed['charged_open'])} while open, back to the baseline {_freed(closed['freed_s'])}; "
                     f"RSS {closed['rss_before'] / mib:,.0f} MiB before, {closed['rss_open'] / mib:,.0f} MiB open, "
                     f"{closed['rss_1s'] / mib:,.0f} MiB 1 s after the close (peak {closed['peak'] / mib:,.0f} MiB) |")
    lines.append(MIX_END)
    return "\n".join(lines) + "\n"


def _freed(seconds: float | None) -> str:
    return "(no budget: not measured)" if seconds is None else f"in {seconds:.3f} s"


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def write_section(path: Path, section: str, begin: str, end: str) -> None:
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "durability.md"))
    ap.add_argument("--mix", action="store_true", help="only the worst legal mix and the closed streams")
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose manager to run (--mix)")
    a = ap.parse_args()
    if a.mix:
        tree = Path(a.tree).resolve()
        with tempfile.TemporaryDirectory() as tmp_s:
            closed = [closed_streams(tree, Path(tmp_s), steady) for steady in (True, False)]
            print(closed, flush=True)
            mixes = {}
            for prefix in (False, True):
                mixes[prefix] = worst_mix(tree, Path(tmp_s), prefix)
                print(mixes[prefix], flush=True)
        section = mix_section(tree, mixes, closed)
        print(section)
        if tree == ROOT:
            write_section(Path(a.results), section, MIX_BEGIN, MIX_END)
        return 0 if all(m["peak"] < DEPLOY_MEMORY for m in mixes.values()) else 1
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        big = CacheSpec.uniform(32, 8, 128, "float16", 16)
        n = np.full(65_536, 128, dtype=np.int64)
        rows.append(run_case("65,536 prefix-cached prompts x 128 tokens (8.4 M tokens + ids), 32 per_layer layers",
                             big, Sizing(num_slots=1 << 24), True, n, rng.integers(1, 50_000, int(n.sum())), tmp))
        ragged = np.ones(65_536, dtype=np.int64)
        ragged[0] = 131_072
        rows.append(run_case("one 131,072-token sequence + 65,535 one-token sequences", big,
                             Sizing(num_slots=1 << 24), False, ragged, None, tmp))
        wide = CacheSpec(tuple(LayerSpec(1, 64 * (1 + i % 4)) for i in range(16)), 16, "interleaved")
        m = np.full(3_000, 256, dtype=np.int64)
        rows.append(run_case("16-index-space interleaved pool: 3,000 x 256 tokens (16 slot mappings per token: "
                             "a ~100 MB reply)", wide, Sizing(num_slots=1 << 20), False, m, None, tmp))
    lines = [BEGIN, "## Peak manager memory for the largest Step the limits allow", "",
             f"`python bench/bench_limits.py` ({time.strftime('%Y-%m-%d')}): a real `kvservice serve` process with "
             f"the base overlay's message limit ({MESSAGE_BYTES >> 20} MiB) and default Limits; peak RSS is the "
             f"process's VmHWM. The base overlay's manager memory limit is {DEPLOY_MEMORY >> 30} GiB.", "",
             "| case | outcome | new tokens | Step seconds | RSS before | peak RSS | within the limit |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['outcome']} | {r['reply_tokens']:,} | {r['seconds']:.1f} | "
                     f"{r['rss_before'] / 2**20:,.0f} MiB | {r['peak'] / 2**20:,.0f} MiB | "
                     f"{'yes' if r['peak'] < DEPLOY_MEMORY else 'NO'} |")
    lines.append(END)
    section = "\n".join(lines) + "\n"
    print(section)
    write_section(Path(a.results), section, BEGIN, END)
    return 0 if all(r["peak"] < DEPLOY_MEMORY for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
