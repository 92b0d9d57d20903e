"""Every kernel compiles with nvcc for sm_80 and sm_90 without warnings
(-Werror all-warnings); ptxas registers/spills are recorded under build/."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from worker import kernel_api

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "worker" / "kernels"
OUT = ROOT / "build" / "nvcc"
ARCHS = ("sm_80", "sm_90")
FLAGS = ["-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v", "-c"]
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def parse_ptxas(text: str) -> list[dict]:
    """One row per (entry function, arch): registers, stack, spill stores/loads."""
    rows, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
        if m:
            cur = {"function": m.group(1), "arch": m.group(2)}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
    return rows


def compile_one(src: Path, arch: str, defines: tuple[str, ...] = ()) -> tuple[int, str, list[dict]]:
    flags = [f"-arch={arch}", *FLAGS, *defines]
    h = hashlib.sha256(" ".join(flags).encode())
    for p in sorted(KDIR.glob("*")):
        h.update(p.name.encode() + p.read_bytes())
    key = OUT / h.hexdigest()[:16] / f"{src.stem}-{arch}{''.join(defines)}.json"
    if key.exists():
        d = json.loads(key.read_text())
        return d["rc"], d["log"], d["rows"]
    key.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["nvcc", *flags, str(src), "-o", str(key.with_suffix(".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log = proc.stdout + proc.stderr
    rows = parse_ptxas(log)
    if proc.returncode == 0:
        key.write_text(json.dumps({"rc": 0, "log": log, "rows": rows}))
    return proc.returncode, log, rows


def table(rows: list[dict]) -> str:
    lines = ["| function | arch | registers | stack (B) | spill stores (B) | spill loads (B) |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["function"], r["arch"])):
        lines.append(f"| {r['function']} | {r['arch']} | {r.get('registers', '?')} | {r.get('stack', '?')} | "
                     f"{r.get('spill_stores', '?')} | {r.get('spill_loads', '?')} |")
    return "\n".join(lines)


def test_nvcc_all_kernels_sm80_sm90() -> None:
    jobs = [(src, arch, ()) for src in sorted(KDIR.glob("*.cu")) for arch in ARCHS]
    jobs.append((KDIR / "decode_attention.cu", "sm_90", ("-DKV_NO_BOUNDS_CHECK",)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: (j, compile_one(*j)), jobs))
    rows: list[dict] = []
    for (src, arch, defines), (rc, log, r) in results:
        assert rc == 0, f"nvcc {arch} {src.name} {defines} failed:\n{log}"
        assert "warning" not in log.lower(), log
        if not defines:
            rows += r
    names = {r["function"] for r in rows}
    assert names == set(kernel_api.kernel_names()), names ^ set(kernel_api.kernel_names())
    report = table(rows)
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "nvcc-resources.md").write_text(report + "\n")
    print("\n" + report)
