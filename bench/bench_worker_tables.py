"""Peak memory of a worker under hostile UpdateTables (issue 26 item 3), this tree against another one.

Starts a real manager and a real `kvworker serve` (CPU) from a source tree, creates a one-layer pool of
512 slots (max_seq_len 8,192, page size 16), sends one small legit table, reads the worker's peak resident
set (VmHWM from /proc), then sends the issue's hostile tables (tests/fuzz/hostile_tables.py: a 123-byte
reply claiming 2^26 int64 pages, deltas claiming 2^40 tokens, 2^18 rows or 2^62 tokens, rows past the
bound, another plan's space, the largest acceptable table) and 400 mutations of real replies, each under
its own table id, and reads VmHWM again; then 64 table ids of the largest acceptable table. Prints the
growth and the status codes, and writes bench/results/worker_tables.md (a marked section per tree).

Usage: python bench/bench_worker_tables.py [--tree DIR] [--label NAME]   (default: this tree)
       python bench/bench_worker_tables.py --tree /work/main --label "before (main)"
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.tools.launch import wait_for_ports  # noqa: E402
from kvservice.v1 import worker_pb2 as wpb  # noqa: E402
from kvservice.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from tests.fuzz.hostile_tables import full_reply, issue_cases, mutate  # noqa: E402
from tests.fuzz.test_fuzz_worker import stream_replies  # noqa: E402

SPEC = CacheSpec.uniform(1, 1, 32, "float16", 16)
SLOTS, SEQ, PS = 512, 8192, 16
RESULTS = ROOT / "bench" / "results" / "worker_tables.md"


def vm_hwm(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def start(tree: Path, tmp: Path, args: list[str], name: str) -> tuple[subprocess.Popen, int]:
    ports = tmp / f"{name}.ports"
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", *args, "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                             "--port-file", str(ports)], cwd=tree, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    return proc, wait_for_ports(proc, ports, 120, log, name)[0]


def run(tree: Path) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        mgr, port = start(tree, tmp, ["kvservice.server.cli", "serve", "--no-pools"], "manager")
        target = f"127.0.0.1:{port}"
        try:
            with BlockManagerClient(target, timeout=30) as c:
                c.wait_ready()
                c.create_pool("mem", SPEC, Sizing(num_slots=SLOTS, max_seq_len=SEQ))
            wk, wport = start(tree, tmp, ["kvservice.worker.cli", "serve", "--manager", target, "--pool", "mem",
                                          "--worker-id", "w-mem"], "worker")
            try:
                ch = grpc.insecure_channel(f"127.0.0.1:{wport}", options=[("grpc.max_send_message_length", 1 << 28)])
                stub = wpb_grpc.WorkerStub(ch)
                replies = stream_replies(target, "mem")
                stub.UpdateTables(wpb.UpdateTablesRequest(table_id="warm", step=replies[0]), timeout=60)
                time.sleep(0.5)
                base = vm_hwm(wk.pid)
                rnd = random.Random(26)
                cases = issue_cases(PS, SLOTS, min(1024, SLOTS), SEQ // PS)
                cases += [(f"mutation {i}", wpb.UpdateTablesRequest(table_id=f"m{i % 8}", step=mutate(
                    rnd, rnd.choice(replies), rnd.randint(1, 3)))) for i in range(400)]
                codes: collections.Counter = collections.Counter()
                per_case = []
                for name, req in cases:
                    before = vm_hwm(wk.pid)
                    try:
                        stub.UpdateTables(req, timeout=120)
                        code = "OK"
                    except grpc.RpcError as err:
                        code = err.code().name
                    codes[code] += 1
                    if not name.startswith("mutation"):
                        per_case.append((name, req.ByteSize(), code, vm_hwm(wk.pid) - before))
                out["single"] = vm_hwm(wk.pid) - base
                out["codes"], out["cases"] = dict(codes), per_case
                big = full_reply(min(1024, SLOTS), SEQ, PS, SLOTS, new_tokens=False)
                for i in range(64):
                    try:
                        stub.UpdateTables(wpb.UpdateTablesRequest(table_id=f"max{i}", step=big), timeout=120)
                    except grpc.RpcError as err:
                        codes[f"64 ids: {err.code().name}"] += 1
                out["many"] = vm_hwm(wk.pid) - base
                out["baseline"] = base
                ch.close()
            finally:
                wk.terminate()
                wk.wait(20)
        finally:
            mgr.terminate()
            mgr.wait(20)
    return out


def report(label: str, r: dict) -> str:
    mib = 2**20
    lines = [f"<!-- bench_worker_tables {label}: begin -->", f"### {label}", "",
             f"Worker VmHWM {r['baseline'] / mib:.1f} MiB after one small table; growth over the issue's cases "
             f"and 400 mutations: **{r['single'] / mib:.1f} MiB**; after 64 table ids of the largest acceptable "
             f"table: **{r['many'] / mib:.1f} MiB**. Status codes: {r['codes']}.", "",
             "| case | request bytes | status | VmHWM growth (MiB) |", "|---|---|---|---|"]
    lines += [f"| {n} | {b:,} | {c} | {g / mib:.1f} |" for n, b, c, g in r["cases"]]
    lines += ["", f"<!-- bench_worker_tables {label}: end -->"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(ROOT))
    ap.add_argument("--label", default="this tree")
    args = ap.parse_args()
    text = report(args.label, run(Path(args.tree)))
    print(text)
    head = ("# Worker peak memory under hostile UpdateTables (bench/bench_worker_tables.py)\n\n"
            "One-layer pool, 512 slots, max_seq_len 8,192, page size 16 (this tree's table size: 4.0 MiB, "
            "tenant quota 8.1 MiB). Growth of the worker process's VmHWM over a small legit table.\n")
    old = RESULTS.read_text() if RESULTS.exists() else head
    begin, end = f"<!-- bench_worker_tables {args.label}: begin -->", f"<!-- bench_worker_tables {args.label}: end -->"
    if begin in old:
        old = old[:old.index(begin)] + text + old[old.index(end) + len(end):]
    else:
        old = old.rstrip() + "\n\n" + text + "\n"
    RESULTS.write_text(old)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
