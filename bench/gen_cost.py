"""What the page-generation check costs the decode kernel (issue 26 item 2), this tree against another.

Two measurements, no GPU needed:

1. **SASS, static** (sm_90, nvcc -cubin, cuobjdump -sass): instructions of a decode entry, in all and in
   its tile loop (the instructions between the loop's back-edge branch and its target: the cp.async
   pipeline, scores, softmax and P.V), and its registers (ptxas -v). The generation check lives in the
   bounds pass before the loop, so the tile loop should not change at all.
2. **Emulated, dynamic** (g++ host emulation -O2, valgrind --tool=callgrind, instructions counted inside
   kv_emu_launch only): one decode launch of B rows x P pages, with and without generations, and the same
   launch on the other tree's kernels; the added instructions per page and block.

Usage: python bench/gen_cost.py [--before DIR] [--results FILE]   (default --before /work/main)
Writes bench/results/generations.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.ci import find_nvcc  # noqa: E402
from tests.kernels.test_nvcc import parse_ptxas  # noqa: E402

ENTRIES = ("kv_decode_f16_g4_d128", "kv_decode_f16_g1_d128", "kv_decode_bf16_g8_d64")
B, PAGES, PS, KH, HQ, D = 4, 64, 16, 2, 8, 128          # emulated launch: rows, pages per row, page size, heads


def cuobjdump() -> str:
    import nvidia

    for root in nvidia.__path__:
        for p in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(p)
    raise RuntimeError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def sass(tree: Path, tmp: Path) -> dict[str, dict[str, int]]:
    """entry -> {total, loop, registers} from a sm_90 cubin of the tree's decode_attention.cu."""
    kdir = tree / "kvservice" / "worker" / "kernels"
    cubin = tmp / f"{tree.name}.cubin"
    proc = subprocess.run([find_nvcc(), "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", f"-I{kdir}",
                           str(kdir / "decode_attention.cu"), "-o", str(cubin)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    regs = {r["function"]: r.get("registers", 0) for r in parse_ptxas(proc.stdout + proc.stderr)}
    dump = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    out = {}
    for name in ENTRIES:
        body = dump.split(f"Function : {name}\n", 1)[1].split("Function : ", 1)[0]
        ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)
        addr = [int(a, 16) for a, _ in ins]
        # the tile loop: the backward branch spanning the most instructions (the outer loop over tiles)
        loops = []
        for i, (_, text) in enumerate(ins):
            target = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
            if target:
                t = int(target.group(1), 16)
                if t < addr[i]:
                    loops.append(sum(1 for a in addr if t <= a <= addr[i]))
        out[name] = {"total": len(ins), "loop": max(loops) if loops else 0, "registers": int(regs.get(name, 0))}
    return out


DRIVER = r"""
import os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
os.environ["KVK_CPU_VARIANT"] = "plain"
from kvservice.worker import kernels_cpu as kc
from kvservice.worker.kernel_api import PageLayout
B, PAGES, PS, KH, HQ, D = {shape}
with_gens = sys.argv[2] == "1"
rng = np.random.default_rng(0)
slots = B * PAGES
L = PageLayout.per_layer(slots, PS, KH, D, "float16")
cache = rng.standard_normal(slots * L.page_elems).astype(np.float16)
indptr = (np.arange(B + 1) * PAGES).astype(np.int32)
indices = rng.permutation(slots).astype(np.int32)
lpl = np.full(B, PS, np.int32)
q = rng.standard_normal((B, HQ, D)).astype(np.float16)
kw = {{}}
if with_gens:
    pg = rng.integers(1, 1000, slots).astype(np.uint32)
    kw = dict(generations=pg[indices], page_gen=pg)
r = kc.decode_attention(q, cache, L, indptr, indices, lpl, kv_chunk_pages=0, **kw)
assert r.record.count == 0
"""


def emulated(tree: Path, with_gens: bool, tmp: Path) -> int:
    """Instructions (callgrind Ir) inside kv_emu_launch for one decode launch of the tree's emulated kernels."""
    script = tmp / "drive.py"
    script.write_text(DRIVER.format(shape=(B, PAGES, PS, KH, HQ, D)))
    env = {**os.environ, "OMP_NUM_THREADS": "128", "OMP_WAIT_POLICY": "passive", "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); "
                    "from kvservice.worker import kernels_cpu; kernels_cpu.build('plain')"], check=True, env=env)
    out = tmp / f"cg.{tree.name}.{int(with_gens)}"
    subprocess.run(["valgrind", "--tool=callgrind", "--toggle-collect=kv_emu_launch*", f"--callgrind-out-file={out}",
                    sys.executable, str(script), str(tree), "1" if with_gens else "0"], check=True, env=env,
                   capture_output=True)
    summary = [ln for ln in out.read_text().splitlines() if ln.startswith(("summary:", "totals:"))]
    return int(summary[-1].split()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="/work/main")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "generations.md"))
    args = ap.parse_args()
    before, after = Path(args.before), ROOT
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        s_before, s_after = sass(before, tmp), sass(after, tmp)
        e_before = emulated(before, False, tmp)
        e_plain, e_gens = emulated(after, False, tmp), emulated(after, True, tmp)
    per_row = KH * -(-(HQ // KH) // 4)                # kv heads x q-head chunks of 4 (the g4 entry)
    lines = ["# Cost of the page-generation check in the decode kernel (bench/gen_cost.py)", "",
             f"Before: {before}; after: this tree. No GPU: static SASS (sm_90) and emulated dynamic counts.", "",
             "## SASS, sm_90 (nvcc -cubin, cuobjdump -sass): instructions", "",
             "| entry | total before | total after | tile loop before | tile loop after | registers before | after |",
             "|---|---|---|---|---|---|---|"]
    for n in ENTRIES:
        b, a = s_before[n], s_after[n]
        lines.append(f"| {n} | {b['total']} | {a['total']} | {b['loop']} | {a['loop']} | {b['registers']} | "
                     f"{a['registers']} |")
    lines += ["", f"## Emulated (g++ -O2 host emulation, callgrind Ir inside kv_emu_launch): one launch, {B} rows x "
              f"{PAGES} pages of {PS} tokens, {HQ} q heads / {KH} kv heads, head_dim {D}, float16", "",
              "| kernels | generations | instructions | vs before |", "|---|---|---|---|",
              f"| before | (none) | {e_before:,} | 1.0000 |",
              f"| after | not given (null) | {e_plain:,} | {e_plain / e_before:.4f} |",
              f"| after | checked | {e_gens:,} | {e_gens / e_before:.4f} |", "",
              f"Added by the check: {e_gens - e_plain:,} instructions, "
              f"{(e_gens - e_plain) / (B * PAGES * per_row):,.1f} per page per block (each of the {per_row} "
              f"blocks of a row checks the row's {PAGES} pages once, before its tile loop)."]
    text = "\n".join(lines) + "\n"
    Path(args.results).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
