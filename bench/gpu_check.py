"""GPU check of the paged KV kernels, built so one short device window is enough.

    python3 bench/gpu_check.py --out DIR            # on the GPU machine (cupy, torch, numpy)
    python3 bench/gpu_check.py --out DIR --backend emulated [--quick]   # anywhere: CPU emulation

Writes ``DIR/gpu-<date>-<gpu>.jsonl`` (one JSON object per result, appended
and flushed as each finishes) and ``DIR/gpu-<date>-<gpu>.md`` (the report,
re-rendered after every group), plus ``.log`` with each child's output.

1. preflight: two child processes at once compile the checked and the
   ``-DKV_NO_BOUNDS_CHECK`` modules, resolve every kernel and print the
   CuPy / NVRTC / driver versions and each kernel's registers, shared and
   local (spill) bytes and resident blocks per SM. Exit 2 if that fails.
2. every group runs in its own child process (a sticky CUDA error such as an
   illegal address poisons that group only), each check synchronised, with
   a time budget for the whole run, preflight included (default 450 s):
   ``decode-<dtype>`` (bench/decode_cases.py: head_dim x GQA group with
   windows, splits, page sizes, policies, bad pages, empty rows; vs the torch
   float64 reference; one group per cache dtype), ``timing`` (N back-to-back launches between one pair of
   events, checked and unchecked builds interleaved over rounds: median and
   spread, against a device-to-device copy), ``append-copy-guard``,
   ``over-4gib`` (pages past byte 2^32 compared with host-built contents,
   including the pages a wrapped 32-bit offset would have hit).
Exit: 0 every check passed, 1 a check or group failed, 2 cannot run.
Imports only numpy, torch, cupy and ``worker`` / ``bench`` modules (no
protobuf, no gRPC); Python 3.10+.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
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
BUDGET_S = 450.0  # the whole run, preflight included
PREFLIGHT_TIMEOUT_S = 240.0
# group -> timeout in seconds (each also capped by what is left of the budget);
# the sweep is one group per dtype, so a fault or a slow machine costs a third of it
GROUP_TIMEOUTS = {"decode-float32": 120.0, "decode-float16": 120.0, "decode-bfloat16": 120.0, "timing": 150.0,
                  "append-copy-guard": 60.0, "over-4gib": 90.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="directory for gpu-<date>-<gpu>.{jsonl,md,log} (default bench/results)")
    p.add_argument("--backend", choices=["cuda", "emulated"], default="cuda")
    p.add_argument("--quick", action="store_true", help="6 sweep cases, small timing shapes, 3 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick or emulated 3)")
    p.add_argument("--launches", type=int, default=None,
                   help="launches per timed batch (default 20; quick or emulated 2)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget of the groups")
    p.add_argument("--groups", default=",".join(GROUP_TIMEOUTS), help="comma-separated groups to run")
    p.add_argument("--dry-run", action="store_true", help="render --inject (JSON lines) into a report only")
    p.add_argument("--inject", type=Path, default=None, help="JSON-lines results to render with --dry-run")
    p.add_argument("--fault", default=None, help="test hook: the child of this group aborts after its first line")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--build", choices=["checked", "unchecked"], default="checked", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    small = a.quick or a.backend == "emulated"
    a.rounds = a.rounds or (3 if small else 7)
    a.launches = a.launches or (2 if small else 20)
    unknown = set(a.groups.split(",")) - set(GROUP_TIMEOUTS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; choose from {list(GROUP_TIMEOUTS)}")
    return a


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
            "| kernel | shape | ms per launch (min - max) | GB/s | % of copy | blocks/SM |",
            "|---|---|---|---|---|---|"]
    for r in perf:
        ms = f"{fmt_s(r['median_s'])} ({fmt_s(r['min_s'])} - {fmt_s(r['max_s'])})"
        out.append(f"| {r['kernel']} | {r['shape']} | {ms} | {r['gbs']:.1f} | {100 * r['pct_copy']:.1f} % | "
                   f"{r.get('blocks_per_sm', '-')} |")
    if not perf:
        out.append("| (not measured) | - | - | - | - | - |")
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
        return c + (["--quick"] if a.quick else []) + (["--fault", a.fault] if a.fault else [])

    def note(self, **line: Any) -> None:
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")

    def start(self, group: str, build: str = "checked") -> subprocess.Popen:
        return subprocess.Popen(self.cmd(group, build), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=str(ROOT))

    def finish(self, name: str, proc: subprocess.Popen, timeout: float, t0: float, echo: bool = False) -> int:
        try:
            text, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            rc = -9
        secs = time.perf_counter() - t0
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"==== {name}: exit {rc}, {secs:.1f} s\n{text}\n")
        if echo:
            print(text, end="", flush=True)
        status = "ok" if rc == 0 else ("timed out" if rc == -9 else f"exit {rc}")
        if rc != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])[-400:]
            self.note(kind="group", group=name, status=status, ok=False, detail=f"{status} after {secs:.1f} s: {tail}")
            self.note(kind="check", group=name, check=f"{name}: child process", ok=False, detail=f"{status}: {tail}")
        print(f"gpu_check: {name}: {status} ({secs:.1f} s)", flush=True)
        return rc

    def report(self, status: str) -> None:
        self.header["status"] = status
        self.md.write_text(render(read_lines(self.jsonl), self.header), encoding="utf-8")


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
    limit = min(PREFLIGHT_TIMEOUT_S, args.budget_s)
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
        run.finish(group, run.start(group), min(GROUP_TIMEOUTS[group], left), t0)
        run.report("running")
    lines = read_lines(run.jsonl)
    ok = all(ln.get("ok", True) for ln in lines if ln.get("kind") == "check")
    run.report(f"{'all checks passed' if ok else 'FAILURES'} in {time.perf_counter() - start:.0f} s")
    print(run.md.read_text())
    print(f"gpu_check: report {run.md}, results {run.jsonl} ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
