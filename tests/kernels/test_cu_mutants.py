"""Every hand-made .cu mutant of scripts/mutation.py (CU_MUTANTS) still applies: its text occurs exactly once
in the kernel source it names. A kernel edit that moves the text would otherwise only show as "not applied"
the next time `make mutation` runs, and the bug the mutant stands for would go unguarded meanwhile."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation)


@pytest.mark.parametrize(("fname", "find", "what"), [(f, find, what) for f, find, _, what in mutation.CU_MUTANTS],
                         ids=[what for *_, what in mutation.CU_MUTANTS])
def test_cu_mutant_applies(fname: str, find: str, what: str) -> None:
    src = (ROOT / "kvservice" / "worker" / "kernels" / fname).read_text()
    assert src.count(find) == 1, f"{fname}: the text of mutant {what!r} occurs {src.count(find)} times; update it"
