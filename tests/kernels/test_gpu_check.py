"""bench/gpu_check.py without a GPU: arguments, the report renderer, a clean
exit 2 without cupy, the whole run end to end on the CPU emulation (quick
sizes), and a child that dies taking only its own group down."""

from __future__ import annotations

import ast
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

INJECT = [
    {"kind": "versions", "group": "preflight", "build": "checked", "gpu": "NVIDIA H200", "cupy": "13.6.0"},
    {"kind": "check", "group": "decode-float16", "check": "decode float16-d128-g4", "ok": True, "detail": "ok"},
    {"kind": "perf", "group": "timing", "kernel": "device-to-device copy", "shape": "1024 MiB", "bytes": 2 << 30,
     "gbs": 4000.0, "pct_copy": 1.0, "median_s": 5.4e-4, "min_s": 5.3e-4, "max_s": 5.6e-4},
    {"kind": "perf", "group": "timing", "kernel": "decode (checked)", "shape": "B=64", "bytes": 1 << 30,
     "gbs": 2600.0, "pct_copy": 0.65, "pct_read": 0.6, "median_s": 4e-4, "min_s": 3.9e-4, "max_s": 4.2e-4,
     "blocks_per_sm": 4},
    {"kind": "cost", "group": "timing", "kernel": "bounds-check cost", "shape": "B=64", "cost": 0.02,
     "round_costs": [0.01, 0.03]},
    {"kind": "group", "group": "over-4gib", "status": "timed out", "ok": False, "detail": "timed out after 90 s"},
]


def run_script(*args: str, timeout: float = 1700) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))


def lines_of(out: Path) -> list[dict]:
    (jsonl,) = out.glob("gpu-*-cpu-emulation.jsonl")
    return [json.loads(x) for x in jsonl.read_text().splitlines()]


def test_parse_args_defaults() -> None:
    a = gpu_check.parse_args([])
    assert a.backend == "cuda" and a.out == ROOT / "bench" / "results" and (a.rounds, a.launches) == (7, 20)
    assert a.budget_s == 450
    e = gpu_check.parse_args(["--backend", "emulated", "--out", "x"])
    assert e.out == Path("x") and (e.rounds, e.launches) == (3, 2) and e.budget_s == 1500
    assert gpu_check.parse_args(["--budget-s", "300"]).budget_s == 300


def test_render_injected_results() -> None:
    text = gpu_check.render(INJECT, {"date": "2030-01-02 03:04 UTC", "gpu": "NVIDIA H200", "backend": "cuda",
                                     "status": "FAILURES"})
    assert "2030-01-02 03:04 UTC" in text and "NVIDIA H200" in text and "cupy 13.6.0" in text
    assert "| decode >= 80% of copy bandwidth | B=64 | 65.0% | MISSED |" in text
    assert "| bounds-check cost <= 2% | B=64 | +2.0% (rounds [0.01, 0.03]) | MET |" in text
    assert "| over-4gib | timed out | timed out after 90 s |" in text
    assert "| decode (checked) | B=64 | 0.400 (0.390 - 0.420) | 2600.0 | 65.0 % | 60.0 % | 4 |" in text
    assert "| device-to-device copy | 1024 MiB | 0.540 (0.530 - 0.560) | 4000.0 | 100.0 % | - | - |" in text


def test_dry_run_writes_report(tmp_path: Path) -> None:
    inj = tmp_path / "r.jsonl"
    inj.write_text("\n".join(json.dumps(x) for x in INJECT))
    assert gpu_check.main(["--dry-run", "--inject", str(inj), "--out", str(tmp_path / "o")]) == 0
    assert "MISSED" in (tmp_path / "o" / "gpu-dry-run.md").read_text()


def test_without_cupy_fails_cleanly(tmp_path: Path) -> None:
    code = ("import sys, runpy; sys.modules['cupy'] = None; "
            f"sys.argv = ['gpu_check.py', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cupy is not importable" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(1800)  # cold g++ builds on a loaded 2-core machine (cached by source hash)
def test_emulated_end_to_end(tmp_path: Path) -> None:
    proc = run_script("--backend", "emulated", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()  # noqa: UP017
    report = (tmp_path / f"gpu-{today}-cpu-emulation.md").read_text()
    lines = lines_of(tmp_path)
    checks = [x for x in lines if x["kind"] == "check"]
    assert checks and all(c["ok"] for c in checks)
    assert {x["group"] for x in lines} == {"preflight", *gpu_check.GROUP_TIMEOUTS}
    kernels = {(x["build"], x["name"]) for x in lines if x["kind"] == "kernel"}
    from kvservice.worker import launch_plan

    assert kernels == {(b, n) for b in ("checked", "unchecked") for n in launch_plan.kernel_names()}
    assert {x["kernel"] for x in lines if x["kind"] == "perf"} == {
        "device-to-device copy", "read-only pass", "decode (checked)", "decode (unchecked)",
        "decode (checked+generations)", "append_kv", "copy_blocks"}
    assert "FAIL" not in report and "all checks passed" in report and "| bounds-check cost <= 2% |" in report
    assert "| generation-check cost <= 2% |" in report
    assert any(c["check"].startswith("stale_page") and c["ok"] for c in checks)
    long_rows = [c for c in checks if c["check"].startswith("long rows at the timing shape")]
    assert long_rows and all("max err" in c["detail"] for c in long_rows)
    assert any(c["check"].startswith("widen: every 16-bit pattern") for c in checks)
    assert [x["group"] for x in lines if x["kind"] == "note"] == ["sanitizer"]  # not on the emulation


@pytest.mark.timeout(1800)  # cold g++ builds on a loaded 2-core machine (cached by source hash)
def test_dead_child_takes_only_its_group(tmp_path: Path) -> None:
    proc = run_script("--backend", "emulated", "--quick", "--out", str(tmp_path), "--groups",
                      "decode-float16,over-4gib", "--fault", "decode-float16")
    assert proc.returncode == 1
    lines = lines_of(tmp_path)
    dead = [x for x in lines if x["kind"] == "group"]
    assert [(x["group"], x["ok"]) for x in dead] == [("decode-float16", False)] and "exit" in dead[0]["status"]
    # the line written before the abort survived, and the next group ran in a fresh process
    first = next(x for x in lines if x["group"] == "decode-float16" and x["kind"] == "check")
    assert first["check"].startswith("decode float16-") and first["ok"]
    later = [x for x in lines if x["group"] == "over-4gib" and x["kind"] == "check"]
    assert len(later) == 2 and all(x["ok"] for x in later)


@pytest.mark.timeout(1800)
def test_a_hung_child_is_killed_with_its_process_group(tmp_path: Path) -> None:
    """A child stuck with a grandchild under it (as NVRTC or g++ would be) is killed at its limit, the
    grandchild with it, and the run goes on."""
    proc = run_script("--backend", "emulated", "--quick", "--out", str(tmp_path), "--groups", "over-4gib",
                      "--hang", "over-4gib", "--budget-s", "240",
                      "--group-timeout-s", "30")        # the group's own limit is 90 s: 30 s is plenty to hang
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = lines_of(tmp_path)
    (hung,) = [x for x in lines if x["kind"] == "note" and x["group"] == "over-4gib"]
    dead = [x for x in lines if x["kind"] == "group"]
    assert [(x["group"], x["status"]) for x in dead] == [("over-4gib", "timed out")]
    # SIGKILL lands asynchronously and init reaps the orphan when it gets to it: wait (generously) until
    # the sleeper is gone, a zombie, or its pid belongs to another process; it would sleep for 600 s
    for _ in range(1200):
        if not sleeper_alive(hung["pid"]):
            break
        time.sleep(0.1)
    assert not sleeper_alive(hung["pid"]), f"grandchild {hung['pid']} outlived its group"


def sleeper_alive(pid: int) -> bool:
    """The --hang grandchild ``pid`` still runs (not gone, not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X") and b"time.sleep(600)" in cmdline


def plain_python(where: Path, packages: tuple[str, ...] = ("numpy", "torch")) -> str:
    """A python3 with nothing installed but ``packages`` and what they themselves require (the device
    image's own python3 has numpy, torch and cupy; cupy has no CPU build): a venv without pip whose
    site-packages links to those distributions of this environment only."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    (site,) = (where / "lib").glob("python3*/site-packages")
    todo, seen = list(packages), set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement this environment does not have
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            src, dst = Path(dist.locate_file(top)), site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return str(where / "bin" / "python")


@pytest.mark.timeout(2400)
def test_imports_only_what_the_device_image_has(tmp_path: Path) -> None:
    """The quick emulated run passes under a python3 that has only numpy and torch installed, with
    KVK_IMPORT_AUDIT=1 (every import made by this repository's code, parent and children, must be of the
    standard library, numpy, torch, cupy, pynvml or the repository itself): the device command needs
    nothing the image lacks. So does the dry run."""
    py = plain_python(tmp_path / "py")
    assert subprocess.run([py, "-c", "import grpc"], capture_output=True).returncode != 0  # really plain
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["KVK_IMPORT_AUDIT"] = "1"
    proc = subprocess.run([py, str(SCRIPT), "--backend", "emulated", "--quick", "--out", str(tmp_path / "o"),
                           "--groups", "decode-float16,append-copy-guard,timing"], capture_output=True, text=True,
                          timeout=1800, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KVK_IMPORT_AUDIT" not in proc.stdout + proc.stderr
    dry = subprocess.run([py, str(SCRIPT), "--dry-run", "--out", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=300, cwd=str(ROOT), env=env)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]


def test_import_audit_refuses_other_packages() -> None:
    code = ("import os, sys, runpy; os.environ['KVK_IMPORT_AUDIT'] = '1'; "
            f"mod = runpy.run_path({str(SCRIPT)!r}); mod['install_import_audit'](); "
            f"exec(compile('import grpc', {str(ROOT / 'bench' / 'x.py')!r}, 'exec'), "
            f"{{'__file__': {str(ROOT / 'bench' / 'x.py')!r}, '__name__': 'x'}})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KVK_IMPORT_AUDIT" in proc.stderr and "'grpc'" in proc.stderr


def test_runs_on_python_310() -> None:
    """The device may have Python 3.10: no 3.11+ syntax or datetime.UTC in what gpu_check imports."""
    files = [SCRIPT, ROOT / "bench" / "gpu_groups.py", ROOT / "bench" / "decode_cases.py"] + [
        ROOT / "kvservice" / "worker" / f"{m}.py"
        for m in ("kernel_api", "launch_plan", "page_layout", "kernels_cuda", "kernels_cpu", "reference", "ops_numpy")]
    for f in files:
        src = f.read_text()
        ast.parse(src, filename=str(f), feature_version=(3, 10))
        assert "dt.UTC" not in src and "datetime.UTC" not in src and "tomllib" not in src, f


def test_every_group_has_a_runner() -> None:
    from bench import gpu_groups

    # "sanitizer" runs in the parent (compute-sanitizer around "sanitize" children)
    assert set(gpu_groups.GROUPS) == {"preflight", "sanitize", *gpu_check.GROUP_TIMEOUTS} - {"sanitizer"}
