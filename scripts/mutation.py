"""Mutation check: do the tests notice a planted bug? Writes bench/results/mutation.md.

Two parts (`make mutation` runs both):

- Python: mutmut mutates every module with logic, package by package: each package of pyproject's
  [tool.kvservice.mutation.packages] (core, contract, manager, events, state, worker, client, server) gets its
  own mutmut run in .mutmut/<package>/ with its modules and its own test selection, so a mutant runs only the
  tests of its package's selection that cover its function (mutmut 3 takes one global selection, and its coverage
  pass runs all of it). The generated stubs and the CLI glue are left out ([tool.mutmut] do_not_mutate).
  Survivors are listed with their diff; a survivor that is equivalent (no test can tell it apart) is
  explained in bench/mutation_equivalent.txt, one ``name: why`` per line.
- CUDA sources: hand-made mutants of kvservice/worker/kernels/*.cu (a bounds check
  dropped, an off-by-one, 32-bit address arithmetic, a lost violation flag), each
  applied to a copy of the tree and run against the emulated-kernel tests
  (ASan included). A mutant survives if those tests still pass.

Every Python mutant runs with KV_DIFF_SCALE=0.05 (the differential test's short runs). The whole
set is many thousands of mutants: a day on a 2-core machine. --sample N runs a seeded random sample of N
mutants per module on average, spread over the modules in proportion to their number of mutants (at least one
each), and reports the sample's score and survivors per package and per module. --packages picks packages,
--skip-modules leaves modules out of the draw (e.g. those earlier samples covered).

Each part's results are kept in bench/results/mutation_python.json and mutation_cu.json (the
command that ran, seed, sample, every mutant's status, survivors' diffs), and the report is built
from both files, so a part can be rerun alone (--report alone rebuilds the report). Each seed's Python
sample is kept apart (a rerun of a seed replaces only that seed's), so the report shows every sample's
raw score against the tests of its day: a new seed, drawn after the tests written for the earlier
samples' survivors, is an out-of-sample estimate of the whole set's score. mutmut counts a mutant whose
forked test run hangs as killed (timeout); each timeout is run again in one plain pytest process
(--confirm-timeouts for samples kept before this check), and one whose tests pass counts as survived.

Usage: python scripts/mutation.py [--python] [--cu] [--report] [--sample N] [--seed S] [--minutes M] [--note TEXT]
                                  [--packages core,state,...] [--skip-modules kvservice.core.pool,...]
                                  [--confirm-timeouts]
                                  [--recheck] [--out bench/results/mutation.md] [--max-children N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutmut"                # one mutmut directory per package: .mutmut/<package>/mutants/
EQUIVALENT = ROOT / "bench" / "mutation_equivalent.txt"
KILLED = ROOT / "bench" / "mutation_killed.txt"
RESULTS = {"python": ROOT / "bench" / "results" / "mutation_python.json",
           "cu": ROOT / "bench" / "results" / "mutation_cu.json"}
# mutmut forks each mutant's test run from a process whose coverage pass already ran torch and the emulated kernels
# (both OpenMP): a forked child that reaches an OpenMP region can wait forever for threads it does not have, and
# mutmut's wall-clock limit then counts that mutant as a timeout, i.e. killed. One OpenMP/MKL thread keeps torch
# from starting a team (seen hung in einsum); the emulated kernels ask for their thread blocks' own thread count
# and still hang, so every timeout is run again in a plain pytest process (confirm_timeouts).
# A killed mutant's failing differential seed is shrunk for 1 s, not 30 (KV_DIFF_SHRINK_SECONDS): the verdict is
# the failure, not its repro.
MUTANT_ENV = {**os.environ, "KV_DIFF_SCALE": "0.05", "KV_DIFF_SHRINK_SECONDS": "1", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}
CU_TESTS = ["tests/kernels/test_decode.py", "tests/kernels/test_append_copy.py",
            "tests/kernels/test_validate_guard.py", "tests/kernels/test_sanitizers.py",
            "tests/kernels/test_large_offset.py", "tests/kernels/test_widen.py", "tests/kernels/test_generations.py"]

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
    ("append_kv.cu", "kv_copy_bytes(dv, v + i * row_bytes, row_bytes, tid, blockDim.x);",
     "kv_copy_bytes(dv, k + i * row_bytes, row_bytes, tid, blockDim.x);", "V rows written from K"),
    ("append_kv.cu", "  if (s < 0) return KV_OUT_OF_BOUNDS;\n", "",
     "a negative slot other than -1 reaches the page check (-5 / 16 is page 0)"),
    ("append_kv.cu", "if (s == KV_SKIP_SLOT) {", "if (false) {", "the skip slot -1 is written (page 0, offset -1)"),
    ("copy_blocks.cu", "if (rs == KV_OK && rd == KV_OK && gs == KV_OK && gd == KV_OK) {",
     "if (rd == KV_OK && gs == KV_OK && gd == KV_OK) {", "a pair with a bad source is copied"),
    ("paged.cuh", "return page_gen[kv_gen_index(L, p)] == expect ? KV_OK : KV_STALE_PAGE;", "return KV_OK;",
     "generations never compared: a re-allocated page is read through the old table"),
    ("paged.cuh", "return r == 0u || g - r - 1u < KV_GEN_AHEAD;", "return true;",
     "any generation may open a page: a stale write lands on the new owner's page"),
    ("append_kv.cu", "if (slot_gens != nullptr && tid == 0) page_gen[kv_gen_index(L, page)] = slot_gens[i];", "",
     "append never records the generation it wrote"),
    ("append_kv.cu", "const bool opens = i >= off && slot_mapping[i - off] == s - off && slot_gens[i - off] == g;",
     "const bool opens = true;", "a continued page is written under another generation (a skipped copy-on-write)"),
    ("copy_blocks.cu", "if (held != want && !kv_gen_newer(want, held)) gd = KV_STALE_PAGE;", "",
     "a copy overwrites a destination holding a newer generation"),
    ("copy_blocks.cu", "page_bytes, tid, blockDim.x);", "page_bytes / 2, tid, blockDim.x);", "half a page copied"),
    ("decode_attention.cu", "? seq_len - A.window : 0;", "? seq_len - A.window + 1 : 0;",
     "sliding window one token short"),
    ("decode_attention.cu", "const float f = kv_ex2(m[g] - nm);", "const float f = 1.f;",
     "online softmax never rescales earlier tiles"),
    ("decode_attention.cu", "o = acc_o / sum;", "o = acc_o;", "lane-group merge not normalised"),
    ("decode_attention.cu", "bad = bad || part_flag[s * batch + row] != 0;", "bad = part_flag[s * batch + row] != 0;",
     "split merge keeps only the last split's violation flag"),
    ("decode_attention.cu", "(m == kv_ninf() ? kv_ninf() : m + logf(wsum));", "(m == kv_ninf() ? kv_ninf() : m);",
     "split merge's lse forgets the sum"),
    ("validate_page_table.cu", "if (row < batch && rreason != KV_BAD_INDPTR) {",
     "if (row < batch && rreason == KV_OK) {", "entries of a row with a bad last_page_len not checked"),
    ("guard.cu", "      ++bad;\n", "", "guard check never counts a changed byte"),
    ("widen.cu", "i < n; i += stride) out[i] = KvElem<T>::one(in + i);",
     "i < n - 1; i += stride) out[i] = KvElem<T>::one(in + i);", "widen drops the last tail element"),
]


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _status(code: int | None) -> str:
    """mutmut's reading of a mutant's exit code (mutmut.stats.status_by_exit_code)."""
    from mutmut.stats import status_by_exit_code
    return status_by_exit_code[code]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]


def packages() -> dict[str, dict]:
    """Package -> its [tool.kvservice.mutation.packages] table (only_mutate globs, test selection)."""
    return _config()["kvservice"]["mutation"]["packages"]


def _mutated(pkg: str, path: str) -> bool:
    """Whether mutmut's run for `pkg` mutates the source file `path` (relative, e.g. kvservice/core/pool.py)."""
    skip = _config()["mutmut"].get("do_not_mutate", [])
    return any(fnmatch(path, g) for g in packages()[pkg]["only_mutate"]) and not any(fnmatch(path, g) for g in skip)


def _package_of(name: str) -> str | None:
    """The package whose run holds mutant (or module) `name`: kvservice.state.nats.journal.x_f__mutmut_3 -> state."""
    path = _module(name).replace(".", "/") + ".py"
    return next((pkg for pkg in packages() if _mutated(pkg, path)), None)


def _prepare(pkg: str) -> Path:
    """.mutmut/<pkg>/: links to the tree's kvservice/, tests/ and docs/ (tests that check a documented figure read
    it; [tool.mutmut]'s also_copy copies it beside the mutants), and a pyproject.toml whose [tool.mutmut] is the
    shared one with this package's only_mutate and test selection (mutmut reads its configuration from the
    working directory and keeps its mutants/ there)."""
    d = WORK / pkg
    d.mkdir(parents=True, exist_ok=True)
    for part in ("kvservice", "tests", "docs"):
        if not (d / part).is_symlink():
            (d / part).symlink_to(ROOT / part)
    text = (ROOT / "pyproject.toml").read_text()
    text = text[:text.index("[tool.mutmut]")]     # [tool.mutmut] and the package tables come last
    conf = {**_config()["mutmut"], **packages()[pkg]}
    text += "[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v, ensure_ascii=False)}\n" for k, v in conf.items())
    if not (d / "pyproject.toml").exists() or (d / "pyproject.toml").read_text() != text:
        (d / "pyproject.toml").write_text(text)
    return d


def _metas(pkg: str) -> list[str]:
    """The .meta files (one per mutated source file) of `pkg`'s mutmut run, of files it mutates today."""
    base = WORK / pkg / "mutants"
    return [f for f in sorted(glob.glob(str(base / "**" / "*.meta"), recursive=True))
            if _mutated(pkg, str(Path(f).relative_to(base))[:-len(".meta")])]


def _statuses(names: set[str] | None, pkgs: list[str] | None = None) -> dict[str, str]:
    """Mutant name -> status, from mutmut's .meta files of the packages' runs (all mutants, or only `names`)."""
    out = {}
    for pkg in pkgs or list(packages()):
        for f in _metas(pkg):
            for k, code in json.loads(Path(f).read_text()).get("exit_code_by_key", {}).items():
                if names is None or k in names:
                    out[k] = _status(code)
    return out


def _allocate(counts: dict[str, int], sample: int) -> dict[str, int]:
    """Per-module sample sizes: `sample` per module on average, in proportion to each module's number of mutants
    (largest remainders), at least one each and at most all of a module's."""
    total = sample * len(counts)
    n = sum(counts.values())
    share = {m: total * c / n for m, c in counts.items()}
    out = {m: max(1, int(s)) for m, s in share.items()}
    for m in sorted(share, key=lambda m: out[m] - share[m])[:max(0, total - sum(out.values()))]:
        out[m] += 1
    return {m: min(k, counts[m]) for m, k in out.items()}


def _names_in(path: Path) -> list[str]:
    """Mutant names of a `name: ...` list (bench/mutation_killed.txt, bench/mutation_equivalent.txt)."""
    if not path.exists():
        return []
    return [ln.split(":", 1)[0].strip() for ln in path.read_text().splitlines() if ":" in ln and not ln.startswith("#")]


def python_part(max_children: int, sample: int = 0, seed: int = 10, minutes: float = 0,
                recheck: bool = False, pkgs: list[str] | None = None, skip: list[str] | None = None) -> dict:
    """Run mutmut package by package (all mutants, or a seeded sample weighted by each module's number of
    mutants, plus with `recheck` the survivors of earlier samples listed in bench/mutation_killed.txt and
    bench/mutation_equivalent.txt); statuses and survivors' diffs.

    minutes: stop the mutant runs after this long in all (0 = no limit), shared among the packages in proportion
    to their mutants to run (time one leaves unused passes to the next); mutants not reached stay "not checked".
    skip: modules (dotted names) left out of the draw.
    """
    mutmut = [sys.executable, "-m", "mutmut"]
    env = MUTANT_ENV
    pkgs = pkgs or list(packages())
    skip = set(skip or [])
    t0 = time.time()
    names: list[str] | None = None
    rechecked: list[str] = []
    totals: dict[str, int] = {}
    gen_seconds: dict[str, float] = {}
    for pkg in pkgs:
        # Generates the package's mutants and the per-test coverage (stats) without running any mutant.
        tp = time.time()
        r = _run([*mutmut, "run", "--max-children", str(max_children), "no-such-mutant"], _prepare(pkg), 3600, env)
        gen_seconds[pkg] = time.time() - tp
        if not _metas(pkg):
            raise SystemExit(f"mutmut made no mutants for package {pkg}:\n{(r.stdout + r.stderr)[-3000:]}")
        print(f"{pkg}: mutants generated and coverage collected in {gen_seconds[pkg] / 60:.1f} min", flush=True)
    keys_by_module: dict[str, list[str]] = {}
    for pkg in pkgs:
        for f in _metas(pkg):
            keys = sorted(json.loads(Path(f).read_text()).get("exit_code_by_key", {}))
            if keys and _module(keys[0]) not in skip:
                keys_by_module[_module(keys[0])] = keys
    if sample or recheck:
        names = []
        if sample:
            rng = random.Random(seed)
            totals = {m: len(k) for m, k in keys_by_module.items()}
            for m, k in sorted(_allocate(totals, sample).items()):
                names += rng.sample(keys_by_module[m], k)
        if recheck:
            known = set(_statuses(None, pkgs))
            rechecked = sorted({n for f in (KILLED, EQUIVALENT) for n in _names_in(f)} & known)
    todo = {pkg: sorted(n for n in set(names or []) | set(rechecked) if _package_of(n) == pkg) for pkg in pkgs}
    t_run = time.time()
    stopped = False
    tail = ""
    for i, pkg in enumerate(pkgs):
        if names is not None and not todo[pkg]:
            continue
        left = sum(len(todo[p]) for p in pkgs[i:]) or 1
        share = (minutes * 60 - (time.time() - t_run)) * len(todo[pkg]) / left if minutes else 6 * 3600
        if share <= 0:
            stopped = True
            continue
        print(f"{pkg}: running {len(todo[pkg]) if names is not None else 'all'} mutants, "
              f"{share / 60:.1f} min at most", flush=True)
        # Its own process group: mutmut's forked mutant runs outlive a SIGINT to mutmut (seen: orphans holding the
        # output pipe for minutes), so the whole group is ended once mutmut has saved its results.
        proc = subprocess.Popen([*mutmut, "run", "--max-children", str(max_children), *todo[pkg]], cwd=WORK / pkg,
                                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=share)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)             # mutmut stops its workers and keeps the results so far
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # the mutant runs it left behind (not checked)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
        tail += f"[{pkg}] " + (out or "")[-600:] + "\n"
    run_seconds = time.time() - t_run
    status = _statuses(set(names or []) | set(rechecked) if names is not None else None, pkgs)
    check = confirm_timeouts(sorted(k for k, s in status.items() if s == "timeout"))
    survivors = sorted(k for k, s in {**status, **check}.items() if s in ("survived", "no tests"))
    diffs = {name: _run([*mutmut, "show", name], WORK / _package_of(name), 120).stdout for name in survivors}
    sample_names = sorted(names) if names else sorted(status)
    return {"seconds": time.time() - t0, "run_seconds": run_seconds, "minutes_limit": minutes, "stopped": stopped,
            "sample": sample, "seed": seed, "sample_names": sample_names, "recheck_names": rechecked,
            "survivors": diffs, "status": status, "run_tail": tail[-4000:], "module_totals": totals,
            "timeout_check": check, "allocation": "by mutant count", "packages": pkgs, "skipped": sorted(skip),
            "generate_seconds": gen_seconds}


def confirm_timeouts(names: list[str]) -> dict[str, str]:
    """mutmut's timeouts run again without its fork: the mutant's covering tests (mutmut's stats) in one plain
    pytest process in its package's mutants/, under a 10-minute wall limit. A forked child can hang for a reason
    that is not the mutant (a thread pool of the parent), and mutmut counts any hang as killed. name -> "killed" (a
    test fails), "survived" (they pass) or "timeout" (still hangs, or pytest could not run them)."""
    out = {}
    for name in names:
        mutants = WORK / _package_of(name) / "mutants"
        by_function = json.loads((mutants / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
        tests = sorted(by_function.get(name.partition("__mutmut_")[0], []))
        try:
            r = _run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], mutants,
                     600, {**MUTANT_ENV, "MUTANT_UNDER_TEST": name})
            out[name] = {0: "survived", 1: "killed"}.get(r.returncode, "timeout") if tests else "timeout"
        except subprocess.TimeoutExpired:
            out[name] = "timeout"
        print(f"timeout run again: {name}: {out[name]}", flush=True)
    return out


def _status_of(py: dict) -> dict[str, str]:
    """A sample's statuses, with its timeouts replaced by their run without mutmut's fork where it was made."""
    return {**py["status"], **py.get("timeout_check", {})}


def _module(name: str) -> str:
    return name.split(".x")[0]  # kvservice.core.pool.x_step__mutmut_3 -> kvservice.core.pool


def _changed_lines(diff: str) -> list[str]:
    return [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def recheck_killed(max_children: int, minutes: float = 0, diffs: dict[str, str] | None = None) -> dict:
    """Run, through mutmut, the earlier survivors that bench/mutation_killed.txt says a new test kills.

    diffs: the survivors' diffs as first recorded; a name whose mutant now differs (its function was
    edited since, and mutmut numbers that function's mutants anew) is not run but listed as gone.
    """
    mutmut = [sys.executable, "-m", "mutmut"]
    env = MUTANT_ENV
    t0 = time.time()
    listed = _names_in(KILLED)
    pkgs = sorted({p for p in map(_package_of, listed) if p})
    for pkg in pkgs:
        _run([*mutmut, "run", "--max-children", str(max_children), "no-such-mutant"], _prepare(pkg), 3600, env)
    names = sorted(set(listed) & set(_statuses(None, pkgs)))
    diffs = diffs or {}
    names = [n for n in names if n not in diffs or _changed_lines(diffs[n]) == _changed_lines(
        _run([*mutmut, "show", n], WORK / _package_of(n), 120).stdout)]
    for pkg in pkgs:
        left = minutes * 60 - (time.time() - t0) if minutes else 6 * 3600
        mine = [n for n in names if _package_of(n) == pkg]
        if not mine or left <= 0:
            continue
        try:
            _run([*mutmut, "run", "--max-children", str(max_children), *mine], WORK / pkg, left, env)
        except subprocess.TimeoutExpired:
            pass
    status = _statuses(set(names), pkgs)
    status |= confirm_timeouts(sorted(n for n, st in status.items() if st == "timeout"))
    return {"seconds": time.time() - t0, "status": status,
            "gone": sorted(set(listed) - set(names))}          # functions edited since: the name no longer exists


def _cu_run(fname: str | None, find: str = "", repl: str = "") -> tuple[int, str]:
    """The kernel tests on a copy of the tree with one .cu edit (none: the control); (exit code, first failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        for part in ("kvservice", "tests", "pyproject.toml"):
            p = ROOT / part
            (shutil.copytree if p.is_dir() else shutil.copy)(p, tree / part, **({"ignore": shutil.ignore_patterns(
                "__pycache__")} if p.is_dir() else {}))
        if fname is not None:
            f = tree / "kvservice" / "worker" / "kernels" / fname
            f.write_text(f.read_text().replace(find, repl))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        r = _run([sys.executable, "-m", "pytest", "-x", "-v", "-p", "no:cacheprovider", *CU_TESTS], tree, 1800, env)
        failed = [ln.split(" - ")[0].split(" ", 1)[1] for ln in r.stdout.splitlines()
                  if ln.startswith(("FAILED ", "ERROR "))]
        if failed or r.returncode == 0:
            return r.returncode, failed[0] if failed else ""
        # A crash (e.g. SIGSEGV) leaves no report: -v printed the running test's id before it started.
        started = [ln.split(" ")[0] for ln in r.stdout.splitlines() if ln.startswith("tests/") and "::" in ln]
        where = started[-1] if started else "an unnamed test"
        sig = f"signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
        return r.returncode, f"a crash of the test process in {where} ({sig}, no test report)"


def cu_part(match: list[str] | None = None) -> list[tuple[str, str, str]]:
    """Apply each hand-made .cu mutant to a copy of the tree; (file, what, verdict with the killing test).

    A control run of the unmutated copy comes first: if it fails, no verdict would mean anything.
    match: run only the mutants whose description contains one of these (the control still runs).
    """
    code, why = _cu_run(None)
    if code != 0:
        raise SystemExit(f"control run (no mutant) fails: {why}; fix the tree before the .cu mutants")
    out: list[tuple[str, str, str]] = [("(none)", "control: the unmutated copy", "passes")]
    for fname, find, repl, what in CU_MUTANTS:
        if match and not any(m in what for m in match):
            continue
        src = (ROOT / "kvservice" / "worker" / "kernels" / fname).read_text()
        if src.count(find) != 1:
            out.append((fname, what, "not applied (source changed)"))
            continue
        code, why = _cu_run(fname, find, repl)
        out.append((fname, what, f"killed by {why}" if code != 0 else "survived"))
        print(f"{fname}: {what}: {out[-1][2]}", flush=True)
    return out


def _pairs(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split(":", 1) for line in path.read_text().splitlines() if ":" in line
             and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def equivalents() -> dict[str, str]:
    return _pairs(EQUIVALENT)


KILLED_STATUSES = ("killed", "timeout", "segfault")


def _tally(status: dict[str, str], names: list[str]) -> dict[str, int]:
    t = {"killed": 0, "survived": 0, "no tests": 0, "not checked": 0}
    for n in names:
        st = status.get(n, "not checked")
        key = "killed" if st in KILLED_STATUSES else st if st in ("survived", "no tests") else "not checked"
        t[key] += 1
    return t


def _figures(py: dict) -> dict:
    """One sample's raw figures: tally, checked, survivors, equivalent and killed-since counts."""
    if py.get("summary_only"):
        return py["figures"]
    status, eq, later = _status_of(py), equivalents(), _pairs(KILLED)
    sample = py["sample_names"]
    t = _tally(status, sample)
    surv = sorted(n for n in sample if status.get(n) in ("survived", "no tests"))
    return {**t, "mutants": len(sample), "checked": t["killed"] + t["survived"] + t["no tests"],
            "equivalent": sum(n in eq for n in surv), "killed since": sum(n in later for n in surv)}


def _weighted(py: dict) -> tuple[float, float] | None:
    """The whole set's score estimated from a per-module sample: each module's sample score weighted by its
    number of mutants (raw, and over the non-equivalent ones); None without the module totals."""
    totals = py.get("module_totals")
    if not totals or py.get("summary_only"):
        return None
    status, eq = _status_of(py), equivalents()
    num = [0.0, 0.0]
    den = 0
    for m, total in totals.items():
        ns = [n for n in py["sample_names"] if _module(n) == m]
        t = _tally(status, ns)
        checked = t["killed"] + t["survived"] + t["no tests"]
        e = sum(n in eq and status.get(n) in ("survived", "no tests") for n in ns)
        if checked:
            num[0] += total * t["killed"] / checked
            num[1] += total * t["killed"] / max(checked - e, 1)
            den += total
    return (num[0] / den, num[1] / den) if den else None


def _overview(samples: list[dict]) -> list[str]:
    lines = ["Each sample is a fresh seeded random draw over the mutants as mutmut numbered them at its run; its "
             "score is the raw one, from the tests that existed when it ran (before any test written for its own "
             "survivors). Score = killed / checked (checked = killed + survived + no tests); without equivalents = "
             "killed / (checked - equivalent survivors); after = (killed + killed since by a new test) / "
             "(checked - equivalent).", "",
             "| seed | tests it ran against | mutants | killed | survived | no tests | not checked | score | "
             "equivalent survivors | score without equivalents | killed since | after |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for py in samples:
        f = _figures(py)
        c, e = f["checked"], f["equivalent"]
        lines.append(f"| {py['seed']} | {py.get('note', '')} | {f['mutants']} | {f['killed']} | {f['survived']} | "
                     f"{f['no tests']} | {f['not checked']} | {f['killed'] / max(c, 1):.1%} | {e} | "
                     f"{f['killed'] / max(c - e, 1):.1%} | {f['killed since']} | "
                     f"{(f['killed'] + f['killed since']) / max(c - e, 1):.1%} |")
    return lines


def _out_of_sample(samples: list[dict]) -> list[str]:
    """The newest sample, drawn after the tests written for every earlier sample's survivors, scores those tests
    on mutants they were not written for: the estimate of the whole set's score."""
    # The newest sample over modules an earlier sample drew from: the first sample of a package is its baseline,
    # not an estimate of what the tests written for earlier survivors achieve.
    drawn = [{_module(n) for n in py.get("sample_names", [])} for py in samples]
    later = [i for i in range(1, len(samples)) if not samples[i].get("summary_only")
             and any(drawn[i] & d for d in drawn[:i])]
    if not later:
        return []
    py = samples[later[-1]]
    f, w = _figures(py), _weighted(py)
    c, e = f["checked"], f["equivalent"]
    return [f"**Out-of-sample estimate** (seed {py['seed']}, a fresh sample drawn after all the tests written for "
            f"the earlier samples' survivors, before any test written for its own): {f['killed'] / max(c - e, 1):.1%} "
            f"of its non-equivalent mutants killed ({f['killed']} of {c - e}; {f['killed'] / max(c, 1):.1%} of all "
            f"{c} checked, {e} survivors being equivalent)"
            + (f"; weighted by each module's number of mutants: {w[1]:.1%} ({w[0]:.1%} of all)" if w else "")
            + _fresh_text(py) + ".", ""]


def _fresh_text(py: dict) -> str:
    """The score over the mutants no earlier sample drew (none of them can have a test written for it)."""
    earlier = set(py.get("earlier_sample_names", []))
    fresh = [n for n in py["sample_names"] if n not in earlier]
    if not earlier or len(fresh) == len(py["sample_names"]):
        return ""
    status, eq = _status_of(py), equivalents()
    t = _tally(status, fresh)
    c = t["killed"] + t["survived"] + t["no tests"]
    e = sum(n in eq and status.get(n) in ("survived", "no tests") for n in fresh)
    return (f"; over the {len(fresh)} mutants no earlier sample drew: {t['killed'] / max(c - e, 1):.1%} "
            f"({t['killed']} of {c - e})")


def _summary_report(py: dict) -> list[str]:
    f = py["figures"]
    return [f"### Sample seed {py['seed']}", "", f"`{py['command']}`: {py['what']}", "",
            f"Killed {f['killed']}, survived {f['survived']}, no tests {f['no tests']}, not checked "
            f"{f['not checked']}; {f['equivalent']} survivors equivalent, {f['killed since']} killed since by a "
            "new test (both in the seed-11 section's rerun below). " + py.get("source", "")]


def _python_report(py: dict) -> list[str]:
    if py.get("summary_only"):
        return _summary_report(py)
    status, eq, later = _status_of(py), equivalents(), _pairs(KILLED)
    sample = py["sample_names"]
    f = _figures(py)
    t, checked, n_eq, n_later = f, f["checked"], f["equivalent"], f["killed since"]
    surv = sorted(n for n in sample if status.get(n) in ("survived", "no tests"))
    if py.get("allocation") == "by mutant count":
        what = (f"a seeded sample (seed {py['seed']}) of {len(sample)} mutants over the packages "
                f"{', '.join(py['packages'])}: {py['sample']} per module on average, spread over the "
                f"{len(py['module_totals'])} modules in proportion to their number of mutants (at least one each)"
                + (f"; modules left out of the draw: {', '.join(py['skipped'])}" if py.get("skipped") else "")
                if py["sample"] else f"all {len(sample)} mutants of the packages {', '.join(py['packages'])}")
    else:
        what = (f"a seeded sample (seed {py['seed']}) of {len(sample)} mutants, {py['sample']} per module and "
                f"{2 * py['sample']} of pool.py" if py["sample"] else f"all {len(sample)} mutants")
    limit = "" if not py.get("minutes_limit") else f", stopped at its {py['minutes_limit']:.0f}-minute limit" \
        if py.get("stopped") else f", within its {py['minutes_limit']:.0f}-minute limit"
    lines = [f"### Sample seed {py['seed']}", "",
             (f"Run ended {py['date']}, {py['seconds'] / 60:.0f} min after it started. "
              if py.get("allocation") and py.get("date") else "")
             + f"`{py['command']}`: {what}. Mutant runs took {py['run_seconds'] / 60:.0f} min{limit} "
             f"({py['seconds'] / 60:.0f} min with mutant generation and coverage). Each mutant ran the tests of "
             + ("its package's selection ([tool.kvservice.mutation.packages] in pyproject.toml, one mutmut run per "
              "package)" if py.get("allocation") else "pyproject's `pytest_add_cli_args_test_selection`")
             + " that cover its function, with KV_DIFF_SCALE=0.05." + _generate_text(py),
             "",
             f"Sample: killed {t['killed']}, survived {t['survived']}, no tests {t['no tests']}, not checked "
             f"{t['not checked']}. Score over the checked mutants (killed / killed + survived + no tests): "
             f"{t['killed'] / max(checked, 1):.1%}; with the {n_eq} equivalent survivors left out of the "
             f"denominator: {t['killed'] / max(checked - n_eq, 1):.1%}. Timeouts count as killed (the mutant "
             "hung a test)" + _timeout_text(py) + "." + _weighted_text(py), "",
             *([py["remark"], ""] if py.get("remark") else []), *_package_table(py),
             "| module | killed | survived | of them equivalent | no tests | not checked |",
             "|---|---:|---:|---:|---:|---:|"]
    mods: dict[str, list[str]] = {}
    for n in sample:
        mods.setdefault(_module(n), []).append(n)
    for m, ns in sorted(mods.items()):
        mt = _tally(status, ns)
        me = sum(n in eq and status.get(n) in ("survived", "no tests") for n in ns)
        lines.append(f"| {m} | {mt['killed']} | {mt['survived']} | {me} | {mt['no tests']} | {mt['not checked']} |")
    lines += ["", f"Survivors of the sample: {len(surv)}; equivalent (reason below, from "
              f"bench/mutation_equivalent.txt) {n_eq}; killed since by a test written for it (bench/"
              f"mutation_killed.txt; checked with the mutant active) {n_later}; neither "
              f"{len(surv) - n_eq - n_later}. With the tests written since, the sample's score over its "
              f"non-equivalent mutants is (killed + killed since) / (checked - equivalent) = "
              f"{t['killed'] + n_later}/{checked - n_eq} = {(t['killed'] + n_later) / max(checked - n_eq, 1):.1%}.", ""]
    for n in surv:
        if n in eq:
            lines.append(f"- `{n}`: equivalent: {eq[n]}")
        elif n in later:
            lines.append(f"- `{n}`: killed since by `{later[n]}`")
    open_ = [n for n in surv if n not in eq and n not in later]
    for n in open_:
        lines += ["", f"- `{n}`: not yet killed or explained", "", "```diff", py["survivors"][n].strip()[:1500], "```"]
    rc = py.get("recheck_names") or []
    if rc:
        rt = _tally(status, rc)
        lines += ["", "#### Survivors of earlier samples, run again", "",
                  f"{len(rc)} mutants (those named in bench/mutation_killed.txt and bench/mutation_equivalent.txt): "
                  f"killed {rt['killed']}, survived {rt['survived']}, no tests {rt['no tests']}, not checked "
                  f"{rt['not checked']}.", ""]
        for n in rc:
            st = status.get(n, "not checked")
            note = f"equivalent: {eq[n]}" if n in eq else f"test: `{later[n]}`" if n in later else ""
            lines.append(f"- `{n}`: {st}; {note}")
    rk = py.get("recheck_killed")
    if rk:
        rt = _tally(rk["status"], sorted(rk["status"]))
        lines += ["", "#### The survivors a new test kills, run again through mutmut", "",
                  f"`{rk['command']}` ({rk['seconds'] / 60:.0f} min): {len(rk['status'])} mutants of "
                  f"bench/mutation_killed.txt: killed {rt['killed']}, survived {rt['survived']}, no tests "
                  f"{rt['no tests']}, not checked {rt['not checked']}."]
        lines += [f"- `{n}`: {st}" for n, st in sorted(rk["status"].items()) if st not in KILLED_STATUSES]
        if rk["gone"]:
            lines += ["", "Not run (their function was edited since, so mutmut numbers its mutants anew): "
                      + ", ".join(f"`{n}`" for n in rk["gone"]) + "; each was checked by hand as noted in "
                      "bench/mutation_killed.txt."]
    return lines


def _package(name: str) -> str:
    return ".".join(_module(name).split(".")[:2])   # kvservice.state.nats.journal.x_f__mutmut_1 -> kvservice.state


def _package_table(py: dict) -> list[str]:
    """Per package: the sample's raw score and, weighted by each module's number of mutants, the estimate of the
    package's whole score (raw and over the non-equivalent mutants)."""
    if not py.get("allocation"):
        return []
    status, eq = _status_of(py), equivalents()
    lines = ["| package | mutants in all | sampled | killed | survived | of them equivalent | no tests | not checked "
             "| score | without equivalents |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pkg in sorted({_package(n) for n in py["sample_names"]}):
        ns = [n for n in py["sample_names"] if _package(n) == pkg]
        t = _tally(status, ns)
        c = t["killed"] + t["survived"] + t["no tests"]
        e = sum(n in eq and status.get(n) in ("survived", "no tests") for n in ns)
        total = sum(v for m, v in py["module_totals"].items() if _package(m) == pkg)
        lines.append(f"| {pkg} | {total} | {len(ns)} | {t['killed']} | {t['survived']} | {e} | {t['no tests']} | "
                     f"{t['not checked']} | {t['killed'] / max(c, 1):.1%} | {t['killed'] / max(c - e, 1):.1%} |")
    return [*lines, ""]


def _generate_text(py: dict) -> str:
    gen = py.get("generate_seconds")
    if not gen:
        return ""
    return (" Generating each package's mutants and its coverage pass took " + ", ".join(
        f"{p} {s / 60:.1f} min" for p, s in gen.items()) + ".")


def _timeout_text(py: dict) -> str:
    check = py.get("timeout_check")
    if check is None:
        return ""
    n = {k: sum(v == k for v in check.values()) for k in ("killed", "survived", "timeout")}
    how = f" by `{py['timeout_check_command']}`" if py.get("timeout_check_command") else ""
    return (f" once run again without mutmut's fork{how}: of mutmut's {len(check)} timeouts, {n['killed']} "
            f"fail a test (killed), {n['survived']} pass every covering test (counted survived here) and "
            f"{n['timeout']} still hang" + py.get("timeout_check_note", ""))


def _weighted_text(py: dict) -> str:
    w = _weighted(py)
    if w is None:
        return ""
    prior = sorted(set(py["sample_names"]) & set(py.get("earlier_sample_names", [])))
    return (f" Weighted by each module's number of mutants ({sum(py['module_totals'].values())} in all), the "
            f"estimate of the whole set's score is {w[0]:.1%}, and {w[1]:.1%} without the equivalent survivors."
            + (f" {len(prior)} of the sampled mutants were also in an earlier sample." if prior else ""))


def _load_python() -> list[dict]:
    """The kept Python samples, oldest seed first (an older file held one sample at its top level)."""
    if not RESULTS["python"].exists():
        return []
    kept = json.loads(RESULTS["python"].read_text())
    return kept["samples"] if "samples" in kept else [kept]


def _save_python(samples: list[dict]) -> None:
    RESULTS["python"].write_text(json.dumps({"samples": sorted(samples, key=lambda r: r["seed"])}, indent=1))


def report(samples: list[dict], cu: dict | None) -> str:
    lines = ["# Mutation check", "",
             f"Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC by `python scripts/mutation.py --report` from "
             "the kept results of the runs named below (bench/results/mutation_python.json, mutation_cu.json); "
             "`make mutation` runs both parts. Machine: the shared 2-core VM, runs under `nice`.", ""]
    if samples:
        lines += ["## Python (mutmut)", "", *_out_of_sample(samples), *_overview(samples), ""]
        for py in samples:
            lines += _python_report(py)
            lines.append("")
    if cu is not None:
        res = cu["results"]
        mutants = [r for r in res if r[0] != "(none)"]
        n_killed = sum(r.startswith("killed") for _, _, r in mutants)
        lines += ["", "## CUDA sources (hand-made mutants, emulated kernels under the kernel tests)", "",
                  f"`{cu['command']}`: {len(mutants)} mutants, {n_killed} killed, {len(mutants) - n_killed} not "
                  f"killed ({cu['seconds'] / 60:.0f} min). Each applies one edit to a copy of the tree, where the "
                  "tests rebuild the g++-emulated kernels (plain and ASan variants) and run "
                  + ", ".join(f"`{t}`" for t in CU_TESTS) + " with `-x`; the first failing test is named. A "
                  "control run of the unmutated copy passes first (else no verdict is given).", "",
                  "| file | mutant | result |", "|---|---|---|"]
        lines += [f"| {f} | {w} | {r} |" for f, w, r in res]
        lines += [f"\nRerun of some rows (their test process crashed, and the first runs' parser named no test): "
                  f"`{r['command']}` ({r['seconds'] / 60:.0f} min)."
                  for r in cu.get("reruns", [])]
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
    ap.add_argument("--cu-match", action="append", default=[],
                    help="run only the .cu mutants whose description contains this (repeatable)")
    ap.add_argument("--recheck-killed", action="store_true",
                    help="run the mutants of bench/mutation_killed.txt again; kept beside the Python results")
    ap.add_argument("--minutes", type=float, default=0, help="stop the Python mutant runs after this long")
    ap.add_argument("--confirm-timeouts", action="store_true",
                    help="run the kept samples' mutmut timeouts again without its fork (those not run so yet)")
    ap.add_argument("--packages", default="",
                    help="comma-separated packages of [tool.kvservice.mutation.packages] to run (default: all)")
    ap.add_argument("--skip-modules", default="",
                    help="comma-separated modules (kvservice.core.pool,...) left out of the sample's draw")
    ap.add_argument("--remark", default="",
                    help="with --report: a paragraph kept with the sample of --seed and printed in its section")
    ap.add_argument("--note", default="", help="what tests the sample ran against (a column of the report)")
    ap.add_argument("--recheck", action="store_true",
                    help="also run the earlier survivors of bench/mutation_killed.txt and mutation_equivalent.txt")
    a = ap.parse_args()
    both = not (a.python or a.cu or a.report or a.recheck_killed or a.confirm_timeouts)
    command = "python scripts/mutation.py " + " ".join(sys.argv[1:])
    if a.python or both:
        samples = [r for r in _load_python() if r["seed"] != a.seed]      # a rerun of a seed replaces it
        pkgs = [p.strip() for p in a.packages.split(",") if p.strip()] or None
        unknown = sorted(set(pkgs or []) - set(packages()))
        if unknown:
            raise SystemExit(f"unknown package(s) {unknown}; [tool.kvservice.mutation.packages] has {list(packages())}")
        py = python_part(a.max_children, a.sample, a.seed, a.minutes, a.recheck, pkgs,
                         [m.strip() for m in a.skip_modules.split(",") if m.strip()])
        earlier = sorted({n for r in samples for n in r.get("sample_names", [])})
        _save_python([*samples, {**py, "seed": a.seed, "command": command, "note": a.note,
                                 "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
                                 "earlier_sample_names": earlier}])
    if a.cu or both:
        t0 = time.time()
        cu = cu_part(a.cu_match)
        kept_cu = {"results": cu, "seconds": time.time() - t0, "command": command}
        if a.cu_match and RESULTS["cu"].exists():           # a rerun of some mutants: update their rows only
            old = json.loads(RESULTS["cu"].read_text())
            new_rows = {(f, w): r for f, w, r in cu}
            rows = [[f, w, new_rows.get((f, w), r)] for f, w, r in old["results"]]
            reruns = [*old.get("reruns", []), {"command": command, "seconds": kept_cu["seconds"]}]
            kept_cu = {**old, "results": rows, "reruns": reruns}
        RESULTS["cu"].write_text(json.dumps(kept_cu, indent=1))
    if a.confirm_timeouts:                                  # the kept samples' timeouts, with today's tests
        samples = _load_python()
        for py in samples:
            if not py.get("summary_only") and "timeout_check" not in py:
                py["timeout_check"] = confirm_timeouts(sorted(n for n, st in py["status"].items() if st == "timeout"))
                py["timeout_check_command"] = command
                for name, st in py["timeout_check"].items():
                    if st == "survived":
                        py["survivors"][name] = _run([sys.executable, "-m", "mutmut", "show", name],
                                                     WORK / _package_of(name), 120).stdout
        _save_python(samples)
    if a.recheck_killed:                                    # kept with the newest sample
        samples = _load_python()
        diffs = {n: d for r in samples for n, d in r.get("survivors", {}).items()}
        samples[-1]["recheck_killed"] = {**recheck_killed(a.max_children, a.minutes, diffs), "command": command}
        _save_python(samples)
    if a.remark and a.report:
        samples = _load_python()
        for py in samples:
            if py["seed"] == a.seed:
                py["remark"] = a.remark
        _save_python(samples)
    cu_kept = json.loads(RESULTS["cu"].read_text()) if RESULTS["cu"].exists() else None
    Path(a.out).write_text(report(_load_python(), cu_kept))
    print(Path(a.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
