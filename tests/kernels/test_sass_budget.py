"""The SASS budget of the decode tile loop (scripts/sass_budget.py) in CI: every decode entry's
steady-state tile, with and without a stand-in per-page check, within its budget; no spill, no stack;
and docs/KERNELS.md's budget table is the script's output (for the nvcc it names). The path analysis
itself is checked on a hand-made control-flow graph. nvcc and cuobjdump come from the toolkit or the
`nvcc`/`sass` extras (deploy/ci-install.sh); the cubins are cached by source hash under build/sass."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from kvservice.worker import kernel_api
from tests.ci import missing

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "scripts" / "sass_budget.py")
sb = importlib.util.module_from_spec(spec)
sys.modules["sass_budget"] = sb  # dataclasses look their module up
spec.loader.exec_module(sb)

# A loop: head, a forward branch around a 3-instruction block, a second path, back edge.
LOOP = """
        Function : kv_decode_f16_g4_d128
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/               @P0 BRA 0x70 ;
        /*0040*/                   FMUL R3, R3, R4 ;
        /*0050*/                   FMUL R5, R5, R4 ;
        /*0060*/                   FMUL R6, R6, R4 ;
        /*0070*/                   FFMA R7, R7, R8, R9 ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_paths_of_a_hand_made_loop() -> None:
    (ins,) = sb.functions(LOOP).values()
    (lp,) = sb.tile_loops(ins)
    assert (lp.head, lp.tail) == (0x10, 0x80)
    assert (lp.static, lp.longest, lp.shortest) == (8, 8, 5)  # the FMUL block is skipped on the short path
    assert lp.mix == {"cp.async": 1, "barrier": 1, "control": 2, "fp32": 4}
    assert not lp.calls and not lp.inner_loops


def test_occupancy_formula_matches_test_nvcc() -> None:
    # cuobjdump's SHARED includes the 1 KB reserved per block
    assert sb.blocks_per_sm(128, 24840 + 1024) == 4
    assert sb.blocks_per_sm(80, 24648 + 1024) == 6
    assert sb.blocks_per_sm(255, 34312) == 2


def _rows() -> list[dict]:
    for tool in ("nvcc", "cuobjdump"):
        if sb.find_tool(tool) is None:
            missing(tool, "CUDA toolkit on PATH, or pip install -e '.[nvcc]' (deploy/ci-install.sh)")
    return sb.report()


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return _rows()


@pytest.mark.timeout(3600)  # three cold nvcc builds of decode_attention.cu on 2 cores
def test_every_decode_entry_within_budget(rows: list[dict]) -> None:
    assert sorted(r["entry"] for r in rows) == kernel_api.decode_entries()
    assert not sb.problems(rows), sb.problems(rows)
    by = {r["entry"]: r for r in rows}
    # the figures: f16_g4_d128 <= 420 (from ~649), the 8-heads entries <= 650 (from ~1,012),
    # both with room for a per-page check in the loop
    assert by["kv_decode_f16_g4_d128"]["probe"]["per_8k"] <= 420
    assert all(r["probe"]["per_8k"] <= 650 for r in rows if r["heads"] == 8)
    # one-page and per-copy loops both exist (page_size a multiple of the tile, or not)
    assert all(len(r["steady"]["loops"]) == 2 for r in rows)


def test_docs_table_is_the_scripts_output(rows: list[dict]) -> None:
    """docs/KERNELS.md holds the table the script prints, for the nvcc version it names; with another
    nvcc the counts may differ and only the budgets (above) apply."""
    doc = (ROOT / "docs" / "KERNELS.md").read_text()
    m = re.search(r"SASS budget table \(nvcc ([^)]+)\)", doc)
    assert m, "docs/KERNELS.md must name the nvcc of its SASS budget table"
    version = sb._nvcc_version(sb.find_tool("nvcc"))
    if m.group(1) not in version:
        pytest.skip(f"docs table is for nvcc {m.group(1)}, this is {version}")
    table = sb.markdown(rows).strip().splitlines()
    for line in table:
        assert line in doc, f"docs/KERNELS.md's SASS budget table is stale; run scripts/sass_budget.py:\n{line}"
