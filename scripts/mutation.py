"""Mutation check: do the tests notice a planted bug? Writes bench/results/mutation.md.

Two parts (`make mutation` runs both):

- Python: mutmut mutates the domain modules named in pyproject's [tool.mutmut]
  (pool, stepplan, emit, rowslots, geometry, prefix, pagetable, allocator, the
  NumPy kernels) and runs the tests that cover each mutant. Survivors are listed
  with their diff; a survivor that is equivalent (no test can tell it apart) is
  explained in bench/mutation_equivalent.txt, one ``name: why`` per line.
- CUDA sources: hand-made mutants of worker/kernels/*.cu (a bounds check
  dropped, an off-by-one, 32-bit address arithmetic, a lost violation flag), each
  applied to a copy of the tree and run against the emulated-kernel tests
  (ASan included). A mutant survives if those tests still pass.

Every Python mutant runs with KV_DIFF_SCALE=0.05 (the differential test's short runs). The whole
set is about 4,600 mutants: hours on a 2-core machine. --sample N runs a seeded random sample of N
mutants per module (2 N for pool.py) and reports the sample's score and survivors.

Each part's results are kept in bench/results/mutation_python.json and mutation_cu.json (the
command that ran, seed, sample, every mutant's status, survivors' diffs), and the report is built
from both files, so a part can be rerun alone (--report alone rebuilds the report).

Usage: python scripts/mutation.py [--python] [--cu] [--report] [--sample N] [--seed S]
                                  [--out bench/results/mutation.md] [--max-children N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "bench" / "mutation_equivalent.txt"
RESULTS = {"python": ROOT / "bench" / "results" / "mutation_python.json",
           "cu": ROOT / "bench" / "results" / "mutation_cu.json"}
CU_TESTS = ["tests/kernels/test_decode.py", "tests/kernels/test_append_copy.py",
            "tests/kernels/test_validate_guard.py", "tests/kernels/test_sanitizers.py",
            "tests/kernels/test_large_offset.py"]

# (file, text to find, replacement, what the mutant breaks). Each must match exactly once.
CU_MUTANTS: list[tuple[str, str, str, str]] = [
    ("paged.cuh", "if (p < 0 || p >= L.pool_pages) return KV_OUT_OF_BOUNDS;",
     "if (p < 0 || p > L.pool_pages) return KV_OUT_OF_BOUNDS;", "pool end off by one"),
    ("paged.cuh", "if (p < 0 || p >= L.pool_pages) return KV_OUT_OF_BOUNDS;",
     "if (p >= L.pool_pages) return KV_OUT_OF_BOUNDS;", "negative pages accepted"),
    ("paged.cuh", "if (p < L.base || p >= L.upper_bound) return KV_WRONG_INDEX_SPACE;",
     "", "another index space's pages accepted (seed 004)"),
    ("paged.cuh", "if (p < L.base || p >= L.upper_bound) return KV_WRONG_INDEX_SPACE;",
     "if (p < L.base || p > L.upper_bound) return KV_WRONG_INDEX_SPACE;", "space end off by one"),
    ("paged.cuh", "if (L.scale > 1 && (p - L.base - L.offset) % L.scale != 0) return KV_OFF_LATTICE;",
     "", "lattice check dropped"),
    ("paged.cuh", "if (L.scale > 1 && (p - L.base - L.offset) % L.scale != 0) return KV_OFF_LATTICE;",
     "if (L.scale > 1 && (p - L.offset) % L.scale != 0) return KV_OFF_LATTICE;", "lattice ignores the base"),
    ("paged.cuh", "return (p - L.base) * L.page_stride + ((kv * L.page_size + tok) * L.kv_heads + h) * L.head_dim;",
     "return (long long)((int)(p - L.base) * (int)L.page_stride) + ((kv * L.page_size + tok) * L.kv_heads + h) * "
     "L.head_dim;", "32-bit page offset (seed 002)"),
    ("paged.cuh", "return (p - L.base) * L.page_stride + ((kv * L.page_size + tok) * L.kv_heads + h) * L.head_dim;",
     "return p * L.page_stride + ((kv * L.page_size + tok) * L.kv_heads + h) * L.head_dim;",
     "addressing forgets the base"),
    ("paged.cuh", "if (b < a || b > nnz || (row == batch - 1 && b != nnz)) { *value = b; return KV_BAD_INDPTR; }",
     "if (b > nnz || (row == batch - 1 && b != nnz)) { *value = b; return KV_BAD_INDPTR; }",
     "decreasing indptr accepted"),
    ("paged.cuh", "if (l <= 0 || l > page_size) { *value = l; return KV_BAD_LAST_PAGE_LEN; }",
     "if (l < 0 || l > page_size) { *value = l; return KV_BAD_LAST_PAGE_LEN; }", "last_page_len 0 accepted"),
    ("paged.cuh", "atomicAdd(&rec[0], 1ull);", "", "violations not counted"),
    ("paged.cuh", "o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);",
     "o[2 * i + 1] = __uint_as_float(w[i] & 0xfffe0000u);", "bf16 conversion drops a mantissa bit"),
]


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _status(code: int | None) -> str:
    """mutmut's reading of a mutant's exit code (mutmut.stats.status_by_exit_code)."""
    from mutmut.stats import status_by_exit_code
    return status_by_exit_code[code]


def _statuses(names: list[str] | None) -> dict[str, str]:
    """Mutant name -> status, from mutmut's .meta files (all mutants, or only `names`)."""
    out = {}
    for f in sorted(glob.glob(str(ROOT / "mutants" / "**" / "*.meta"), recursive=True)):
        for k, code in json.loads(Path(f).read_text()).get("exit_code_by_key", {}).items():
            if names is None or k in names:
                out[k] = _status(code)
    return out


def python_part(max_children: int, sample: int = 0, seed: int = 10) -> dict:
    """Run mutmut (all mutants, or a seeded sample per module); counts per status and survivors' diffs."""
    mutmut = [sys.executable, "-m", "mutmut"]
    env = {**os.environ, "KV_DIFF_SCALE": "0.05"}
    t0 = time.time()
    names = None
    if sample:
        _run([*mutmut, "run", "--max-children", str(max_children), "no-such-mutant"], ROOT, 3600, env)
        rng = random.Random(seed)
        names = []
        for f in sorted(glob.glob(str(ROOT / "mutants" / "**" / "*.meta"), recursive=True)):
            keys = sorted(json.loads(Path(f).read_text()).get("exit_code_by_key", {}))
            names += rng.sample(keys, min(2 * sample if f.endswith("pool.py.meta") else sample, len(keys)))
    run = _run([*mutmut, "run", "--max-children", str(max_children), *(names or [])], ROOT, 6 * 3600, env)
    status = _statuses(set(names) if names else None)
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    survivors = sorted(k for k, s in status.items() if s in ("survived", "no tests"))
    diffs = {name: _run([*mutmut, "show", name], ROOT, 120).stdout for name in survivors}
    return {"seconds": time.time() - t0, "counts": counts, "total": len(status), "sample": sample,
            "survivors": diffs, "status": status, "run_tail": run.stdout[-2000:]}


def cu_part() -> list[tuple[str, str, str]]:
    """Apply each hand-made .cu mutant to a copy of the tree; (file, what, killed|survived|bad mutant)."""
    out: list[tuple[str, str, str]] = []
    for fname, find, repl, what in CU_MUTANTS:
        src = (ROOT / "worker" / "kernels" / fname).read_text()
        if src.count(find) != 1:
            out.append((fname, what, "not applied (source changed)"))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            for part in ("worker", "kvservice", "clients", "tests", "pyproject.toml"):
                p = ROOT / part
                (shutil.copytree if p.is_dir() else shutil.copy)(p, tree / part)
            (tree / "worker" / "kernels" / fname).write_text(src.replace(find, repl))
            env = {**os.environ, "PYTHONPATH": str(tree)}
            r = _run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *CU_TESTS], tree,
                     1800, env)
            out.append((fname, what, "killed" if r.returncode != 0 else "survived"))
            print(f"{fname}: {what}: {out[-1][2]}", flush=True)
    return out


def equivalents() -> dict[str, str]:
    if not EQUIVALENT.exists():
        return {}
    pairs = (line.split(":", 1) for line in EQUIVALENT.read_text().splitlines() if ":" in line
             and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def report(py: dict | None, cu: dict | None) -> str:
    lines = ["# Mutation check", "",
             f"Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC by `make mutation` "
             "(`python scripts/mutation.py`).", ""]
    if py is not None:
        c = py["counts"]
        killed, survived, untested = c.get("killed", 0), c.get("survived", 0), c.get("no tests", 0)
        eq = equivalents()
        explained = [n for n in py["survivors"] if n in eq]
        unexplained = [n for n in py["survivors"] if n not in eq]
        score = killed / max(killed + survived + untested, 1)
        what = (f"a seeded sample of {py['total']} mutants ({py['sample']} per module, {2 * py['sample']} of "
                "pool.py)" if py["sample"] else f"all {py['total']} mutants")
        per_module: dict[str, list[int]] = {}
        for name, s in py["status"].items():
            row = per_module.setdefault(name.split(".x")[0], [0, 0, 0])      # kvservice.pool.x_step__mutmut_3
            row[0] += s in ("killed", "timeout", "segfault")
            row[1] += s == "survived"
            row[2] += s == "no tests"
        lines += ["## Python (mutmut)", "",
                  f"{what}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) +
                  f"; score (killed / killed + survived + no tests) {score:.1%} ({py['seconds'] / 60:.0f} min; "
                  "timeouts count as killed: the mutant hung a test).", "",
                  "| module | killed | survived | no tests |", "|---|---:|---:|---:|"]
        lines += [f"| {m} | {k} | {s} | {u} |" for m, (k, s, u) in sorted(per_module.items())]
        lines += ["", f"Survivors explained as equivalent: {len(explained)}; unexplained: {len(unexplained)}.", ""]
        for n in explained:
            lines.append(f"- `{n}` (equivalent): {eq[n]}")
        for n in unexplained:
            lines += [f"- `{n}`", "", "```diff", py["survivors"][n].strip()[:1500], "```", ""]
    if cu is not None:
        res = cu["results"]
        n_killed = sum(r == "killed" for _, _, r in res)
        lines += ["", "## CUDA sources (hand-made mutants, emulated kernels under the kernel tests)", "",
                  f"`{cu['command']}`: {len(res)} mutants, {n_killed} killed, {len(res) - n_killed} not killed "
                  f"({cu['seconds'] / 60:.0f} min). Each rebuilds the g++-emulated kernels (plain and ASan) in a "
                  "copy of the tree and runs " + ", ".join(f"`{t}`" for t in CU_TESTS) + ".", "",
                  "| file | mutant | result |", "|---|---|---|"]
        lines += [f"| {f} | {w} | {r} |" for f, w, r in res]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="store_true")
    ap.add_argument("--cu", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mutation.md"))
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--sample", type=int, default=0, help="mutants per module (0 = all)")
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--report", action="store_true", help="only rebuild the report from the kept results")
    a = ap.parse_args()
    both = not (a.python or a.cu or a.report)
    command = "python scripts/mutation.py " + " ".join(sys.argv[1:])
    if a.python or both:
        py = python_part(a.max_children, a.sample, a.seed)
        RESULTS["python"].write_text(json.dumps({**py, "seed": a.seed, "command": command}, indent=1))
    if a.cu or both:
        t0 = time.time()
        cu = cu_part()
        RESULTS["cu"].write_text(json.dumps({"results": cu, "seconds": time.time() - t0, "command": command},
                                            indent=1))
    kept = {k: json.loads(f.read_text()) for k, f in RESULTS.items() if f.exists()}
    Path(a.out).write_text(report(kept.get("python"), kept.get("cu")))
    print(Path(a.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
