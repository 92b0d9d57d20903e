"""`make mutation` covers every module: each kvservice source file is mutated by exactly one package's mutmut run
(pyproject's [tool.kvservice.mutation.packages]) or left out by name ([tool.mutmut] do_not_mutate), and each
package's test selection names files that exist. A module added later without a package would otherwise be
silently left out of the check."""

from __future__ import annotations

import importlib.util
import random
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation)

TOOL = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
PACKAGES = TOOL["kvservice"]["mutation"]["packages"]
SKIP = TOOL["mutmut"]["do_not_mutate"]
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvservice").rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES)
def test_every_module_is_mutated_by_one_package_or_left_out_by_name(path):
    runs = [pkg for pkg, conf in PACKAGES.items() if any(fnmatch(path, g) for g in conf["only_mutate"])]
    left_out = any(fnmatch(path, g) for g in SKIP)
    assert left_out or len(runs) == 1, f"{path}: mutated by {runs or 'no package'}; add it to one package's " \
                                       "only_mutate in pyproject's [tool.kvservice.mutation.packages]"
    if not left_out:      # the script maps a mutant's module to the same package (plain string rule, not the glob)
        name = path[:-3].replace("/", ".") + ".x_f__mutmut_1"
        assert mutation._package_of(name) == runs[0] == path.split("/")[1]


def test_the_left_out_are_stubs_glue_examples_markers_and_the_gpu_driver():
    left = sorted(p for p in SOURCES if any(fnmatch(p, g) for g in SKIP))
    kinds = {"v1", "examples", "tools"}
    unexpected = [p for p in left if p.split("/")[1] not in kinds and not p.endswith("__init__.py")]
    assert sorted(unexpected) == ["kvservice/contract/cli.py", "kvservice/server/app.py", "kvservice/server/cli.py",
                                  "kvservice/worker/cli.py", "kvservice/worker/kernels_cuda.py"]


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_each_selection_names_existing_test_files(pkg):
    tests = PACKAGES[pkg]["pytest_add_cli_args_test_selection"]
    assert tests, pkg
    assert [t for t in tests if not (ROOT / t).is_file()] == []
    # The planted-bug test reads the unmutated source text: in mutmut's copy it fails before any mutant runs.
    assert "tests/unit/test_planted_mutants.py" not in tests


def test_the_sample_is_spread_by_mutant_count():
    rng = random.Random(7)
    for _ in range(50):
        counts = {f"m{i}": rng.randint(1, 2000) for i in range(rng.randint(1, 30))}
        per = rng.randint(1, 12)
        got = mutation._allocate(counts, per)
        assert set(got) == set(counts)
        assert all(1 <= got[m] <= counts[m] for m in counts)
        # Before the caps: per * modules in all, each within one of its exact proportional share (or raised to 1).
        total = per * len(counts)
        n = sum(counts.values())
        for m, c in counts.items():
            share = total * c / n
            assert got[m] == counts[m] or got[m] == 1 or abs(got[m] - share) < 1, (m, c, share, got[m])
        if all(c >= total for c in counts.values()) and all(total * c / n >= 1 for c in counts.values()):
            assert sum(got.values()) == total
