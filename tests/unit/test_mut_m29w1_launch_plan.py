"""kvservice.worker.launch_plan against the CUDA source and hand-computed plans: each decode entry's geometry
evaluated from decode_attention.cu's own ``KvDecGeom`` constexpr lines (not from the Python mirror), the split
planner's plans worked out by hand for the CPU backend's and a large device's slot counts, and a brute-force
search over every pages-per-split value for the planner's documented contract."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from kvservice.worker import launch_plan as lp

CU = Path(lp.__file__).resolve().parent / "kernels" / "decode_attention.cu"
PAGED = CU.parent / "paged.cuh"


def test_threads_and_vector_widths_are_the_sources():
    """THREADS is decode_attention.cu's KV_DEC_THREADS; VEC[dtype] is paged.cuh's KvElem<T>::VEC (16 bytes)."""
    assert int(re.search(r"#define KV_DEC_THREADS (\d+)", CU.read_text())[1]) == lp.THREADS
    vec = dict(re.findall(r"struct KvElem<(\w+)> \{\s*static constexpr int VEC = (\d+);", PAGED.read_text()))
    assert {"float32": int(vec["float"]), "float16": int(vec["kv_half"]), "bfloat16": int(vec["kv_bf16"])} == lp.VEC


def _kv_dec_geom(vec: int, d: int, gm: int) -> dict[str, int]:
    """Evaluate KvDecGeom's `static constexpr int NAME = EXPR;` lines (C ternaries as Python conditionals)."""
    body = CU.read_text().split("struct KvDecGeom {", 1)[1].split("};", 1)[0]
    env = {"NT": lp.THREADS, "VEC": vec, "D": d, "GM": gm}
    for name, expr in re.findall(r"static constexpr int (\w+) =\s*([^;]+);", body):
        if name in env:
            continue
        expr = " ".join(expr.split())
        while "?" in expr:          # innermost-right first: a ? b : c ? d : e
            expr = re.sub(r"([^?:]+)\?([^?:]+):([^?:]+)$", r"((\2) if (\1) else (\3))", expr, count=1)
        env[name] = int(eval(expr, {}, dict(env)))  # the repository's own C++ constants
    return env


def test_each_entrys_geometry_is_what_decode_attention_cu_computes():
    for entry in lp.decode_entries():
        m = re.fullmatch(r"kv_decode_(f32|f16|bf16)_g(\d+)_d(\d+)", entry)
        dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[m[1]]
        gm, d = int(m[2]), int(m[3])
        g = _kv_dec_geom(lp.VEC[dtype], d, gm)
        geo = lp.decode_geometry(dtype, gm, d)
        assert (geo.vec, geo.lanes, geo.lane_groups, geo.tile_tokens, geo.copies_per_thread, geo.stages) == \
            (g["VEC"], g["LG"], g["NR"], g["TT"], g["NCH"], g["STAGES"]), entry
        assert geo.tile_bytes == 2 * g["STAGE_PIECES"] * 16, entry   # K and V pieces of one stage
        assert geo.smem_bytes >= g["BUF_FLOATS"] * 4 + 2 * g["NR"] * gm * 4, entry


def test_decode_geometry_by_hand():
    """float16 d128: 16 pieces per row, 16 lanes, 8 lane groups, 2 rows each (16 tokens), 2 copies per thread, 3
    stages; float32 d512: 128 pieces, 32 lanes x 4, 4 groups, 1 row each, 4 copies, 2 stages."""
    g = lp.decode_geometry("float16", 4, 128)
    assert (g.vec, g.lanes, g.lane_groups, g.tile_tokens, g.copies_per_thread, g.stages) == (8, 16, 8, 16, 2, 3)
    assert g.tile_bytes == 2 * 128 * 2 * 16
    # ring 3 x 2 x 16 x 16 x 4 floats (> 8 x 4 x 128 merge), + max/sum 2 x 4 x 8 x 4, + s_bad 4 -> 24836,
    # 8-aligned 24840, + s_ctx 32, + s_last 4
    assert g.smem_bytes == 24876
    g = lp.decode_geometry("float32", 1, 512)
    assert (g.vec, g.lanes, g.lane_groups, g.tile_tokens, g.copies_per_thread, g.stages) == (4, 32, 4, 4, 4, 2)
    g = lp.decode_geometry("bfloat16", 8, 32)
    assert (g.vec, g.lanes, g.lane_groups, g.tile_tokens, g.copies_per_thread, g.stages) == (8, 4, 32, 64, 2, 3)


def test_heads_per_block_and_entry_names():
    assert [lp.heads_per_block(g, 64) for g in (1, 2, 3, 4, 5, 7, 8, 12, 16)] == [1, 4, 4, 4, 8, 8, 8, 8, 8]
    assert [lp.heads_per_block(g, 512) for g in (1, 2, 4, 5, 8, 16)] == [1, 4, 4, 4, 4, 4]
    assert [lp.heads_per_block(g, 256) for g in (8, 9)] == [8, 8]
    assert lp.decode_entry("float16", 6, 128) == "kv_decode_f16_g8_d128"
    assert lp.decode_entry("bfloat16", 1, 32) == "kv_decode_bf16_g1_d32"
    assert lp.decode_entry("float32", 16, 512) == "kv_decode_f32_g4_d512"
    assert len(lp.decode_entries()) == 42 and len(set(lp.decode_entries())) == 42
    assert set(lp.kernel_names()) == set(lp.decode_entries()) | set(lp.OTHER_KERNELS)


def _busy(n: int, slots: int) -> float:
    return n / (math.ceil(n / slots) * slots)


@pytest.mark.parametrize(("blocks", "max_pages", "slots", "want"), [
    (1, 40, 8, 5),        # 8 splits of 5 pages fill 8 slots; 2..7 splits leave >= 1/8 idle
    (3, 40, 8, 8),        # 3 x 5 splits of 8 pages: 15 of 16 slots (2 x 3 = 6 of 8 was 0.75)
    (3, 8, 8, 4),         # target out of reach: 2 splits of 4 pages (0.75 > 0.375) is the best found
    (5, 8, 8, 0),         # 2 splits: 10 of 16 = 0.625, no better than 5 of 8 unsplit
    (8, 100, 8, 0),       # already full
    (1, 7, 8, 0),         # fewer than 2 x 4 pages: never split
    (0, 40, 8, 0), (1, 40, 0, 0), (-1, 40, 8, 0),
    (1, 5120, 4096, 5),   # capped at 1024 splits: 5 pages each, 1024 of 4096 slots (1023 splits would need 6)
    (264, 64, 264, 0),    # 132 SMs x 2: one wave already full
    (100, 64, 264, 13),   # 5 splits of 13 pages: 500 of 2 x 264 slots = 0.947; 2 to 4 splits stay under 0.9
])
def test_default_splits_by_hand(blocks: int, max_pages: int, slots: int, want: int):
    assert lp.default_splits(blocks, max_pages, slots) == want


def test_default_splits_keeps_its_contract_against_a_brute_force_search():
    """For every case: 0 (no split), or a pages-per-split of >= MIN_SPLIT_PAGES with at least 2 splits that keeps
    more of the slots busy than no split; when some split count of the searched range reaches SPLIT_TARGET, the
    result is the fewest such splits; else none of the searched range does strictly better."""
    for slots in (1, 3, 8, 20, 264):
        for blocks in range(1, 2 * slots + 2, max(1, slots // 7)):
            for max_pages in range(0, 70):
                pps = lp.default_splits(blocks, max_pages, slots)
                base = _busy(blocks, slots)
                if max_pages < 2 * lp.MIN_SPLIT_PAGES or base >= lp.SPLIT_TARGET:
                    assert pps == 0, (blocks, max_pages, slots)
                    continue
                top = min(max_pages // lp.MIN_SPLIT_PAGES, 2 * math.ceil(slots / blocks) + 2, 1024)
                cands = [math.ceil(max_pages / w) for w in range(2, top + 1)]
                effs = {p: _busy(blocks * math.ceil(max_pages / p), slots) for p in cands}
                hit = [p for p in cands if effs[p] >= lp.SPLIT_TARGET]
                if hit:
                    assert pps == hit[0], (blocks, max_pages, slots)
                    continue
                best = max([base, *effs.values()])
                if best <= base + 1e-12:
                    assert pps == 0, (blocks, max_pages, slots)
                else:
                    assert pps >= lp.MIN_SPLIT_PAGES and math.ceil(max_pages / pps) >= 2
                    assert effs[pps] == best and pps == next(p for p in cands if effs[p] == best)
