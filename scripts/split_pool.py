"""Split kvservice/core/pool.py by the phases of a step, one module each (issue 21: modules of at most 500 lines).

Mechanical and re-runnable on a tree whose pool.py still has its section headers: each section of class Pool
(``    # ---- <name> ----``) listed in SECTIONS moves, as it is, into a base class of Pool in its own module; the
module gets pool.py's imports (ruff --fix then drops the unused ones). Pool keeps its constructor, its read
side and `step`, which runs the phases.

    python scripts/split_pool.py && ruff check --fix kvservice/core
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POOL = ROOT / "kvservice" / "core" / "pool.py"

#: section header prefix -> (module, class, docstring)
SECTIONS = {
    "phase 1: validate": ("pool_validate", "ValidatePhase",
                          "Phase 1 of a Step: the request checked and resolved to rows (`StepInput`), "
                          "nothing changed."),
    "phase 2: plan": ("pool_plan", "PlanPhase",
                      "Phase 2 of a Step: every layer group's slot demand and changes, planned without changing "
                      "anything (`StepPlan`); the refusal of a step that does not fit."),
    "phase 3: commit": ("pool_commit", "CommitPhase",
                        "Phase 3 of a Step: the plan carried out (frees, forks, window releases, prefix hits, "
                        "copy-on-write, new pages), and what it changed per layer group."),
    "rows and lookups": ("pool_rows", "RowIndex",
                         "A pool's rows: sequence id -> row lookups, row handles taken and grown; and the emission "
                         "of the batch's tables (phase 4)."),
    "durable state": ("pool_codec", "PoolCodec",
                      "A pool as plain data and back (`PoolState`): what snapshots store and recovery rebuilds."),
}
#: Sections that travel with the one before them (same module).
FOLLOW = {"phase 4: emit": "rows and lookups"}


def main() -> int:
    text = POOL.read_text()
    lines = text.splitlines(keepends=True)
    cls = next(i for i, line in enumerate(lines) if line.startswith("class Pool"))
    heads = [(i, m.group(1).strip()) for i, line in enumerate(lines)
             if (m := re.match(r"    # ---- ([^-]+?) -+\s*$", line)) and i > cls]
    if not any(name.startswith("phase 1") for _, name in heads):
        print("pool.py has no phase sections: already split?", file=sys.stderr)
        return 1
    imports_start = next(i for i, line in enumerate(lines) if line.startswith("from __future__"))
    imports_end = next(i for i, line in enumerate(lines) if line.startswith("__all__"))
    imports = "".join(lines[imports_start + 1:imports_end]).rstrip() + "\n"
    bodies: dict[str, list[str]] = {}
    cut: list[tuple[int, int]] = []
    for n, (i, name) in enumerate(heads):
        end = heads[n + 1][0] if n + 1 < len(heads) else len(lines)
        key = next((k for k in SECTIONS if name.startswith(k)), None)
        follow = next((v for k, v in FOLLOW.items() if name.startswith(k)), None)
        target = key or follow
        if target is None:
            continue
        bodies.setdefault(target, []).extend(lines[i:end])
        cut.append((i, end))
    keep = [line for n, line in enumerate(lines) if not any(a <= n < b for a, b in cut)]
    bases = []
    for key, (module, name, doc) in SECTIONS.items():
        body = "".join(bodies[key]).rstrip() + "\n"
        if key == "durable state":
            body = body.replace("    @staticmethod\n    def from_state(state: PoolState, plan: Plan) -> Pool:",
                                "    @classmethod\n    def from_state(cls, state: PoolState, plan: Plan) -> Self:")
            body = re.sub(r"\bpool = Pool\(", "pool = cls(", body)
        wrapped = "\n".join(textwrap.wrap(doc, 110))
        out = (f'"""{wrapped}\n\nA base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read '
               f'pool.py first).\n"""\n\nfrom __future__ import annotations\n\nfrom typing import Self\n\n'
               f"{imports}\n\nclass {name}:\n"
               f'    """{doc.split(":")[0].rstrip(".")} (part of Pool)."""\n\n'
               "    # Reads and writes the attributes Pool.__init__ sets.\n\n"
               f"{body}")
        (POOL.parent / f"{module}.py").write_text(out)
        bases.append((module, name))
    pool = "".join(keep)
    imp = "".join(f"from kvservice.core.{m} import {c}\n" for m, c in bases)
    pool = pool.replace("from kvservice.core.rowslots import", imp + "from kvservice.core.rowslots import", 1)
    pool = pool.replace("class Pool:", f"class Pool({', '.join(c for _, c in bases)}):", 1)
    POOL.write_text(pool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
