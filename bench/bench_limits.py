"""Peak memory of the manager for the largest Step its default limits allow (issue #11).

Starts a real `kvservice serve` process with the shipped manager's limits (message limit of the
base overlay, default Limits: 65,536 sequences and 8,388,608 new tokens per Step, 2^24 slots per
pool), creates the largest pool those limits allow, sends the largest Step they allow, and reads
the process's peak resident set (VmHWM from /proc) before and after. Cases:

  - prefix-cached admission: 65,536 prompts of 128 tokens (8,388,608 tokens, with their token ids)
    into a 2^24-slot pool of 32 per_layer layers, tables returned;
  - one 131,072-token sequence beside 65,535 one-token sequences (the ragged slot-table case);
  - a 16-index-space interleaved pool with the biggest admission its reply limit lets through.

Writes the figures into bench/results/durability.md (a marked section, replaced on each run)
and prints them. Usage: python bench/bench_limits.py [--results FILE]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvservice.client import BlockManagerClient  # noqa: E402
from kvservice.contract.geometry import CacheSpec, LayerSpec  # noqa: E402
from kvservice.contract.sizing import Sizing  # noqa: E402
from kvservice.tools.launch import wait_for_ports  # noqa: E402

MESSAGE_BYTES = 128 << 20          # deploy/base: --max-message-bytes
DEPLOY_MEMORY = 4 << 30            # deploy/base manager-statefulset.yaml: limits.memory
BEGIN, END = "<!-- bench_limits: begin -->", "<!-- bench_limits: end -->"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "durability.md"))
    a = ap.parse_args()
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
    path = Path(a.results)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return 0 if all(r["peak"] < DEPLOY_MEMORY for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
