"""Resident bytes a cached page of a prefix-cached pool costs beside its slot (issue 27: what slot_units models).

In one process, the way the server composes the manager (BlockManager with its event hub and fleet index,
ManagerAPI.Step): a prefix-cached pool of 2^21 slots per page size; rounds of 8,192 prompts of 128 random tokens
(with their token ids) admitted and then freed, so every full page ends up cached; VmRSS after each round minus
VmRSS before the first (the pool's own arrays are allocated at create, before it). Each page size runs in a
process of its own. The figure per cached page
is compared with kvservice.manager.pools' model (SLOT_UNIT_BYTES x slot_units - SLOT_UNIT_BYTES).

Writes a marked section of bench/results/durability.md and prints it. Usage: python bench/bench_cached_pages.py
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.contract.geometry import CacheSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.contract.wire import to_tensor  # noqa: E402
from kvservice.manager.api import ManagerAPI  # noqa: E402
from kvservice.manager.pools import SLOT_UNIT_BYTES, BlockManager, slot_units  # noqa: E402
from kvservice.v1 import block_manager_pb2 as pb  # noqa: E402

BEGIN, END = "<!-- bench_cached_pages: begin -->", "<!-- bench_cached_pages: end -->"
PROMPTS, TOKENS, ROUNDS = 8192, 128, 8


def vm_rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure(page_size: int) -> list[tuple[int, float]]:
    """(cached pages, resident bytes per cached page) after each round."""
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(32, 8, 128, page_size=page_size), Sizing(num_slots=1 << 21, max_seq_len=4096),
                  prefix_caching=True)
    api = ManagerAPI(m)
    rng = np.random.default_rng(27)
    gc.collect()
    base, out, cached = vm_rss(), [], 0
    for r in range(ROUNDS):
        ids = np.arange(r * PROMPTS, (r + 1) * PROMPTS, dtype=np.uint64) + 1
        counts = np.full(PROMPTS, TOKENS, dtype=np.int64)
        api.Step(pb.StepRequest(pool="p", admit_seq_ids=to_tensor(ids), admit_num_tokens=to_tensor(counts),
                                admit_token_ids=to_tensor(rng.integers(1, 50_000, PROMPTS * TOKENS)), omit_tables=True))
        api.Step(pb.StepRequest(pool="p", free_seq_ids=to_tensor(ids), omit_tables=True))
        cached += PROMPTS * (TOKENS // page_size)
        gc.collect()
        out.append((cached, (vm_rss() - base) / cached))
    return out


def section(results: dict[int, list[tuple[int, float]]]) -> str:
    lines = [BEGIN, "## What a cached page costs (issue 27: the model behind slot_units)", "",
             f"`python bench/bench_cached_pages.py` ({time.strftime('%Y-%m-%d')}): in one process, BlockManager with "
             f"its event hub and fleet index, ManagerAPI.Step; rounds of {PROMPTS:,} prompts of {TOKENS} random tokens "
             "admitted with their token ids and freed (every full page stays cached); VmRSS growth over the cached "
             "pages so far (the pool's arrays were allocated at create, before the first round).", "",
             "| page size | cached pages | bytes per cached page (measured) | model: (slot_units - 1) x "
             f"{SLOT_UNIT_BYTES} |", "|---:|---:|---:|---:|"]
    for ps, rows in results.items():
        model = (slot_units(ps, True) - 1) * SLOT_UNIT_BYTES
        lines += [f"| {ps} | {n:,} | {b:,.0f} | {model:,} |" for n, b in rows]
    lines += ["", "The cost per page falls as the cache grows (arrays that grow by doubling pay their slack early); "
              "the model is set near the figure of large caches, where the bound matters. bench_limits.py --mix "
              "measures the whole manager at the largest legal prefix-cached pool.", END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "durability.md"))
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--one", type=int, default=0, help="measure this page size here and print JSON (internal)")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one)))
        return 0
    results = {}
    for ps in a.page_sizes.split(","):              # each in a fresh process: the heap of one is not the next's
        out = subprocess.run([sys.executable, __file__, "--one", ps], capture_output=True, text=True, check=True)
        results[int(ps)] = [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]
    text = section(results)
    print(text)
    path = Path(a.results)
    old = path.read_text()
    if BEGIN in old:
        old = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    else:
        old = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
