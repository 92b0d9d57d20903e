"""The host emulation catches three GPU-only bugs, each planted in a copy of the decode source:

- a ``cp.async`` 2 bytes off 16-byte alignment (a fault on the device): caught in every mode;
- the end-of-tile ``__syncthreads()`` removed (the next tile's copies overwrite a ring stage other
  threads are still reading): the default emulation shows it only when the threads happen to
  interleave so; the strict mode (copies land at issue, a shadow of the ring checks the ordering)
  reports the race every time. Likewise the barrier after the wait, and the wait itself;
- "the block with the highest index is the last to finish" in place of the ticket counter that
  picks the block which describes the violation record: right when blocks run one after another in
  order, caught when several run at once in reverse order (``blocks_at_once``).

The plants are switched at run time by globals of the patched copy (one g++ build for all of them),
and the real sources run clean in the same modes (no false positives).
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TOL, make_cache, make_table, rand, rel_err

from kvservice.worker import kernel_api as api
from kvservice.worker import kernels_cpu, ops_numpy, reference
from kvservice.worker.kernels_cpu import CpuBackend, EmulationFault
from tests.ci import need_tool

PLANTS = {
    # (file, exact text in the real source, the planted text)
    "misalign": ("decode_attention.cu", "kv_cp_async16(dk + k * NT * 16u, src, full);",
                 "kv_cp_async16(dk + k * NT * 16u, (const char*)src + 2 * kv_plant_misalign, full);"),
    "no_end_barrier": ("decode_attention.cu", "    __syncthreads();  // stage `use` is free for tile t + STAGES",
                       "    if (!kv_plant_no_end_barrier) __syncthreads();"),
    "no_wait_barrier": ("decode_attention.cu", "    __syncthreads();                 // and everyone else's",
                        "    if (!kv_plant_no_wait_barrier) __syncthreads();"),
    "no_wait": ("decode_attention.cu",
                "    kv_cp_async_wait<STAGES - 1>();  // this thread's copies of tile t have landed",
                "    if (!kv_plant_no_wait) kv_cp_async_wait<STAGES - 1>();"),
    "last_by_index": ("paged.cuh", "    s_last = atomicAdd(&rec[6], 1ull) == total - 1;",
                      "    const bool ticket = atomicAdd(&rec[6], 1ull) == total - 1;\n"
                      "    s_last = kv_plant_last_by_index ? (blockIdx.x == gridDim.x - 1 &&"
                      " blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1) : ticket;"),
}
# Entries whose lane reads only the pieces it copied itself (one piece per lane per row: every
# head_dim up to 256 in 16-bit, up to 128 in float32) need neither barrier for the ring; the others
# (16-bit d512, float32 d256 and d512) read pieces other threads copied.
CROSS = [("float32", 512, 4), ("bfloat16", 512, 16), ("float32", 256, 5)]
GLOBALS = "".join(f'extern "C" __attribute__((visibility("default"))) int kv_plant_{n} = 0;\n' for n in PLANTS)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A g++ build of a patched copy of the sources (decode only) with every plant switched off."""
    need_tool("g++", "apt package g++; deploy/ci-install.sh installs it")
    d = tmp_path_factory.mktemp("planted")
    for p in kernels_cpu.KERNEL_DIR.iterdir():
        shutil.copy(p, d / p.name)
    for name, (fname, real, plant) in PLANTS.items():
        text = (d / fname).read_text()
        assert text.count(real) >= 1, f"plant {name}: {real!r} is no longer in {fname}; update the test"
        (d / fname).write_text(text.replace(real, plant))
    paged = d / "paged.cuh"
    text = paged.read_text()
    head = "#pragma once\n"
    paged.write_text(text.replace(head, head + GLOBALS, 1))
    return kernels_cpu.build("plain", kernel_dir=d, only=["decode_attention.cu"])


def plant(lib: ctypes.CDLL, **on: int) -> None:
    for name in PLANTS:
        ctypes.c_int.in_dll(lib, f"kv_plant_{name}").value = int(on.get(name, 0))


def case(dtype: str = "float16", head_dim: int = 128, page_size: int = 16, bad: bool = False):
    """Rows long enough to reuse every ring stage several times; optionally one page past the buffer."""
    rng = np.random.default_rng(25)
    c = make_cache(rng, "per_layer", 40, page_size, 2, head_dim, dtype)
    indptr, indices, lpl = make_table(rng, c, [150, 97, 33])
    if bad:
        indices[int(indptr[1]) + 2] = c.layout.upper_bound
    q = rand(rng, (3, 8, head_dim), dtype)
    return c, q, (indptr, indices, lpl)


def run(be: CpuBackend, c, q, table, **kw):
    return api.decode_attention(be, q, c.buf, c.layout, *table, kv_chunk_pages=0, **kw)


def check(res, c, q, table, dtype: str) -> None:
    out, lse = reference.decode_attention_ref(q, c.buf, c.raw, *table)
    good = ~np.isnan(lse).all(axis=1)
    assert rel_err(res.out[good], out[good]) <= TOL[dtype]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("dtype", "head_dim", "page_size"), [("float16", 128, 16), ("float16", 128, 5), *CROSS])
def test_real_sources_run_clean_in_every_mode(planted: Path, strict: bool, dtype: str, head_dim: int,
                                              page_size: int) -> None:
    be = CpuBackend("plain", strict=strict, blocks_at_once=1 if not strict else 3, lib=planted)
    plant(be.lib)
    c, q, table = case(dtype, head_dim, page_size)
    check(run(be, c, q, table), c, q, table, dtype)


@pytest.mark.parametrize("strict", [False, True])
def test_misaligned_cp_async_is_a_fault(planted: Path, strict: bool) -> None:
    be = CpuBackend("plain", strict=strict, lib=planted)
    plant(be.lib, misalign=1)
    c, q, table = case()
    with pytest.raises(EmulationFault, match=r"misaligned cp\.async .*16-byte aligned") as e:
        run(be, c, q, table)
    assert e.value.code == -4


@pytest.mark.parametrize(("dtype", "head_dim", "page_size"), CROSS)
def test_missing_end_of_tile_barrier_is_caught_by_the_strict_mode(planted: Path, dtype: str, head_dim: int,
                                                                  page_size: int) -> None:
    """(The default mode may or may not show this bug: it depends on how the threads interleave.)"""
    c, q, table = case(dtype, head_dim, page_size)
    strict = CpuBackend("plain", strict=True, lib=planted)
    plant(strict.lib, no_end_barrier=1)
    with pytest.raises(EmulationFault, match=r"overwrites .* read with no __syncthreads\(\)") as e:
        run(strict, c, q, table)
    assert e.value.code == -5
    plant(strict.lib)  # the same build with the barrier back: clean
    check(run(strict, c, q, table), c, q, table, dtype)


BEFORE_WAIT = r"before thread \d+'s cp\.async there was waited for"


@pytest.mark.parametrize(("bug", "message"), [
    # with the barrier after the wait gone, a thread reads a piece another thread copied either before
    # that thread's wait or after it with no barrier between: which one depends on how they interleave
    ("no_wait_barrier", rf"no __syncthreads\(\) after that thread's wait|{BEFORE_WAIT}"),
    ("no_wait", BEFORE_WAIT),
])
def test_missing_wait_or_its_barrier_is_caught_by_the_strict_mode(planted: Path, bug: str, message: str) -> None:
    be = CpuBackend("plain", strict=True, lib=planted)
    plant(be.lib, **{bug: 1})
    c, q, table = case(dtype="float32", head_dim=512, page_size=4)
    with pytest.raises(EmulationFault, match=message) as e:
        run(be, c, q, table)
    assert e.value.code == -5


def test_block_order_assumption_is_caught_by_concurrent_blocks(planted: Path) -> None:
    """The record of a bad table is described by the block that finishes last. Assuming that is the
    block of the highest index holds in order, not when blocks run at once in another order."""
    c, q, table = case(bad=True)
    want = ops_numpy.validate_page_table(*table, c.layout).record
    assert want.count == 1 and want.reason == "out_of_bounds"
    serial = CpuBackend("plain", lib=planted)
    plant(serial.lib, last_by_index=1)
    r = run(serial, c, q, table).record
    assert (r.count, r.row, r.position, r.value, r.reason) == (want.count, want.row, want.position, want.value,
                                                              want.reason)
    concurrent = CpuBackend("plain", blocks_at_once=4, lib=planted)
    r = run(concurrent, c, q, table).record
    assert r.count == 1 and (r.row, r.position, r.value, r.reason) != (want.row, want.position, want.value,
                                                                       want.reason)
    plant(concurrent.lib)  # the ticket counter back: right in any order
    r = run(concurrent, c, q, table).record
    assert (r.row, r.position, r.value, r.reason) == (want.row, want.position, want.value, want.reason)
