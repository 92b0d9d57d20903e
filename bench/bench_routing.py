"""Routing benchmarks: ScorePrefix of a 32k-token prompt against 64 pools, and KV event throughput.

Writes a markdown report (default bench/results/routing.md). Measured, never asserted.
Usage: python bench/bench_routing.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_manager import machine, percentiles, start_server  # noqa: E402
from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.core.planner import plan  # noqa: E402
from kvservice.core.pool import Pool  # noqa: E402
from kvservice.manager.pools import BlockManager  # noqa: E402
from kvservice.manager.routing import score_prefix, score_prefix_per_pool  # noqa: E402
from kvservice.tools.launch import wait_for_ports  # noqa: E402

TOKENS, POOLS, PS = 32_768, 64, 16
SPEC = CacheSpec.uniform(32, 8, 128, "bfloat16", PS)
SIZING = Sizing(num_slots=TOKENS // PS + 64, max_seq_len=TOKENS + PS)


def cache_prefixes(fill: list[int], add) -> None:
    """Admit then free prompt[:fill[i]] in pool i, so that many tokens of the prompt stay cached there."""
    for i, n in enumerate(fill):
        if n:
            add(f"p{i}", n)


def scenario_fills(rng: np.random.Generator, kind: str) -> list[int]:
    if kind == "mixed":             # each pool holds a random-length prefix (0 to all of the prompt)
        return [int(x) // PS * PS for x in rng.integers(0, TOKENS + 1, POOLS)]
    return [TOKENS] * POOLS          # worst case: every pool holds the whole prompt


PATHS = ("per pool", "fleet index")      # before (every pool asked itself) and after (routing.py)


def bench_inprocess(kind: str, reps: int) -> list[tuple[str, float, float, int]]:
    """Both paths on one manager, calls interleaved; [(path, p50 us, p99 us, tokens cached summed over pools)]."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, TOKENS)
    m = BlockManager()
    for i in range(POOLS):
        m.create_pool(f"p{i}", SPEC, SIZING, prefix_caching=True)

    def add(pool: str, n: int) -> None:
        with m.locked(pool) as p:
            p.step(admit_ids=[1], admit_tokens=[n], admit_token_ids=prompt[:n])
            p.step(free_ids=[1])

    cache_prefixes(scenario_fills(rng, kind), add)
    fns = (score_prefix_per_pool, score_prefix)
    lat: list[list[float]] = [[], []]
    cached = [0, 0]
    for r in range(reps + 3):
        for k in (0, 1) if r % 2 else (1, 0):
            t0 = time.perf_counter()
            scores = fns[k](m, prompt)
            lat[k].append(time.perf_counter() - t0)
            cached[k] = sum(s.cached_tokens for s in scores)
    return [(PATHS[k], *percentiles(lat[k][3:]), cached[k]) for k in (0, 1)]


#: The server of the "per pool" gRPC rows: the same server with ScorePrefix taking the per-pool path.
PER_POOL_SERVER = ("import sys, kvservice.events.messages as e, kvservice.manager.routing as r; "
                   "e._score = r.score_prefix_per_pool; from kvservice.server.cli import main; "
                   "sys.exit(main(sys.argv[1:]))")


def start_per_pool_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp / "ports"
    proc = subprocess.Popen([sys.executable, "-c", PER_POOL_SERVER, "serve", "--listen", "127.0.0.1:0",
                             "--metrics-port", "-1", "--no-pools", "--port-file", str(port_file),
                             "--log-level", "WARNING"], cwd=ROOT)
    port, _ = wait_for_ports(proc, port_file, 30, what="manager")
    return proc, f"127.0.0.1:{port}"


def bench_grpc(kind: str, reps: int) -> list[tuple[str, float, float, int]]:
    """Two servers (per-pool path, fleet index) holding the same pools, calls interleaved."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, TOKENS)
    fills = scenario_fills(rng, kind)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        procs = []
        try:
            for start, sub in ((start_per_pool_server, "a"), (start_server, "b")):
                procs.append(start(Path(tmp) / sub))
            clients = [BlockManagerClient(target, timeout=60) for _, target in procs]
            for c in clients:
                c.wait_ready()
                for i in range(POOLS):
                    c.create_pool(f"p{i}", SPEC, SIZING, prefix_caching=True)

                def add(pool: str, n: int, c: BlockManagerClient = c) -> None:
                    c.step(pool, admit=[1], admit_tokens=[n], admit_token_ids=prompt[:n], tables=False)
                    c.step(pool, free=[1], tables=False)

                cache_prefixes(fills, add)
            lat: list[list[float]] = [[], []]
            cached = [0, 0]
            for r in range(reps + 3):
                for k in (0, 1) if r % 2 else (1, 0):
                    t0 = time.perf_counter()
                    reply = clients[k].score_prefix(prompt)
                    lat[k].append(time.perf_counter() - t0)
                    cached[k] = sum(s.cached_tokens for s in reply.scores)
            for c in clients:
                c.close()
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(10)
    return [(PATHS[k], *percentiles(lat[k][3:]), cached[k]) for k in (0, 1)]


def bench_upkeep(reps: int) -> list[tuple[str, float, float]]:
    """The Step's cost of keeping the fleet index: a 32k-token admission and its free, each evicting the previous
    prompt's 2,048 cached pages, in a pool of a manager (a member) and in a pool of no manager, interleaved."""
    rng = np.random.default_rng(1)
    m = BlockManager()
    member = m.create_pool("member", SPEC, SIZING, prefix_caching=True)
    alone = Pool("alone", plan(SPEC, SIZING), prefix_caching=True)
    lat: dict[str, list[float]] = {"member of the fleet index": [], "no index": []}
    for r in range(reps + 2):
        prompt = rng.integers(0, 128_000, TOKENS)
        order = (("member of the fleet index", member), ("no index", alone))
        for label, pool in order if r % 2 else order[::-1]:
            t0 = time.perf_counter()
            pool.step(admit_ids=[1], admit_tokens=[TOKENS], admit_token_ids=prompt, tables=False)
            pool.step(free_ids=[1], tables=False)
            lat[label].append(time.perf_counter() - t0)
    return [(label, *percentiles(v[2:])) for label, v in lat.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing.md"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    a = ap.parse_args()
    reps = 10 if a.quick else 50
    rows = []
    for kind in ("mixed", "full"):
        for where, bench in (("in-process", bench_inprocess), ("gRPC", bench_grpc)):
            for path, p50, p99, cached in bench(kind, reps):
                rows.append((where, kind, path, p50, p99, cached))
                print(rows[-1], flush=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Routing benchmarks", "",
        f"Run {now} on {machine()}; load average {os.getloadavg()[0]:.1f} at the end (a shared machine: "
        "compare rows of one run, not runs).",
        "Command: `make bench` (`python bench/bench_routing.py`). Measured, not asserted; compare rows of one run.", "",
        f"## ScorePrefix: a {TOKENS:,}-token prompt against {POOLS} pools (page size {PS})", "",
        "Each pool has a prefix cache holding part of the prompt (admitted and freed earlier). *mixed*: pool i holds "
        "a random-length prefix (uniform, 0 to all of it); *full*: every pool holds the whole prompt (the worst case: "
        f"every pool is walked to the end, {TOKENS // PS:,} pages each). The answer per pool is what an admission "
        "would find cached. gRPC includes sending the 32k token ids (INT32: the client sends INT64 only for "
        "ids past 2^31) and the client's decode.", "",
        "*per pool*: every pool asked in turn (hash probe and token comparison per pool: the code before the fleet "
        "index, kept as `routing.score_prefix_per_pool`; its gRPC server is the same server with ScorePrefix "
        "switched to it); *fleet index*: one walk of the manager's index for all pools (`routing.score_prefix`, "
        "what ships). The two paths run in the same process (in-process) or against two servers holding the same "
        "pools (gRPC), calls interleaved, so a row pair shares the machine's load.", "",
        "| where | cached prefixes | path | p50 ms | p99 ms | tokens cached, summed over pools |",
        "|---|---|---|---:|---:|---:|",
    ]
    for where, kind, path, p50, p99, cached in rows:
        lines.append(f"| {where} | {kind} | {path} | {p50 / 1e3:.2f} | {p99 / 1e3:.2f} | {cached:,} |")   # us -> ms
    lines += ["", "## Step: the cost of keeping the fleet index", "",
              f"A {TOKENS:,}-token admission and its free, each admission evicting the previous prompt's "
              f"{TOKENS // PS:,} cached pages (so {TOKENS // PS:,} pages forgotten and {TOKENS // PS:,} registered "
              "per row), in a pool of a manager (its cache a member of the index, which is brought up to date at "
              "the end of the Step) and in the same pool outside any manager, interleaved.", "",
              "| pool | p50 ms | p99 ms |", "|---|---:|---:|"]
    for label, p50, p99 in bench_upkeep(max(10, reps // 2)):
        lines.append(f"| {label} | {p50 / 1e3:.2f} | {p99 / 1e3:.2f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
