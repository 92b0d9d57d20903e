"""Routing benchmarks: ScorePrefix of a 32k-token prompt against 64 pools, and KV event throughput.

Writes a markdown report (default bench/results/routing.md). Measured, never asserted.
Usage: python bench/bench_routing.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_manager import machine, percentiles, start_server  # noqa: E402
from clients import BlockManagerClient  # noqa: E402
from kvservice.geometry import CacheSpec  # noqa: E402
from kvservice.manager import BlockManager  # noqa: E402
from kvservice.planner import Sizing  # noqa: E402
from kvservice.routing import score_prefix  # noqa: E402

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


def bench_inprocess(kind: str, reps: int) -> tuple[float, float, int]:
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
    lat, cached = [], 0
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        scores = score_prefix(m, prompt)
        lat.append(time.perf_counter() - t0)
        cached = sum(s.cached_tokens for s in scores)
    p50, p99 = percentiles(lat[3:])
    return p50, p99, cached


def bench_grpc(kind: str, reps: int) -> tuple[float, float, int]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_server(Path(tmp))
        try:
            with BlockManagerClient(target, timeout=60) as c:
                c.wait_ready()
                for i in range(POOLS):
                    c.create_pool(f"p{i}", SPEC, SIZING, prefix_caching=True)

                def add(pool: str, n: int) -> None:
                    c.step(pool, admit=[1], admit_tokens=[n], admit_token_ids=prompt[:n], tables=False)
                    c.step(pool, free=[1], tables=False)

                cache_prefixes(scenario_fills(rng, kind), add)
                lat, cached = [], 0
                for _ in range(reps + 3):
                    t0 = time.perf_counter()
                    reply = c.score_prefix(prompt)
                    lat.append(time.perf_counter() - t0)
                    cached = sum(s.cached_tokens for s in reply.scores)
        finally:
            proc.terminate()
            proc.wait(10)
    p50, p99 = percentiles(lat[3:])
    return p50, p99, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing.md"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    a = ap.parse_args()
    reps = 10 if a.quick else 50
    rows = []
    for kind in ("mixed", "full"):
        rows.append(("in-process", kind, *bench_inprocess(kind, reps)))
        rows.append(("gRPC", kind, *bench_grpc(kind, reps)))
        print(rows[-2], rows[-1], flush=True)
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
        "would find cached. gRPC includes sending the 32k token ids (INT64) and the client's decode.", "",
        "| path | cached prefixes | p50 ms | p99 ms | tokens cached, summed over pools |",
        "|---|---|---:|---:|---:|",
    ]
    for path, kind, p50, p99, cached in rows:
        lines.append(f"| {path} | {kind} | {p50 / 1e3:.2f} | {p99 / 1e3:.2f} | {cached:,} |")   # us -> ms
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
