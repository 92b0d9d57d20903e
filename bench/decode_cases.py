"""The decode sweep of issue #15 as data, shared by tests/kernels (CPU emulation,
under ASan) and bench/gpu_check.py (on a GPU): every cache dtype x head_dim in
{32, 64, 128, 256, 512} x GQA group in {1, 2, 3, 4, 8, 16}, each combination
with one of six variants that rotate page size (1 to 16, powers of two and
not), layout (per_layer / interleaved), sliding window, split-KV (none, fixed,
automatic), policy (NaN / zeros / error), a page one past the end of the
buffer and an empty row.

``make_inputs`` builds a case from its seed (random non-zero data),
``run_case`` runs the kernel through any compiled backend, ``check_case``
compares with the float64 torch reference (``kvservice.worker.reference``) and the
NumPy validator's record. Only numpy and ``worker`` are imported at module
level (torch lazily in ``check_case``), so a sanitized subprocess can run
cases without torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvservice.worker import kernel_api as api
from kvservice.worker.kernel_api import KernelViolationError, PageLayout, Policy
from kvservice.worker.page_layout import ITEMSIZE

DTYPES = ("float32", "float16", "bfloat16")

#: The GPU timing shapes of bench/gpu_check.py (batch, context, q heads, kv heads, head_dim): float16,
#: TIMING_PAGE_SIZE tokens per page, every row full pages; q and the cache uniform in TIMING_RANGE.
#: scripts/sass_budget.py models the decode tile loop at these shapes.
TIMING_SHAPES = ((64, 4096, 32, 8, 128), (64, 4096, 64, 8, 128), (4, 16384, 32, 8, 128), (64, 4096, 32, 8, 64))
TIMING_PAGE_SIZE = 16
TIMING_RANGE = (0.1, 1.0)
HEAD_DIMS = (32, 64, 128, 256, 512)
GROUPS = (1, 2, 3, 4, 8, 16)


@dataclass(frozen=True)
class Variant:
    page_size: int  # tokens per page
    kind: str  # "per_layer" or "interleaved" (scale 4, offset 2)
    window: int  # sliding window in tokens, 0 = all
    split: int | None  # kv_chunk_pages: 0 never, None automatic
    policy: Policy
    bad: bool  # row 1 holds a page one past the end of the buffer
    empty: bool  # row 2 has no pages


VARIANTS = (
    Variant(16, "per_layer", 0, None, Policy.NAN, True, False),
    Variant(5, "interleaved", 7, 2, Policy.ZEROS, True, True),
    Variant(4, "per_layer", 0, 0, Policy.ERROR, True, False),
    Variant(3, "interleaved", 0, 1, Policy.NAN, False, True),
    Variant(8, "per_layer", 20, 3, Policy.NAN, False, False),
    Variant(1, "per_layer", 0, 0, Policy.ZEROS, False, False),
)


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    group: int  # q heads per kv head
    variant: Variant
    seed: int

    @property
    def kv_heads(self) -> int:
        return 2 if self.group <= 8 else 1

    @property
    def name(self) -> str:
        v = self.variant
        split = "auto" if v.split is None else str(v.split)
        return (f"{self.dtype}-d{self.head_dim}-g{self.group}-ps{v.page_size}-{v.kind}-w{v.window}-s{split}-"
                f"{v.policy.name.lower()}{'-bad' if v.bad else ''}{'-empty' if v.empty else ''}")


def cases(full: bool = False) -> list[Case]:
    """``full``: all 90 (dtype, head_dim, group) combinations, each with two
    variants (180 cases). Otherwise six cases that still cover every dtype,
    head_dim, group and variant once or more (the default test run)."""
    if full:
        combos = list(itertools.product(DTYPES, HEAD_DIMS, GROUPS))
        return [Case(dt, d, g, VARIANTS[(i + k) % len(VARIANTS)], 1000 + 2 * i + k // 3)
                for i, (dt, d, g) in enumerate(combos) for k in (0, 3)]
    return [Case(DTYPES[i % 3], HEAD_DIMS[i % 5], GROUPS[i % 6], VARIANTS[i % 6], 100 + i) for i in range(6)]


@dataclass
class Inputs:
    q: np.ndarray  # [batch, q_heads, head_dim], cache storage dtype
    cache: np.ndarray  # flat layer (or group) buffer, storage dtype
    layout: PageLayout
    raw: Any  # kvservice.worker.reference.RawLayer: the same pages by raw byte offsets (the oracle's addressing)
    indptr: np.ndarray  # int32 [batch + 1]
    indices: np.ndarray  # int32 [nnz]
    last_page_len: np.ndarray  # int32 [batch]
    bad_position: int  # index into indices of the bad entry, -1 if none


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random non-zero values in the storage dtype (bfloat16 as uint16 bits)."""
    x = rng.uniform(0.1, 1.0, shape).astype(np.float32) * rng.choice([-1.0, 1.0], shape).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(api.DTYPES[dtype])


def make_inputs(case: Case) -> Inputs:
    rng = np.random.default_rng(case.seed)
    v, d, kh = case.variant, case.head_dim, case.kv_heads
    lens = [int(rng.integers(30, 70)), 61, 0 if v.empty else 12, 5]
    ps = v.page_size
    pages = [-(-n // ps) for n in lens]
    num_slots = sum(pages) + 3
    pe = 2 * ps * kh * d
    from kvservice.worker.reference import RawLayer

    if v.kind == "per_layer":
        layout = PageLayout.per_layer(num_slots, ps, kh, d, case.dtype)
        raw = RawLayer.per_layer(num_slots, ps, kh, d, case.dtype)
        cache = rand(rng, (num_slots * pe,), case.dtype)
    else:
        pb = pe * ITEMSIZE[case.dtype]
        layout = PageLayout.interleaved(num_slots, 4 * pb, 2 * pb, ps, kh, d, case.dtype)
        raw = RawLayer.interleaved(num_slots, 4 * pb, 2 * pb, ps, kh, d, case.dtype)
        cache = rand(rng, (num_slots * 4 * pe,), case.dtype)
    slots = rng.permutation(num_slots)[: sum(pages)]
    indices = np.asarray(layout.page_index(slots), dtype=np.int32)
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    lpl = np.array([n - ps * (p - 1) if p else 1 for n, p in zip(lens, pages, strict=True)], dtype=np.int32)
    bad = -1
    if v.bad:
        bad = int(indptr[1]) + pages[1] // 2
        indices[bad] = layout.upper_bound  # one page past the end of the buffer
    q = rand(rng, (len(lens), case.group * kh, d), case.dtype)
    return Inputs(q, cache, layout, raw, indptr, indices, lpl, bad)


@dataclass
class Result:
    out: np.ndarray  # float32 [batch, q_heads, head_dim]
    lse: np.ndarray  # float32 [batch, q_heads]
    record: tuple  # (count, row, position, value, reason)
    error: str | None  # KernelViolationError text (Policy.ERROR), else None


def run_case(be: Any, case: Case, inp: Inputs) -> Result:
    """Run one case on backend ``be`` (kernels_cpu / kernels_cuda backend object)."""
    xp = be.xp
    b, hq, d = inp.q.shape
    out = xp.asarray(np.full((b, hq, d), 12345.0, dtype=np.float32))  # poisoned: every element must be written
    lse = xp.asarray(np.full((b, hq), 12345.0, dtype=np.float32))
    dev = [xp.asarray(a) for a in (inp.q, inp.cache, inp.indptr, inp.indices, inp.last_page_len)]
    v = case.variant
    error = None
    try:
        res = api.decode_attention(be, dev[0], dev[1], inp.layout, *dev[2:], window=v.window, policy=v.policy,
                                   kv_chunk_pages=v.split, out=out, lse=lse)
        r = res.record
    except KernelViolationError as e:
        error, r = str(e), e.record
    rec = (r.count, r.row, r.position, r.value, r.reason)
    return Result(be.to_host(out), be.to_host(lse), rec, error)


def check_case(case: Case, inp: Inputs, got: Result) -> list[str]:
    """What is wrong with ``got`` (empty list: the case passed)."""
    from kvservice.worker import ops_numpy, reference

    v = case.variant
    problems: list[str] = []
    ref_o, ref_l = reference.decode_attention_ref(inp.q, inp.cache, inp.raw, inp.indptr, inp.indices,
                                                  inp.last_page_len, window=v.window)
    want = ops_numpy.validate_page_table(inp.indptr, inp.indices, inp.last_page_len, inp.layout).record
    want_rec = (want.count, want.row, want.position, want.value, want.reason)
    if tuple(got.record) != want_rec:
        problems.append(f"record {got.record} != {want_rec}")
    if v.bad and want.position != inp.bad_position:
        problems.append(f"validator found position {want.position}, case put the bad page at {inp.bad_position}")
    if (got.error is not None) != (v.policy == Policy.ERROR and want.count > 0):
        problems.append(f"error raised: {got.error!r} under policy {v.policy.name}")
    bad_rows = np.isnan(ref_l).all(axis=1)
    for r in np.flatnonzero(bad_rows):
        if v.policy == Policy.ZEROS:
            ok = (got.out[r] == 0).all() and np.isneginf(got.lse[r]).all()
        else:
            ok = np.isnan(got.out[r]).all() and np.isnan(got.lse[r]).all()
        if not ok:
            problems.append(f"row {r}: not poisoned per {v.policy.name}")
    good = ~bad_rows
    if good.any():
        tol = reference.TOLERANCE[case.dtype]       # per row, relative: the reference sees the same inputs
        err = reference.row_rel_err(got.out[good], ref_o[good])
        if not err <= tol:  # also catches NaN
            problems.append(f"rel err {err:.3g} > {tol:g}")
        lerr = reference.row_rel_err(got.lse[good], ref_l[good], floor=1.0)
        if not lerr <= tol:
            problems.append(f"lse err {lerr:.3g} > {tol:g} (an empty row's lse must be -inf)")
    return problems


def max_pages(inp: Inputs) -> int:
    return int(max(0, np.diff(inp.indptr.astype(np.int64)).max()))


def blocks(case: Case, inp: Inputs) -> int:
    """Decode blocks without a split (for sizing)."""
    gm = api.heads_per_block(case.group, case.head_dim)
    return inp.q.shape[0] * case.kv_heads * math.ceil(case.group / gm)
