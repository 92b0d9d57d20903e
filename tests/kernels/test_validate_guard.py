"""validate_page_table (same record as decode) and guard zones."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_cache, make_table, rand
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.worker import guards, kernels_cpu, ops_numpy
from kvservice.worker import kernel_api as api


def test_validate_reports_rows(ops) -> None:
    rng = np.random.default_rng(30)
    c = make_cache(rng, "interleaved", 16, 4, 1, 64, "float16")
    indptr, indices, lpl = make_table(rng, c, [5, 9, 4, 3])
    indices[indptr[1]] = c.layout.upper_bound
    indices[indptr[1] + 1] = c.layout.offset + 1
    lpl[3] = 9
    res = ops.validate_page_table(indptr, indices, lpl, c.layout)
    assert list(np.asarray(res.row_status)) == [0, 0b11, 0, 0b100]
    r = res.record
    assert (r.count, r.row, r.position, r.value, r.reason) == (3, 1, int(indptr[1]), c.layout.upper_bound,
                                                              "out_of_bounds")


@st.composite
def broken_tables(draw: st.DrawFn) -> tuple:
    seed = draw(st.integers(0, 2**31))
    lens = draw(st.lists(st.integers(0, 14), min_size=1, max_size=5))
    edits = draw(st.lists(st.tuples(st.sampled_from(["idx", "lpl", "ptr"]), st.integers(0, 99),
                                    st.integers(-3, 70)), max_size=4))
    return seed, lens, edits


@settings(max_examples=25, deadline=None)
@given(broken_tables(), st.sampled_from(["per_layer", "interleaved"]), st.sampled_from([0, 1]))
def test_records_agree_everywhere(case: tuple, kind: str, split: int) -> None:
    """Emulated decode, emulated validate, NumPy decode and NumPy validate
    give the same exact record, and the same rows are poisoned."""
    seed, lens, edits = case
    rng = np.random.default_rng(seed)
    c = make_cache(rng, kind, 16, 4, 1, 32, "float32")
    indptr, indices, lpl = make_table(rng, c, lens)
    for what, at, val in edits:
        arr = {"idx": indices, "lpl": lpl, "ptr": indptr}[what]
        if arr.size:
            arr[at % arr.size] = val
    q = rand(rng, (len(lens), 2, 32), "float32")
    recs, nan_rows = [], []
    for ops in (kernels_cpu, ops_numpy):
        recs.append(ops.validate_page_table(indptr, indices, lpl, c.layout).record)
        res = ops.decode_attention(q, c.buf, c.layout, indptr, indices, lpl, kv_chunk_pages=split)
        recs.append(res.record)
        nan_rows.append(np.isnan(res.lse).all(axis=1))
    key = [(r.count, r.row, r.position, r.value, r.reason) for r in recs]
    assert key.count(key[0]) == 4, key
    assert np.array_equal(nan_rows[0], nan_rows[1])


def guarded(total: int, guard: int) -> np.ndarray:
    return np.zeros(total + 2 * guard, dtype=np.uint8)


def test_guard_fill_and_check(ops) -> None:
    buf = guarded(4096, 64)
    ops.guard_fill(buf, 64)
    assert np.array_equal(buf[:64], guards.guard_pattern(64)) and np.array_equal(buf[-64:], guards.guard_pattern(64))
    assert not ops.guard_check(buf, 64)
    buf[64 + 4096 + 10] ^= 0xFF
    buf[-1] ^= 1
    buf[5] = buf[5] + 1
    rep = ops.guard_check(buf, 64)
    assert (rep.corrupted_bytes, rep.first_offset) == (3, 5)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.guard_check(buf, 10)


def test_guard_names_the_first_corrupted_byte_of_the_back_zone(ops) -> None:
    """With the front zone intact, first_offset is the buffer offset of the back zone's first changed byte
    (n - guard + its index there), and a changed payload byte is never counted."""
    rng = np.random.default_rng(32)
    buf = guarded(4096, 64)
    ops.guard_fill(buf, 64)
    buf[64:64 + 4096] = rng.integers(1, 256, 4096, dtype=np.uint8)      # the payload is not guarded
    at = np.sort(rng.choice(np.arange(1, 64), 3, replace=False))
    buf[buf.shape[0] - 64 + at] ^= rng.integers(1, 256, 3, dtype=np.uint8)
    rep = ops.guard_check(buf, 64)
    assert (rep.corrupted_bytes, rep.first_offset) == (3, 64 + 4096 + int(at[0]))


def test_guard_catches_stray_write_of_unchecked_kernel() -> None:
    """With bounds checks compiled out, an append one page past the end lands in
    the back guard zone, and guard_check names the offset."""
    rng = np.random.default_rng(31)
    layout = api.PageLayout.per_layer(4, 4, 1, 32, "float32")
    pb = layout.page_elems * 4
    buf = guarded(4 * pb, 2 * pb)  # the whole stray page lands inside the back guard
    kernels_cpu.guard_fill(buf, 2 * pb)
    cache = guards.guarded_view(buf, 2 * pb, np.float32)
    k = rand(rng, (1, 1, 32), "float32")
    sm = np.array([4 * 4], dtype=np.int64)  # page 4 == upper_bound
    assert kernels_cpu.append_kv(cache, layout, k, k, sm).record.count == 1
    assert not kernels_cpu.guard_check(buf, 2 * pb)
    api.append_kv(kernels_cpu.backend("nocheck"), cache, layout, k, k, sm)
    rep = kernels_cpu.guard_check(buf, 2 * pb)
    assert rep.corrupted_bytes > 0 and rep.first_offset == 2 * pb + 4 * pb
    # both variants loaded in one process stay separate libraries
    assert kernels_cpu.append_kv(cache, layout, k, k, sm).record.count == 1


def test_a_cold_build_compiles_the_named_sources_into_a_library_of_their_kernels(tmp_path, monkeypatch) -> None:
    """build() with an empty build directory runs g++ on the sources named (guard.cu only): the library it
    writes holds guard.cu's kernels and no other, and they fill the canary of guards.guard_pattern. A second
    build of the same sources and flags reuses the file."""
    from tests.ci import need_tool

    need_tool("g++", "apt package g++; deploy/ci-install.sh installs it")
    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path)
    lib = kernels_cpu.build("plain", only=["guard.cu"])
    assert lib.name == "libkvk.so" and lib.parent.parent == tmp_path and lib.parent.name.startswith("plain-")
    assert [p.name for p in lib.parent.iterdir()] == ["libkvk.so"]            # no temporary file left
    be = kernels_cpu.CpuBackend(lib=lib)
    assert be.signature("kv_guard_fill") and be.signature("kv_guard_check")
    with pytest.raises(KeyError, match="no kernel named 'kv_copy_blocks'"):
        be.signature("kv_copy_blocks")
    buf = np.random.default_rng(16).integers(1, 256, 4096 + 2 * 64, dtype=np.uint8)
    payload = buf[64:-64].copy()
    guards.guard_fill(be, buf, 64)
    want = guards.guard_pattern(64)
    assert np.array_equal(buf[:64], want) and np.array_equal(buf[-64:], want)
    assert np.array_equal(buf[64:-64], payload) and not guards.guard_check(be, buf, 64)
    stamp = lib.stat().st_mtime_ns
    assert kernels_cpu.build("plain", only=["guard.cu"]) == lib and lib.stat().st_mtime_ns == stamp
