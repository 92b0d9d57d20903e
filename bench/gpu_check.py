"""GPU check of the paged KV kernels, built so one short device window is enough.

    python3 bench/gpu_check.py --out DIR            # on the GPU machine (cupy, torch, numpy)
    python3 bench/gpu_check.py --out DIR --backend emulated [--quick]   # anywhere: CPU emulation

On the lent H200 (docs/KERNELS.md, "First call on a GPU"): ``bash bench/gpu_device_run.sh``, which
runs ``python3 bench/gpu_check.py --out "$OUT" --budget-s 300`` with the image's own python3.

Writes ``DIR/gpu-<date>-<gpu>.jsonl`` (one JSON object per result, appended
and flushed as each finishes) and ``DIR/gpu-<date>-<gpu>.md`` (the report,
re-rendered after every group), plus ``.log`` with each child's output.

1. preflight: two child processes at once compile the checked and the
   ``-DKV_NO_BOUNDS_CHECK`` modules, resolve every kernel and print the
   CuPy / NVRTC / driver versions and each kernel's registers, shared and
   local (spill) bytes and resident blocks per SM. Exit 2 if that fails. Its
   limit is PREFLIGHT_SHARE of ``--budget-s``.
2. every group runs in its own child process, started in a process group of
   its own and killed as a group at its time limit (a sticky CUDA error such as
   an illegal address poisons that group only), each check synchronised and
   written as it finishes, with a time budget for the whole run, preflight
   included (default 450 s on a GPU, 1500 s on the emulation):
   ``sanitizer`` (compute-sanitizer memcheck, racecheck and synccheck on a small
   decode, each in its own process; a note when the tool is absent),
   ``decode-<dtype>`` (bench/decode_cases.py: head_dim x GQA group with
   windows, splits, page sizes, policies, bad pages, empty rows; vs the torch
   float64 reference; one group per cache dtype), ``timing`` (N back-to-back launches between one pair of
   events, checked and unchecked builds interleaved over rounds: median and
   spread, against a device-to-device copy and a read-only pass; the SM clock,
   memory clock and power sampled during each shape; then each timing shape's
   output checked against a float64 reference of its full rows), ``append-copy-guard``
   (also widen: every 16-bit pattern through the attention loads),
   ``over-4gib`` (pages past byte 2^32 compared with host-built contents,
   including the pages a wrapped 32-bit offset would have hit).
Exit: 0 every check passed, 1 a check or group failed, 2 cannot run.
Imports only numpy, torch, cupy and ``kvservice.worker`` / ``kvservice.contract`` / ``bench`` modules
(no protobuf, no gRPC); Python 3.10+. ``KVK_IMPORT_AUDIT=1`` makes any other import made by this
repository's code an ImportError (parent and children; tests/kernels/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import builtins
import datetime as dt
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_DECODE = 0.80  # decode GB/s >= 80 % of device-to-device copy GB/s
TARGET_CHECK_COST = 0.02  # checked vs unchecked decode time <= +2 % (issue #15)
BUDGET_S = {"cuda": 450.0, "emulated": 1500.0}  # the whole run, preflight included (--budget-s)
PREFLIGHT_SHARE = 0.6  # of the budget: the preflight's limit (NVRTC, or two cold g++ builds on the emulation)
# group -> timeout in seconds (each also capped by what is left of the budget);
# the sweep is one group per dtype, so a fault or a slow machine costs a third of it
GROUP_TIMEOUTS = {"sanitizer": 150.0, "decode-float32": 120.0, "decode-float16": 120.0, "decode-bfloat16": 120.0,
                  "timing": 180.0, "append-copy-guard": 60.0, "over-4gib": 90.0}
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# What this repository's code may import under KVK_IMPORT_AUDIT=1 (the device image has these).
ALLOWED_IMPORTS = {"numpy", "torch", "cupy", "cupy_backends", "pynvml", "kvservice", "bench"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="directory for gpu-<date>-<gpu>.{jsonl,md,log} (default bench/results)")
    p.add_argument("--backend", choices=["cuda", "emulated"], default="cuda")
    p.add_argument("--quick", action="store_true", help="6 sweep cases, small timing shapes, 3 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick or emulated 3)")
    p.add_argument("--launches", type=int, default=None,
                   help="launches per timed batch (default 20; quick or emulated 2)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget of the whole run, preflight included (default {BUDGET_S})")
    p.add_argument("--groups", default=",".join(GROUP_TIMEOUTS), help="comma-separated groups to run")
    p.add_argument("--dry-run", action="store_true", help="render --inject (JSON lines) into a report only")
    p.add_argument("--inject", type=Path, default=None, help="JSON-lines results to render with --dry-run")
    p.add_argument("--fault", default=None, help="test hook: the child of this group aborts after its first line")
    p.add_argument("--hang", default=None,
                   help="test hook: the child of this group starts a grandchild that sleeps, notes its pid, and hangs")
    p.add_argument("--group-timeout-s", type=float, default=None,
                   help="test hook: every group's time limit (default: each group's own, GROUP_TIMEOUTS)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--build", choices=["checked", "unchecked"], default="checked", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.budget_s = a.budget_s if a.budget_s is not None else BUDGET_S[a.backend]
    small = a.quick or a.backend == "emulated"
    a.rounds = a.rounds or (3 if small else 7)
    a.launches = a.launches or (2 if small else 20)
    unknown = set(a.groups.split(",")) - set(GROUP_TIMEOUTS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; choose from {list(GROUP_TIMEOUTS)}")
    return a


def install_import_audit() -> None:
    """Under KVK_IMPORT_AUDIT=1: an import made by a module of this repository must be of the standard
    library or ALLOWED_IMPORTS (what the device image holds); anything else raises ImportError. The
    packages' own imports (torch's, numpy's) are theirs to make."""
    real = builtins.__import__
    std = set(getattr(sys, "stdlib_module_names", ())) | {"__future__"}
    root = str(ROOT)

    def audited(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        top = name.split(".")[0]
        where = (globals or {}).get("__file__") or ""
        if level == 0 and top and where.startswith(root) and top not in std and top not in ALLOWED_IMPORTS:
            raise ImportError(f"KVK_IMPORT_AUDIT: {where} imports {name!r}, which the device image may lack "
                              f"(allowed: the standard library and {sorted(ALLOWED_IMPORTS)})")
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = audited


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)  # noqa: UP017  (the UTC alias needs Python 3.11; the device may have 3.10)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ==== parent side ======================================================================
def read_lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"kind": "check", "group": "?", "check": "unreadable line", "ok": False,
                            "detail": line[:200]})
    return out


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3f}" if x < 10 else f"{x:.1f} s"


def render(lines: list[dict], header: dict) -> str:
    out = [f"# GPU kernel check — {header.get('date', '-')}", "",
           f"- GPU: {header.get('gpu', '-')}", f"- backend: {header.get('backend', '-')}",
           f"- run: {header.get('status', '-')}"]
    for v in (ln for ln in lines if ln.get("kind") == "versions"):
        keys = ", ".join(f"{k} {v[k]}" for k in v if k not in ("kind", "group", "t", "build"))
        out.append(f"- versions ({v.get('build')}): {keys}")
    if header.get("note"):
        out += ["", f"> {header['note']}"]
    checks = [ln for ln in lines if ln.get("kind") == "check"]
    failed = [c for c in checks if not c.get("ok")]
    out += ["", "## Correctness", "",
            f"{len(checks) - len(failed)} of {len(checks)} checks passed."]
    if failed:
        out += ["", "Failed:", ""] + [f"- **{c.get('group')}** {c.get('check')}: {c.get('detail')}" for c in failed]
    notes = [ln for ln in lines if ln.get("kind") == "note"]
    if notes:
        out += ["", "Notes:", ""] + [f"- {n.get('group')}: {n.get('detail')}" for n in notes]
    aborts = [ln for ln in lines if ln.get("kind") in ("abort", "group")]
    if aborts:
        out += ["", "| group | status | detail |", "|---|---|---|"]
        out += [f"| {a.get('group')} | {a.get('status', 'aborted')} | {a.get('detail', '')} |" for a in aborts]
    out += ["", "| group | check | result | detail | s |", "|---|---|---|---|---|"]
    out += [f"| {c.get('group')} | {c.get('check')} | {'PASS' if c.get('ok') else 'FAIL'} | {c.get('detail')} | "
            f"{c.get('seconds', '-')} |" for c in checks]
    perf = [ln for ln in lines if ln.get("kind") == "perf"]
    costs = [ln for ln in lines if ln.get("kind") == "cost"]
    out += ["", "## Performance", "", "Per launch: median of the rounds (min - max); each round times N back-to-back "
            "launches between one pair of events; checked and unchecked builds alternate round by round.", "",
            "Copy GB/s counts bytes read + written; read-only GB/s counts bytes read (decode only reads).", "",
            "| kernel | shape | ms per launch (min - max) | GB/s | % of copy | % of read-only | blocks/SM |",
            "|---|---|---|---|---|---|---|"]
    for r in perf:
        ms = f"{fmt_s(r['median_s'])} ({fmt_s(r['min_s'])} - {fmt_s(r['max_s'])})"
        ro = f"{100 * r['pct_read']:.1f} %" if r.get("pct_read") is not None else "-"
        out.append(f"| {r['kernel']} | {r['shape']} | {ms} | {r['gbs']:.1f} | {100 * r['pct_copy']:.1f} % | {ro} | "
                   f"{r.get('blocks_per_sm', '-')} |")
    if not perf:
        out.append("| (not measured) | - | - | - | - | - | - |")
    clocks = [ln for ln in lines if ln.get("kind") == "clocks"]
    if clocks:
        out += ["", "SM clock, memory clock and power sampled while each shape was timed (median; min - max):", "",
                "| phase | samples | SM MHz | memory MHz | power W | temperature C | throttle reasons seen |",
                "|---|---|---|---|---|---|---|"]
        for c in clocks:
            def rng(k: str, c: dict = c) -> str:
                v = c.get(k)
                return "-" if not v else f"{v['median']:.0f} ({v['min']:.0f} - {v['max']:.0f})"
            out.append(f"| {c.get('phase')} | {c.get('samples', 0)} | {rng('sm_mhz')} | {rng('mem_mhz')} | "
                       f"{rng('power_w')} | {rng('temp_c')} | {c.get('throttle') or '-'} |")
    out += ["", "## Targets", "", "| target | shape | measured | result |", "|---|---|---|---|"]
    for r in perf:
        if r["kernel"] == "decode (checked)":
            ok = r["pct_copy"] >= TARGET_DECODE
            out.append(f"| decode >= {TARGET_DECODE:.0%} of copy bandwidth | {r['shape']} | {r['pct_copy']:.1%} | "
                       f"{'MET' if ok else 'MISSED'} |")
    for c in costs:
        ok = c["cost"] <= TARGET_CHECK_COST
        what = c.get("kernel", "bounds-check cost")
        out.append(f"| {what} <= {TARGET_CHECK_COST:.0%} | {c['shape']} | {c['cost']:+.1%} "
                   f"(rounds {c.get('round_costs')}) | {'MET' if ok else 'MISSED'} |")
    if not perf and not costs:
        out.append("| (not measured) | - | - | - |")
    kernels = [ln for ln in lines if ln.get("kind") == "kernel" and ln.get("build") == "checked"]
    if kernels and "registers" in kernels[0]:
        out += ["", "## Kernel resources (checked build, from the driver)", "",
                "| kernel | registers | shared (B) | local/spill (B) | blocks/SM |", "|---|---|---|---|---|"]
        out += [f"| {k['name']} | {k['registers']} | {k['shared_bytes']} | {k['local_bytes']} | {k['blocks_per_sm']} |"
                for k in kernels]
    return "\n".join(out) + "\n"


class Run:
    """Parent: starts children, keeps the JSON lines, the log and the report."""

    def __init__(self, args: argparse.Namespace, gpu: str) -> None:
        self.args = args
        now = utc_now()
        stem = f"gpu-{now.date().isoformat()}-{slug(gpu)}"
        args.out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.md, self.log = (args.out / f"{stem}.{ext}" for ext in ("jsonl", "md", "log"))
        self.jsonl.write_text("")
        self.log.write_text("")
        self.header = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu, "backend": args.backend,
                       "status": "running"}
        if args.quick:
            self.header["note"] = "quick mode: 6 sweep cases, small timing shapes; timings are not meaningful"
        elif args.backend == "emulated":
            self.header["note"] = "CPU emulation: correctness is real, timings are not GPU figures"
        self.env = dict(os.environ)
        self.env.setdefault("CUPY_CACHE_DIR", tempfile.mkdtemp(prefix="kvk-cupy-"))  # shared by the children
        self.env["PYTHONUNBUFFERED"] = "1"

    def cmd(self, group: str, build: str = "checked") -> list[str]:
        a = self.args
        c = [sys.executable, str(Path(__file__).resolve()), "--child", group, "--jsonl", str(self.jsonl),
             "--backend", a.backend, "--build", build, "--rounds", str(a.rounds), "--launches", str(a.launches)]
        return c + (["--quick"] if a.quick else []) + (["--fault", a.fault] if a.fault else []) + \
            (["--hang", a.hang] if a.hang else [])

    def note(self, **line: Any) -> None:
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")

    def start(self, group: str, build: str = "checked", wrap: list[str] | None = None) -> subprocess.Popen:
        """A child in a session (process group) of its own: killed as a group at its limit, so a
        compiler or sanitizer it started goes with it."""
        return subprocess.Popen([*(wrap or []), *self.cmd(group, build)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=self.env, cwd=str(ROOT),
                                start_new_session=True)

    def finish(self, name: str, proc: subprocess.Popen, timeout: float, t0: float, echo: bool = False,
               note_failure: bool = True) -> int:
        try:
            text, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc)
            text, _ = proc.communicate()
            rc = -9
        secs = time.perf_counter() - t0
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"==== {name}: exit {rc}, {secs:.1f} s\n{text}\n")
        if echo:
            print(text, end="", flush=True)
        status = "ok" if rc == 0 else ("timed out" if rc == -9 else f"exit {rc}")
        kill_group(proc)  # whatever it left running (a compiler, a sanitizer target)
        self.last_text = text
        if rc != 0 and note_failure:
            tail = " | ".join(text.strip().splitlines()[-3:])[-400:]
            self.note(kind="group", group=name, status=status, ok=False, detail=f"{status} after {secs:.1f} s: {tail}")
            self.note(kind="check", group=name, check=f"{name}: child process", ok=False, detail=f"{status}: {tail}")
        print(f"gpu_check: {name}: {status} ({secs:.1f} s)", flush=True)
        return rc

    def sanitizer(self, limit: float) -> None:
        """compute-sanitizer memcheck / racecheck / synccheck, each on a small decode in its own process
        (the ``sanitize`` child); a note when the tool is absent or the backend is the emulation."""
        tool = find_sanitizer() if self.args.backend == "cuda" else None
        if tool is None:
            why = "the CPU emulation has its own strict mode" if self.args.backend != "cuda" else \
                "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt/nvidia)"
            self.note(kind="note", group="sanitizer", detail=f"sanitizer checks skipped: {why}")
            print(f"gpu_check: sanitizer: skipped ({why})", flush=True)
            return
        t_end = time.perf_counter() + limit
        for name in SANITIZER_TOOLS:
            left = t_end - time.perf_counter()
            if left < 10:
                self.note(kind="check", group="sanitizer", check=f"compute-sanitizer {name}: skipped", ok=False,
                          detail="sanitizer time limit spent")
                continue
            t0 = time.perf_counter()
            wrap = [tool, "--tool", name, "--error-exitcode", "99", "--print-limit", "20"]
            if name == "racecheck":
                wrap += ["--racecheck-report", "all"]
            rc = self.finish(f"sanitizer {name}", self.start("sanitize", wrap=wrap), left, t0, note_failure=False)
            tail = " | ".join(self.last_text.strip().splitlines()[-4:])[-600:]
            self.note(kind="check", group="sanitizer", check=f"compute-sanitizer {name} on a small decode",
                      ok=rc == 0, detail=("clean: " if rc == 0 else f"exit {rc}: ") + tail,
                      seconds=round(time.perf_counter() - t0, 3))

    def report(self, status: str) -> None:
        self.header["status"] = status
        self.md.write_text(render(read_lines(self.jsonl), self.header), encoding="utf-8")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for pattern in ("/usr/local/cuda*/bin/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                    "/opt/nvidia/*/compute-sanitizer", "/opt/nvidia/*/*/compute-sanitizer"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def gpu_name(backend: str) -> str:
    """Device name for the file names, without creating a CUDA context here."""
    if backend == "emulated":
        return "cpu-emulation"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else "gpu"
    except Exception:
        return "gpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("KVK_IMPORT_AUDIT") == "1":
        install_import_audit()
    if args.child:
        from bench import gpu_groups

        return gpu_groups.run_child(args)
    if args.dry_run:
        lines = [json.loads(x) for x in args.inject.read_text().splitlines() if x.strip()] if args.inject else []
        header = {"date": utc_now().strftime("%Y-%m-%d %H:%M UTC"), "gpu": "(dry run: nothing executed)",
                  "backend": args.backend, "status": "dry run"}
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "gpu-dry-run.md"
        path.write_text(render(lines, header), encoding="utf-8")
        print(f"report written to {path}")
        return 0
    if args.backend == "cuda":
        try:
            import cupy  # noqa: F401  (importing creates no CUDA context)
        except Exception as e:
            print(f"gpu_check: cupy is not importable ({type(e).__name__}: {e}); run this on a GPU machine "
                  "with cupy, or use --backend emulated", file=sys.stderr)
            return 2
    start = time.perf_counter()
    run = Run(args, gpu_name(args.backend))
    print(f"gpu_check: writing {run.jsonl} and {run.md}", flush=True)
    # 1. preflight: both builds at once
    t0 = time.perf_counter()
    procs = {b: run.start("preflight", b) for b in ("checked", "unchecked")}
    limit = PREFLIGHT_SHARE * args.budget_s
    rcs = {b: run.finish(f"preflight ({b})", p, max(1.0, limit - (time.perf_counter() - t0)), t0, echo=True)
           for b, p in procs.items()}
    if any(rcs.values()):
        run.report("preflight failed")
        tail = run.log.read_text().strip().splitlines()[-5:]
        print("gpu_check: preflight failed (see " + str(run.log) + "):\n  " + "\n  ".join(tail), file=sys.stderr)
        return 2
    run.report("running")
    # 2. the groups, each in its own process, within the budget
    deadline = start + args.budget_s
    for group in args.groups.split(","):
        left = deadline - time.perf_counter()
        if left < 15:
            run.note(kind="group", group=group, status="skipped", ok=False,
                     detail=f"time budget ({args.budget_s:.0f} s) spent")
            run.note(kind="check", group=group, check=f"{group}: skipped", ok=False, detail="time budget spent")
            continue
        t0 = time.perf_counter()
        if group == "sanitizer":
            run.sanitizer(min(args.group_timeout_s or GROUP_TIMEOUTS[group], left))
        else:
            run.finish(group, run.start(group), min(args.group_timeout_s or GROUP_TIMEOUTS[group], left), t0)
        run.report("running")
    lines = read_lines(run.jsonl)
    ok = all(ln.get("ok", True) for ln in lines if ln.get("kind") == "check")
    run.report(f"{'all checks passed' if ok else 'FAILURES'} in {time.perf_counter() - start:.0f} s")
    print(run.md.read_text())
    print(f"gpu_check: report {run.md}, results {run.jsonl} ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
