"""Issue 21's 'contract types' move, as a re-runnable rewrite (idempotent): what the client and the worker share
with the manager moves from core/ to contract/, so that neither loads the manager's layers.

- core/geometry.py -> contract/geometry.py (CacheSpec, LayerSpec, IndexSpace, Geometry: what the wire describes);
- Sizing and Plan (the planner's request and answer) -> contract/sizing.py; core/planner.py keeps the planning;
- stepplan.MAX_COUNT -> contract/geometry.py; limits.check_reply_bytes -> contract/transport.py.

Run from the repository root: python scripts/move_contract_types.py [paths...] (default: the whole tree).
It rewrites import lines only (and the moved definitions once); on an already-moved tree it changes nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: name -> its new module, for names imported from the old modules
NEW_HOME = {
    "Sizing": "kvservice.contract.sizing", "Plan": "kvservice.contract.sizing",
    "MAX_COUNT": "kvservice.contract.geometry", "check_reply_bytes": "kvservice.contract.transport",
}
OLD_MODULES = ("kvservice.core.planner", "kvservice.core.stepplan", "kvservice.core.limits")
IMPORT = re.compile(r"^(?P<indent>[ \t]*)from (?P<mod>kvservice\.core\.(?:planner|stepplan|limits)) import "
                    r"(?P<names>[^()\n]+?)(?P<tail>[ \t]*#[^\n]*)?$", re.M)


def _move_definitions() -> None:
    core, contract = ROOT / "kvservice" / "core", ROOT / "kvservice" / "contract"
    if (core / "geometry.py").exists():
        subprocess.run(["git", "mv", "kvservice/core/geometry.py", "kvservice/contract/geometry.py"], cwd=ROOT,
                       check=True)
    geo = contract / "geometry.py"
    text = geo.read_text()
    if "MAX_COUNT" not in text:
        text = text.replace("MAX_LAYERS = 4096\n", "MAX_LAYERS = 4096\n#: No pool holds more tokens per sequence; "
                            "keeps every sum of counts far from int64 overflow.\nMAX_COUNT = 2**40\n", 1)
        geo.write_text(text)
    planner = core / "planner.py"
    src = planner.read_text()
    if "class Sizing" in src:
        start = src.index("@dataclass(frozen=True, slots=True)\nclass Sizing:")
        end = src.index("\n\n\ndef sliding_group_slots")
        sizing = src[start:end]
        pstart = src.index("@dataclass(frozen=True, slots=True)\nclass Plan:")
        pend = src.index("\n\n\ndef plan(")
        plan_cls = src[pstart:pend]
        src = src[:pstart] + src[pend + 3:]
        src = src[:start] + src[end + 3:]
        src = src.replace("from dataclasses import dataclass, field\n\n", "")
        src = src.replace("from kvservice.core.geometry import INT32_MAX, CacheSpec, Geometry, group_windows\n",
                          "from kvservice.contract.geometry import CacheSpec, Geometry, group_windows\n"
                          "from kvservice.contract.sizing import DEFAULT_BATCHED_TOKENS, Plan, Sizing\n")
        src = re.sub(r"\n\n#: Tokens one Step may add over the whole batch when the sizing says none \(vLLM's default\n"
                     r"#: max_num_batched_tokens for its API server with chunked prefill\)\.\nDEFAULT_BATCHED_TOKENS = "
                     r"2048\n", "\n", src)
        (contract / "sizing.py").write_text(
            '"""The planner\'s request (Sizing) and its answer (Plan): shared by the manager, the client and the\n'
            'worker (core/planner.py does the planning)."""\n\nfrom __future__ import annotations\n\n'
            "from dataclasses import dataclass, field\n\nfrom kvservice.contract.errors import InvalidArgument\n"
            "from kvservice.contract.geometry import INT32_MAX, Geometry\n\n"
            "#: Tokens one Step may add over the whole batch when the sizing says none (vLLM's default\n"
            "#: max_num_batched_tokens for its API server with chunked prefill).\nDEFAULT_BATCHED_TOKENS = 2048\n\n\n"
            + sizing + "\n\n\n" + plan_cls + "\n")
        planner.write_text(src)
    step = core / "stepplan.py"
    s = step.read_text()
    line = "MAX_COUNT = 2**40     # no pool holds more tokens per sequence; keeps every sum far from int64 overflow\n"
    if line in s:
        s = s.replace(line, "")
    if "import MAX_COUNT" not in s:
        s = s.replace("from kvservice.contract.errors import", "from kvservice.contract.geometry import MAX_COUNT\n"
                      "from kvservice.contract.errors import", 1)
    step.write_text(s)
    lim = core / "limits.py"
    s = lim.read_text()
    m = re.search(r"\n\ndef check_reply_bytes\(.*?(?=\n\n\n|\Z)", s, re.S)
    if m:
        lim.write_text(s[:m.start()] + s[m.end():])
        tr = contract / "transport.py"
        t = tr.read_text()
        t = t.replace("from __future__ import annotations\n", "from __future__ import annotations\n\n"
                      "from kvservice.contract.errors import ResourceExhausted\n", 1)
        tr.write_text(t.rstrip("\n") + "\n" + m.group(0).rstrip("\n") + "\n")


def rewrite(path: Path) -> bool:
    text = path.read_text()
    new = text.replace("kvservice.core.geometry", "kvservice.contract.geometry")
    new = new.replace("kvservice/core/geometry.py", "kvservice/contract/geometry.py")

    def split(m: re.Match) -> str:
        names = [n.strip() for n in m.group("names").split(",") if n.strip()]
        moved: dict[str, list[str]] = {}
        stay = []
        for n in names:
            base = n.split(" as ")[0].strip()
            if base in NEW_HOME and not (base == "MAX_COUNT" and m.group("mod") != "kvservice.core.stepplan") \
                    and not (base == "check_reply_bytes" and m.group("mod") != "kvservice.core.limits") \
                    and not (base in ("Sizing", "Plan") and m.group("mod") != "kvservice.core.planner"):
                moved.setdefault(NEW_HOME[base], []).append(n)
            else:
                stay.append(n)
        if not moved:
            return m.group(0)
        tail, ind = m.group("tail") or "", m.group("indent")
        lines = [f"{ind}from {mod} import {', '.join(ns)}{tail}" for mod, ns in sorted(moved.items())]
        if stay:
            lines.append(f"{ind}from {m.group('mod')} import {', '.join(stay)}{tail}")
        return "\n".join(lines)

    new = IMPORT.sub(split, new)
    if new != text:
        path.write_text(new)
        return True
    return False


def main(paths: list[str]) -> int:
    _move_definitions()
    files = [Path(p) for p in paths] if paths else [
        p for d in ("kvservice", "tests", "bench", "scripts", "docs") for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".md") and "v1" not in p.parts and p.name != "move_contract_types.py"]
    files += [ROOT / "README.md", ROOT / "ARCHITECTURE.md"] if not paths else []
    changed = [str(p.relative_to(ROOT)) for p in files if p.exists() and rewrite(p)]
    print(f"rewrote {len(changed)} files")
    subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "--select", "I", "--quiet", "kvservice", "tests",
                    "bench", "scripts"], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
