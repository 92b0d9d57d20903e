"""Per-module draws for hand triage: mutants that no sample, list or note has named before.

    python scripts/mutation_draw.py --package state --prefix kvservice.state.nats. --count 32 --seed 30 \
        --out /tmp/draw/ST1.txt

Generates the package's mutants if its .mutmut/<package>/ run has none yet (mutmut's coverage pass: minutes),
leaves out every mutant name written anywhere in the repository (bench/results/mutation_python.json's samples,
bench/mutation_killed.txt, bench/mutation_equivalent.txt, triage notes, test comments), draws `count` of the rest
uniformly (so each module in proportion to its mutants) and writes each with the diff `mutmut show` prints. The
draws of bench/results/mutation_triage.md were made this way; their verdicts are hand-made (apply, run the
covering tests, revert), not mutmut's.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation as M  # scripts/mutation.py: the package runs and their .meta files)

NAME = re.compile(r"kvservice\.[\w.ǁ]+__mutmut_\d+")


def known_names() -> set[str]:
    """Every mutant name written in the repository's text files (outside .mutmut/ and .venv/)."""
    out: set[str] = set()
    for p in M.ROOT.rglob("*"):
        if p.suffix in {".txt", ".md", ".json", ".py"} and p.is_file() \
                and not {".mutmut", ".venv", ".git"} & set(p.relative_to(M.ROOT).parts):
            out |= set(NAME.findall(p.read_text(errors="ignore")))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", required=True, help="a package of [tool.kvservice.mutation.packages]")
    ap.add_argument("--prefix", action="append", default=[], help="module prefix to draw from (repeatable)")
    ap.add_argument("--exclude", action="append", default=[], help="module prefix left out (repeatable)")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.package not in M.packages():
        raise SystemExit(f"unknown package {a.package}; known: {', '.join(M.packages())}")
    if not M._metas(a.package):
        r = M._run([sys.executable, "-m", "mutmut", "run", "--max-children", "2", "no-such-mutant"],
                   M._prepare(a.package), 3600, M.MUTANT_ENV)
        if not M._metas(a.package):
            raise SystemExit(f"mutmut made no mutants for {a.package}:\n{(r.stdout + r.stderr)[-3000:]}")
    known = known_names()
    pool = sorted(k for f in M._metas(a.package) for k in json.loads(Path(f).read_text()).get("exit_code_by_key", {})
                  if k not in known and (not a.prefix or M._module(k).startswith(tuple(a.prefix)))
                  and not M._module(k).startswith(tuple(a.exclude) or ("\0",)))
    if len(pool) < a.count:
        raise SystemExit(f"only {len(pool)} mutants left to draw from, {a.count} asked")
    names = sorted(random.Random(a.seed).sample(pool, a.count))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as fh:
        fh.write(f"# {a.package} {' '.join(a.prefix)}: {a.count} of {len(pool)} mutants never named before "
                 f"(seed {a.seed})\n\n")
        for n in names:
            diff = subprocess.run([sys.executable, "-m", "mutmut", "show", n], cwd=M.WORK / a.package,
                                  capture_output=True, text=True).stdout.strip()
            fh.write(f"## {n}\n```diff\n{diff}\n```\n\n")
    print(f"{a.out}: {a.count} of {len(pool)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
