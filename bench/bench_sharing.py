"""Sharing benchmarks: admission with 80% prefix hits vs no sharing, and decode steps of a hybrid model.

Writes a markdown report (default bench/results/sharing.md). Measured, never asserted.
Usage: python bench/bench_sharing.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_manager import machine, percentiles, start_server  # noqa: E402
from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec, LayerSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.core.planner import plan  # noqa: E402
from kvservice.core.pool import Pool  # noqa: E402

B = 256
SHARED, TAIL = 512, 128           # 640-token prompts, 80% of them a shared system prompt
SPEC = CacheSpec.uniform(32, 8, 128, "float16", 16)
HYBRID = CacheSpec((LayerSpec(8, 256, "bfloat16", 1024),) * 5 + (LayerSpec(8, 512, "bfloat16"),), 16, "interleaved")


def prompts(rng: np.random.Generator, system: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(system prompt, token ids of B prompts = system + a fresh random tail each)."""
    system = rng.integers(0, 32000, SHARED) if system is None else system
    tails = rng.integers(0, 32000, (B, TAIL))
    return system, np.concatenate([np.concatenate((system, t)) for t in tails])


def admission_inprocess(reps: int, caching: bool) -> tuple[float, float, int]:
    rng = np.random.default_rng(0)
    system, toks = prompts(rng)
    pool = Pool("b", plan(SPEC, Sizing(num_slots=B * 41 + 64, max_seq_len=1024)), prefix_caching=caching)
    extra = {"admit_token_ids": system} if caching else {}
    pool.step(admit_ids=[10**9], admit_tokens=[SHARED], **extra)       # warm the cache
    ids = np.arange(1, B + 1, dtype=np.uint64)
    lat, cached = [], 0
    for _ in range(reps):
        _, toks = prompts(rng, system)                  # new tails: only the system prompt can hit
        t0 = time.perf_counter()
        r = pool.step(admit_ids=ids, admit_tokens=np.full(B, SHARED + TAIL),
                      **({"admit_token_ids": toks} if caching else {}))
        lat.append(time.perf_counter() - t0)
        cached = int(r.cached_tokens.sum())
        pool.step(free_ids=ids)
    p50, p99 = percentiles(lat[1:])
    return p50, p99, cached


def admission_grpc(target: str, reps: int, caching: bool) -> tuple[float, float, int]:
    rng = np.random.default_rng(0)
    system, toks = prompts(rng)
    name = f"adm-{int(caching)}"
    with BlockManagerClient(target, timeout=60) as c:
        c.create_pool(name, SPEC, Sizing(num_slots=B * 41 + 64, max_seq_len=1024), prefix_caching=caching)
        extra = {"admit_token_ids": system} if caching else {}
        c.step(name, admit=[10**9], admit_tokens=SHARED, tables=False, **extra)
        ids = np.arange(1, B + 1, dtype=np.uint64)
        lat, cached = [], 0
        for _ in range(reps):
            _, toks = prompts(rng, system)
            t0 = time.perf_counter()
            r = c.step(name, admit=ids, admit_tokens=SHARED + TAIL, **({"admit_token_ids": toks} if caching else {}))
            lat.append(time.perf_counter() - t0)
            cached = int(r.cached_tokens.sum())
            c.step(name, free=ids, tables=False)
    p50, p99 = percentiles(lat[1:])
    return p50, p99, cached


def decode(spec: CacheSpec, steps: int) -> tuple[float, float, int]:
    rng = np.random.default_rng(0)
    ctx = rng.integers(1024, 4096, B)
    pool = Pool("d", plan(spec, Sizing(num_slots=int((ctx + steps).sum() // 16) + 2 * B, max_seq_len=8192)))
    ids = np.arange(1, B + 1, dtype=np.uint64)
    pool.step(admit_ids=ids, admit_tokens=ctx)
    ones = np.ones(B, dtype=np.int64)
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pool.step(extend_ids=ids, extend_tokens=ones)
        lat.append(time.perf_counter() - t0)
    held = [len(pool.sequence_slots(1, g)) for g in range(len(pool.allocators))]
    p50, p99 = percentiles(lat[steps // 10:])
    return p50, p99, max(held) - min(held)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench/results/sharing.md"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps, steps = (3, 20) if args.quick else (20, 300)
    rows = [("in-process", caching, *admission_inprocess(reps, caching)) for caching in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_server(Path(tmp))
        try:
            rows += [("gRPC", caching, *admission_grpc(target, reps, caching)) for caching in (False, True)]
        finally:
            proc.terminate()
            proc.wait(10)
    dec = [("32 full-attention layers, per_layer", *decode(SPEC, steps)),
           ("hybrid: 5 sliding (w=1024, head_dim 256) + 1 global (head_dim 512), interleaved",
            *decode(HYBRID, steps))]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Sharing benchmarks", "", f"Run {now} on {machine()}.",
             f"Command: `make bench` (`python bench/bench_sharing.py{' --quick' if args.quick else ''}`). Measured, "
             "not asserted; compare rows of one run.", "",
             f"## Admission of B={B} prompts of {SHARED + TAIL} tokens, {SHARED} of them a shared system prompt "
             "(80% prefix hit)", "",
             "Each admission Step carries the 256 prompts' token ids (163,840 ids); with caching the manager hashes "
             "every full page, confirms hits by token ids and shares 32 cached pages per prompt.", "",
             "| path | prefix caching | p50 ms | p99 ms | tokens served from cache |", "|---|---|---:|---:|---:|"]
    lines += [f"| {path} | {'on' if c else 'off'} | {p50 / 1e3:.2f} | {p99 / 1e3:.2f} | {cached:,} |"
              for path, c, p50, p99, cached in rows]
    lines += ["", f"## Decode Step, B={B}, +1 token each, contexts 1024-4096 tokens, in-process", "",
              "| model | p50 us | p99 us | pages released per sequence by the window |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p50:.0f} | {p99:.0f} | {rel} |" for name, p50, p99, rel in dec]
    lines.append("")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
