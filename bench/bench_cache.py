"""Prefix-cache hit rate and admission time on Mooncake's FAST'25 conversation trace, against vLLM's BlockPool
and an LRU radix tree at equal capacity and page size.

The trace (kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl, Apache-2.0, 3 MB, 12,031
requests) gives per request an arrival time, input and output lengths and the hash id of each 512-token
block of the input (equal ids = equal prefixes). It is not part of this repository: the bench reads
bench/data/conversation_trace.jsonl (git-ignored), downloading it there first when the network allows
(TRACE_URL), else it says so and exits without results.

Replay (the same for every system): requests in arrival order; block hash id h becomes the 512 tokens
h * 512 + [0, 512) (the last block cut to the input length); a request stays in flight for
``output_length * TPOT`` after it arrives. At each arrival one scheduler iteration: free the requests that
finished, extend the previous arrival by its output tokens (unique tokens, never shared), admit the new one
(refused when its pages do not fit: counted, nothing else). Systems:

- ours: ``kvservice.core.pool.Pool`` (prefix caching, one layer, page_size 512), each iteration one
  ``Pool.step`` with the prompt's token ids (hashing included), eviction policy ``lru-leaf`` (default) and,
  for comparison, ``lru`` (release order, the rule before issue 23);
- vLLM: vLLM 0.33's own ``BlockPool`` (from its wheel, tests/vllm_ref.py) driven as its
  ``KVCacheManager`` drives it for one full-attention group: longest hit by ``get_cached_block`` (at most
  ``(n - 1) // 512`` blocks), ``touch``, ``get_new_blocks``, ``cache_full_blocks`` (prompt blocks; output
  blocks too as they fill, as vLLM does; ``vllm-prompt``: prompt blocks only, as our pool caches),
  ``free_blocks`` tail first. Block hashes are vLLM's
  ``hash_block_tokens`` with ``sha256_cbor``: timed once with the hashing in the loop (what vLLM does when a
  request arrives) and once precomputed outside it (the BlockPool alone);
- radix: an LRU radix tree over pages as SGLang runs it (match the longest cached prefix, lock it, insert
  the new pages, outputs inserted when a request finishes, evict least recently used unlocked leaves).

Capacity: 10 %, 30 % and 100 % of the trace's distinct blocks, in pages (slots) of 512 tokens, the same for
every system (vLLM gets one more block for its null block). Reported: hit rate (input tokens served from the
cache / input tokens), prefill tokens saved, evictions, refused admissions and the replay time (only the
calls into each system are timed; building token arrays is not). Timings are measured, never asserted;
compare ratios of one run.

Usage: python bench/bench_cache.py [--out bench/results/cache.md] [--requests N] [--capacities 0.1,0.3,1.0]
       [--systems ours,ours-lru,radix,vllm,vllm-hash] [--dry]
--dry does everything but the calls into the systems (the trace, token arrays, the schedule, vLLM's precomputed
hashes): under ``valgrind --tool=callgrind`` the difference of a run and its --dry twin is the systems' own
instruction count, repeatable on a loaded machine (bench/results/cache.md; run both with OPENBLAS_NUM_THREADS=1,
whose idle threads otherwise spin for a time-dependent number of instructions, and a fixed PYTHONHASHSEED, after
``python -m compileall -q kvservice tests/vllm_ref.py bench/bench_cache.py``: a run that compiles a stale module
counts the compilation).
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import platform
import sys
import time
import types
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# NumPy imports numpy.ma on the first np.unique call (~47 M instructions, once per process, not per request):
# imported here so that a run and its --dry twin both pay it.
import numpy as np
import numpy.ma

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.contract.errors import ResourceExhausted  # noqa: E402
from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.core.evict import Lru  # noqa: E402
from kvservice.core.planner import plan  # noqa: E402
from kvservice.core.pool import Pool  # noqa: E402

TRACE = ROOT / "bench" / "data" / "conversation_trace.jsonl"
TRACE_URL = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
             "conversation_trace.jsonl")
PS = 512                      # the trace's block size, our page size
TPOT = 0.02                   # seconds per output token: how long a request stays in flight
VLLM_VERSION = "0.33.0"
DRY = False                   # --dry: skip the calls into the systems (callgrind's baseline)
OUT_BASE = 1 << 40            # output tokens: ids above every prompt token, unique per request


@dataclass
class Request:
    rid: int
    arrival: float
    n_in: int
    n_out: int
    hash_ids: list[int]

    @property
    def done(self) -> float:
        return self.arrival + self.n_out * TPOT

    def tokens(self) -> np.ndarray:
        """int64 [n_in]: block h is h * 512 + [0, 512), the last cut to the input length."""
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        return (ids[:, None] * PS + np.arange(PS, dtype=np.int64)).reshape(-1)[:self.n_in]


def load_trace(limit: int | None = None) -> list[Request] | None:
    """The trace's requests in arrival order; None (with a message) when it is not here and cannot be fetched."""
    if not TRACE.is_file():
        try:
            TRACE.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(TRACE_URL, timeout=30) as r:
                data = r.read()
            TRACE.write_bytes(data)
            print(f"downloaded {len(data):,} bytes to {TRACE}")
        except OSError as err:
            print(f"SKIPPED: the Mooncake conversation trace is not at {TRACE} and could not be downloaded from "
                  f"{TRACE_URL} ({err}). Put the file there (Apache-2.0, kvcache-ai/Mooncake) and run again.")
            return None
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])                 # stable: arrival order, ties as listed
    reqs = [Request(i + 1, r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                    list(r["hash_ids"])) for i, r in enumerate(rows)]
    return reqs[:limit] if limit else reqs


@dataclass
class Result:
    system: str
    capacity: int
    hit_tokens: int = 0
    input_tokens: int = 0
    evictions: int = 0
    refused: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0        # this thread's CPU time in the same spans (time.thread_time): less moved by load
    notes: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.input_tokens)


def schedule(reqs: list[Request]):
    """Per arrival: (finished requests, the previous arrival, the new request). The previous arrival gets its
    output in this iteration, so if it also finished by now it is freed in the next one."""
    in_flight: list[tuple[float, int]] = []
    prev = None
    carry: list[int] = []
    for r in reqs:
        done, carry = carry, []
        while in_flight and in_flight[0][0] <= r.arrival:
            done.append(heapq.heappop(in_flight)[1])
        if prev is not None and prev.rid in done:
            done.remove(prev.rid)
            carry.append(prev.rid)
        yield done, prev, r
        heapq.heappush(in_flight, (r.done, r.rid))
        prev = r


# ---- ours --------------------------------------------------------------------------------------------
def run_ours(reqs: list[Request], capacity: int, policy: str = "lru-leaf") -> Result:
    max_len = max(r.n_in + r.n_out for r in reqs)
    pool = Pool("bench", plan(CacheSpec.uniform(1, 1, 64, page_size=PS),
                              Sizing(num_slots=capacity, max_seq_len=max_len)), prefix_caching=True)
    if policy == "lru":
        for a in pool.allocators:
            a.policy = Lru(a.num_slots, a._cached)
    res = Result(f"ours ({policy})", capacity)
    live: set[int] = set()
    clock, cpu = time.perf_counter, time.thread_time
    for done, prev, r in schedule(reqs):
        free = np.array([i for i in done if i in live], dtype=np.uint64)
        ext = prev is not None and prev.rid in live
        tok = r.tokens()
        if DRY:
            res.input_tokens += r.n_in
            continue
        t0, c0 = clock(), cpu()
        try:
            out = pool.step(free_ids=free, extend_ids=[prev.rid] if ext else None,
                            extend_tokens=[prev.n_out] if ext else None, admit_ids=[r.rid], admit_tokens=[r.n_in],
                            admit_token_ids=tok, tables=False)
            res.hit_tokens += int(out.cached_tokens[0])
            live.add(r.rid)
        except ResourceExhausted:
            res.refused += 1
            pool.step(free_ids=free, extend_ids=[prev.rid] if ext else None,
                      extend_tokens=[prev.n_out] if ext else None, tables=False)
        res.seconds += clock() - t0
        res.cpu_seconds += cpu() - c0
        live.difference_update(done)
        res.input_tokens += r.n_in
    res.evictions = pool.allocators[0].evictions
    return res


# ---- vLLM's BlockPool ---------------------------------------------------------------------------------
class VllmDriver:
    """vLLM's BlockPool for one full-attention group, driven as KVCacheManager drives it."""

    def __init__(self, capacity: int, hashes_in_loop: bool, cache_outputs: bool = True) -> None:
        from tests.vllm_ref import load
        bp = load(VLLM_VERSION, "vllm.v1.core.block_pool")
        ku = load(VLLM_VERSION, "vllm.v1.core.kv_cache_utils")
        sha = load(VLLM_VERSION, "vllm.utils.hashing").sha256_cbor
        ku.init_none_hash(sha)
        self.hash_block_tokens, self.sha = ku.hash_block_tokens, sha
        self.pool = bp.BlockPool(capacity + 1, True, PS)        # + the null block vLLM keeps aside
        self.hashes_in_loop = hashes_in_loop
        self.cache_outputs = cache_outputs
        self.blocks: dict[int, list] = {}
        self.reqs: dict[int, types.SimpleNamespace] = {}
        self.evictions = 0
        evict = self.pool._maybe_evict_cached_block

        def counted(block):                        # count what BlockPool evicts, without changing it
            hit = evict(block)
            self.evictions += bool(hit)
            return hit
        self.pool._maybe_evict_cached_block = counted

    def block_hashes(self, tokens: list[int], n_blocks: int, parent: bytes | None = None) -> list[bytes]:
        """vLLM's request block hasher: hash_block_tokens(sha256_cbor, parent, block tokens, None), chained."""
        out = []
        for j in range(n_blocks):
            parent = self.hash_block_tokens(self.sha, parent, tokens[j * PS:(j + 1) * PS], None)
            out.append(parent)
        return out

    def admit(self, rid: int, tokens: list[int] | None, n: int, hashes: list[bytes] | None) -> int | None:
        """Admit n prompt tokens; the hit in tokens, or None when the blocks do not fit (nothing changes)."""
        pool = self.pool
        full = n // PS
        if hashes is None:
            hashes = self.block_hashes(tokens, full)
        hits = []
        for h in hashes[:(n - 1) // PS]:                      # at least one token is computed
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(got[0])
        need = -(-n // PS) - len(hits)
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        if need > pool.get_num_free_blocks() - evictable:
            return None
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(need)
        req = types.SimpleNamespace(block_hashes=list(hashes), n=n)
        pool.cache_full_blocks(req, blocks, len(hits), full, PS, 0)
        self.blocks[rid], self.reqs[rid] = blocks, req
        return len(hits) * PS

    def extend(self, rid: int, k: int) -> None:
        """k output tokens (unique): new blocks as needed; full blocks cached as vLLM does while decoding."""
        req, blocks = self.reqs[rid], self.blocks[rid]
        n = req.n + k
        blocks += self.pool.get_new_blocks(-(-n // PS) - len(blocks))
        full = n // PS
        cached = len(req.block_hashes)
        if full > cached and self.cache_outputs:             # output blocks: unique content, unique hashes
            parent = req.block_hashes[-1] if cached else None
            tail = [int(OUT_BASE + rid * 1_000_000 + t) for t in range(cached * PS, full * PS)]
            req.block_hashes += self.block_hashes(tail, full - cached, parent) if self.hashes_in_loop else \
                [rid.to_bytes(8, "big") + j.to_bytes(8, "big") + bytes(16) for j in range(cached, full)]
            self.pool.cache_full_blocks(req, blocks, cached, full, PS, 0)
        req.n = n

    def free(self, rid: int) -> None:
        self.pool.free_blocks(reversed(self.blocks.pop(rid)))   # tail first, as vLLM frees a request
        del self.reqs[rid]


_PRECOMPUTED: dict[int, dict[int, list[bytes]]] = {}


def run_vllm(reqs: list[Request], capacity: int, hashes_in_loop: bool, cache_outputs: bool = True) -> Result:
    drv = VllmDriver(capacity, hashes_in_loop, cache_outputs)
    res = Result("vLLM BlockPool" + (" + its block hashing" if hashes_in_loop else " (hashes precomputed)") +
                 ("" if cache_outputs else ", prompt blocks only"), capacity)
    pre: dict[int, list[bytes]] = _PRECOMPUTED.get(id(reqs), {})
    if not hashes_in_loop and not pre:
        _PRECOMPUTED[id(reqs)] = pre
        known: dict[int, bytes] = {}                         # a hash id names its prefix: one vLLM hash per id
        for r in reqs:
            tok = r.tokens().tolist()
            out, parent = [], None
            for j in range(r.n_in // PS):
                key = r.hash_ids[j]
                h = known.get(key)
                if h is None:
                    h = known[key] = drv.hash_block_tokens(drv.sha, parent, tok[j * PS:(j + 1) * PS], None)
                out.append(h)
                parent = h
            pre[r.rid] = out
    clock, cpu = time.perf_counter, time.thread_time
    for done, prev, r in schedule(reqs):
        tok = r.tokens().tolist() if hashes_in_loop else None
        if DRY:
            res.input_tokens += r.n_in
            continue
        t0, c0 = clock(), cpu()
        for rid in done:
            if rid in drv.blocks:
                drv.free(rid)
        if prev is not None and prev.rid in drv.blocks:
            drv.extend(prev.rid, prev.n_out)
        hit = drv.admit(r.rid, tok, r.n_in, pre.get(r.rid))
        res.seconds += clock() - t0
        res.cpu_seconds += cpu() - c0
        if hit is None:
            res.refused += 1
        else:
            res.hit_tokens += hit
        res.input_tokens += r.n_in
    res.evictions = drv.evictions
    return res


# ---- an LRU radix tree (SGLang's rule), one node per page --------------------------------------------
class RadixLru:
    """Pages as nodes of a tree keyed by the prefix (the trace's hash id chain). lock: requests using the
    node; evictable: unlocked leaves, least recently used first (SGLang's RadixCache.evict)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0                                 # pages held: tree nodes + pages outside the tree
        self.nodes: dict[object, list] = {}           # key -> [parent key, children, lock, last access]
        self.heap: list[tuple[float, int, object]] = []
        self.tick = 0
        self.evictions = 0
        self.unlocked = 0                             # nodes no request uses (what eviction can take)
        self.own: dict[int, tuple[list, int]] = {}     # rid -> (locked path, pages outside the tree)

    def _touch(self, key: object) -> None:
        self.tick += 1
        self.nodes[key][3] = self.tick

    def _evict(self, n: int) -> bool:
        while n > 0:
            if not self.heap:
                return False
            t, _, key = heapq.heappop(self.heap)
            node = self.nodes.get(key)
            if node is None or node[1] or node[2] or node[3] != t:
                continue
            del self.nodes[key]
            self.used -= 1
            self.evictions += 1
            self.unlocked -= 1
            n -= 1
            parent = node[0]
            if parent is not None:
                p = self.nodes[parent]
                p[1] -= 1
                if not p[1] and not p[2]:
                    heapq.heappush(self.heap, (p[3], id(p), parent))
        return True

    def _lock(self, key: object) -> None:
        node = self.nodes[key]
        self.unlocked -= node[2] == 0
        node[2] += 1

    def _release(self, key: object) -> None:
        node = self.nodes[key]
        node[2] -= 1
        self.unlocked += node[2] == 0
        if not node[2] and not node[1]:
            heapq.heappush(self.heap, (node[3], id(node), key))

    def admit(self, rid: int, r: Request) -> int | None:
        full = r.n_in // PS
        keys = r.hash_ids[:full]             # a hash id names its whole prefix (checked on this trace): the key
        hit = 0
        while hit < (r.n_in - 1) // PS and keys[hit] in self.nodes:
            hit += 1
        need = -(-r.n_in // PS) - hit
        free = self.capacity - self.used
        if need > free and not self._can_evict(need - free, keys[:hit]):
            return None
        for k in keys[:hit]:
            self._lock(k)
            self._touch(k)
        if need > free:
            self._evict(need - free)
        self.used += need
        path = list(keys[:hit])
        for j in range(hit, full):                    # the new full prompt pages join the tree, locked
            k = keys[j]
            if k in self.nodes:                       # the same page inserted meanwhile: keep one
                self._lock(k)
                self.used -= 1
            else:
                parent = keys[j - 1] if j else None
                self.nodes[k] = [parent, 0, 1, 0]
                if parent is not None:
                    self.nodes[parent][1] += 1
            self._touch(k)
            path.append(k)
        self.own[rid] = (path, -(-r.n_in // PS) - full)
        return hit * PS

    def _can_evict(self, n: int, pinned: list) -> bool:
        """Whether n pages can be evicted without the `pinned` ones (unlocked nodes; every unlocked subtree
        drains leaf by leaf)."""
        return self.unlocked - sum(1 for k in pinned if not self.nodes[k][2]) >= n

    def extend(self, rid: int, r: Request) -> None:
        path, outside = self.own[rid]
        extra = -(-(r.n_in + r.n_out) // PS) - -(-r.n_in // PS)
        free = self.capacity - self.used
        if extra > free:
            self._evict(extra - free)
        self.used += extra
        self.own[rid] = (path, outside + extra)

    def free(self, rid: int, r: Request) -> None:
        """The finished request's pages: outputs inserted as SGLang does (full pages; unique, so new nodes)."""
        path, outside = self.own.pop(rid)
        n = r.n_in + r.n_out
        full_total = n // PS
        parent = path[-1] if path else None
        inserted = 0
        for j in range(len(path), full_total):
            k = ("out", rid, j)
            self.nodes[k] = [parent, 0, 0, 0]
            self.unlocked += 1
            if parent is not None:
                self.nodes[parent][1] += 1
            self._touch(k)
            parent = k
            inserted += 1
        self.used -= outside - inserted               # the partial last page leaves; full ones stay in the tree
        if inserted:
            node = self.nodes[parent]
            heapq.heappush(self.heap, (node[3], id(node), parent))
        for k in path:
            self._release(k)


def run_radix(reqs: list[Request], capacity: int) -> Result:
    tree = RadixLru(capacity)
    res = Result("LRU radix tree (SGLang's rule)", capacity)
    by_id = {r.rid: r for r in reqs}
    clock, cpu = time.perf_counter, time.thread_time
    for done, prev, r in schedule(reqs):
        if DRY:
            res.input_tokens += r.n_in
            continue
        t0, c0 = clock(), cpu()
        for rid in done:
            if rid in tree.own:
                tree.free(rid, by_id[rid])
        if prev is not None and prev.rid in tree.own:
            tree.extend(prev.rid, prev)
        hit = tree.admit(r.rid, r)
        res.seconds += clock() - t0
        res.cpu_seconds += cpu() - c0
        if hit is None:
            res.refused += 1
        else:
            res.hit_tokens += hit
        res.input_tokens += r.n_in
    res.evictions = tree.evictions
    return res


# ---- report ----------------------------------------------------------------------------------------------
def ideal(reqs: list[Request]) -> float:
    """Hit rate with an unbounded cache (every block id seen before is a hit, up to (n - 1) // 512 blocks)."""
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        lim = (r.n_in - 1) // PS
        j = 0
        while j < lim and r.hash_ids[j] in seen:
            j += 1
        hit += j * PS
        total += r.n_in
        seen.update(r.hash_ids[:r.n_in // PS])
    return hit / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cache.md"))
    ap.add_argument("--requests", type=int, default=0, help="only the first N requests (0 = all)")
    ap.add_argument("--capacities", default="0.1,0.3,1.0", help="fractions of the trace's distinct blocks")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (its files not fetched)")
    ap.add_argument("--systems", default="ours,ours-lru,radix,vllm,vllm-hash", help="which to run, in this order")
    ap.add_argument("--dry", action="store_true", help="skip the calls into the systems (callgrind's baseline)")
    args = ap.parse_args()
    global DRY
    DRY = args.dry
    reqs = load_trace(args.requests or None)
    if reqs is None:
        return 0
    distinct = len({h for r in reqs for h in r.hash_ids})
    caps = [max(1, int(float(f) * distinct)) for f in args.capacities.split(",")]
    n_in = sum(r.n_in for r in reqs)
    print(f"{len(reqs)} requests, {n_in:,} input tokens, {distinct:,} distinct blocks; unbounded-cache hit rate "
          f"{ideal(reqs):.4f}", flush=True)
    if not args.no_vllm:
        from tests.vllm_ref import have
        if not have(VLLM_VERSION):
            print(f"vLLM {VLLM_VERSION}'s files are not fetched (python -m tests.vllm_ref fetch): no vLLM rows")
            args.no_vllm = True
    rows: list[Result] = []
    for cap in caps:
        table = {"ours": lambda c=cap: run_ours(reqs, c), "ours-lru": lambda c=cap: run_ours(reqs, c, "lru"),
                 "radix": lambda c=cap: run_radix(reqs, c), "vllm": lambda c=cap: run_vllm(reqs, c, False),
                 "vllm-hash": lambda c=cap: run_vllm(reqs, c, True),
                 "vllm-prompt": lambda c=cap: run_vllm(reqs, c, False, cache_outputs=False)}
        runs = [table[name] for name in args.systems.split(",")
                if not (args.no_vllm and name.startswith("vllm"))]
        for run in runs:
            res = run()
            rows.append(res)
            print(f"  capacity {cap:>7,}: {res.system:<45} hit rate {res.hit_rate:.4f}  saved "
                  f"{res.hit_tokens:>12,}  evictions {res.evictions:>9,}  refused {res.refused:>4}  "
                  f"{res.seconds:7.2f} s ({res.cpu_seconds:.2f} s CPU)", flush=True)
    if not DRY:
        write(args.out, reqs, distinct, n_in, rows)
    return 0


def write(path: str, reqs: list[Request], distinct: int, n_in: int, rows: list[Result]) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Prefix cache on Mooncake's conversation trace", "",
             f"`python bench/bench_cache.py` ({now}; {platform.processor() or platform.machine()}, "
             f"Python {platform.python_version()}, NumPy {np.__version__}; vLLM {VLLM_VERSION}'s BlockPool from its "
             "wheel). Method: bench/bench_cache.py's docstring.", "",
             f"{len(reqs):,} requests, {n_in:,} input tokens, {distinct:,} distinct 512-token blocks; hit rate of "
             f"an unbounded cache: {ideal(reqs):.4f}. In flight: output_length x {TPOT * 1000:.0f} ms.", "",
             "| capacity (pages) | system | hit rate | prefill tokens saved | evictions | refused | replay s | "
             "replay CPU s | x ours (lru-leaf), CPU |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r.capacity: r.cpu_seconds for r in rows if r.system == "ours (lru-leaf)"}
    base = {r.capacity: base.get(r.capacity) or float("nan") for r in rows}
    for r in rows:
        frac = r.capacity / distinct
        lines.append(f"| {r.capacity:,} ({frac:.0%}) | {r.system} | {r.hit_rate:.4f} | {r.hit_tokens:,} | "
                     f"{r.evictions:,} | {r.refused} | {r.seconds:.2f} | {r.cpu_seconds:.2f} | "
                     f"{r.cpu_seconds / base[r.capacity]:.2f} |")
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
