"""Shared helpers for the kernel tests (CPU-emulated CUDA and NumPy paths)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # 128-thread teams on 2 cores

from kvservice.worker import kernels_cpu, ops_numpy  # noqa: E402
from kvservice.worker.kernel_api import DTYPES, PageLayout  # noqa: E402
from kvservice.worker.reference import TOLERANCE as TOL  # noqa: E402, F401  (per-row relative, see row_rel_err)
from kvservice.worker.reference import RawLayer, row_rel_err  # noqa: E402

BACKENDS = {"emu": kernels_cpu, "numpy": ops_numpy}
POISON = np.float32(12345.0)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: heavy sweep, not needed for a green run")


@pytest.fixture(params=sorted(BACKENDS))
def ops(request: pytest.FixtureRequest):
    return BACKENDS[request.param]


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random non-zero values in the storage dtype (bfloat16 as uint16 bits)."""
    x = rng.uniform(0.1, 1.0, shape).astype(np.float32) * rng.choice([-1.0, 1.0], shape).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(DTYPES[dtype])


@dataclass
class Cache:
    buf: np.ndarray  # the array the kernels get (layer buffer or group buffer)
    layout: PageLayout
    num_slots: int
    raw: RawLayer    # the same pages for the float64 oracle, by raw byte offsets


def make_cache(rng: np.random.Generator, kind: str, num_slots: int, page_size: int, kv_heads: int,
               head_dim: int, dtype: str, base: int = 0) -> Cache:
    """per_layer: [slots, 2, ps, kh, d]. interleaved: a group buffer whose slot
    holds another layer's page (2 x this page) first, then this layer's page,
    then padding -> this layer has scale 4, offset 2. ``base``: first page index of
    the layer's index space (a later space of a pool numbers its pages from there;
    the pool then ends 50 pages after this space)."""
    scale = 1 if kind == "per_layer" else 4
    pool = {"base": base, "pool_pages": base + num_slots * scale + 50 if base else 0}
    if kind == "per_layer":
        layout = PageLayout.per_layer(num_slots, page_size, kv_heads, head_dim, dtype, **pool)
        buf = rand(rng, (num_slots, 2, page_size, kv_heads, head_dim), dtype)
        return Cache(buf, layout, num_slots, RawLayer.per_layer(num_slots, page_size, kv_heads, head_dim, dtype,
                                                                base))
    pe = 2 * page_size * kv_heads * head_dim
    pb = pe * np.dtype(DTYPES[dtype]).itemsize
    layout = PageLayout.interleaved(num_slots, 4 * pb, 2 * pb, page_size, kv_heads, head_dim, dtype, **pool)
    buf = rand(rng, (num_slots * 4 * pe,), dtype)
    return Cache(buf, layout, num_slots,
                 RawLayer.interleaved(num_slots, 4 * pb, 2 * pb, page_size, kv_heads, head_dim, dtype, base))


def make_table(rng: np.random.Generator, cache: Cache, seq_lens: list[int]) -> tuple[np.ndarray, ...]:
    """CSR table over distinct random slots, converted to the layer's page indices."""
    ps = cache.layout.page_size
    pages = [-(-n // ps) for n in seq_lens]
    slots = rng.permutation(cache.num_slots)[: sum(pages)]
    indices = np.asarray(cache.layout.page_index(slots), dtype=np.int32)
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    lpl = np.array([n - ps * (p - 1) if p else 1 for n, p in zip(seq_lens, pages, strict=True)], dtype=np.int32)
    return indptr, indices, lpl


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """Largest per-row relative error (kvservice.worker.reference.row_rel_err)."""
    return row_rel_err(a, ref)


def lse_err(a: np.ndarray, ref: np.ndarray) -> float:
    """Largest per-row lse error relative to max(|lse|, 1)."""
    return row_rel_err(a, ref, floor=1.0)


def poisoned(shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, POISON, dtype=np.float32)
