"""NumPy implementation of every kernel, same semantics and the same violation
records as kvservice/worker/kernels/*.cu (for CPU workers). Same API as kernels_cpu."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvservice.contract.pagetable import BAD_INDPTR, STALE_PAGE, TableViolations, table_violations
from kvservice.worker import cancel, guards
from kvservice.worker import kernel_api as api
from kvservice.worker.guards import GuardReport
from kvservice.worker.kernel_api import (
    DTYPES,
    KernelCall,
    PageLayout,
    Policy,
    ValidationResult,
    ViolationRecord,
)


def _record(kernel: str, found: TableViolations) -> ViolationRecord:
    """The violation record of a call from all its violations, ordered by (row, position)."""
    if not len(found):
        return ViolationRecord(kernel)
    return ViolationRecord(kernel, len(found), int(found.rows[0]), int(found.positions[0]), int(found.values[0]),
                           api.REASONS[int(found.codes[0])])


def _call(kernel: str, found: TableViolations, policy: Policy, call: KernelCall | None = None) -> KernelCall:
    call = KernelCall(kernel, None, np.asarray) if call is None else call
    call._record = _record(kernel, found)
    call.raise_if(policy)
    return call


def _entries(rows: np.ndarray, positions: np.ndarray, values: np.ndarray, codes: np.ndarray) -> TableViolations:
    """Violations of append / copy (one per offending entry), ordered by (row, position)."""
    order = np.lexsort((positions, rows))
    return TableViolations(*(np.asarray(x, dtype=np.int64)[order] for x in (rows, positions, values, codes)))


def _to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


#: paged.cuh KV_GEN_AHEAD: how far (in allocations of its slot) a write's generation may be ahead of the page's.
GEN_AHEAD = 65536


def _newer(g: np.ndarray, r: np.ndarray) -> np.ndarray:
    """paged.cuh kv_gen_newer: r == 0 (never written), or g 1..GEN_AHEAD ahead of r (uint32, wrapping)."""
    return (r == 0) | ((g.astype(np.uint32) - r.astype(np.uint32) - np.uint32(1)) < np.uint32(GEN_AHEAD))


def _merge(a: TableViolations, rows: np.ndarray, positions: np.ndarray, values: np.ndarray,
           code: int) -> TableViolations:
    """a plus entries of one reason, ordered by (row, position)."""
    if not len(rows):
        return a
    return _entries(np.concatenate((a.rows, rows)), np.concatenate((a.positions, positions)),
                    np.concatenate((a.values, values)),
                    np.concatenate((a.codes, np.full(len(rows), code, dtype=np.int64))))


def stale_entries(found: TableViolations, indptr: np.ndarray, indices: np.ndarray, layout: PageLayout,
                  generations: np.ndarray, page_gen: np.ndarray) -> TableViolations:
    """found (a table's violations) plus stale_page for every entry the rules checked and passed (the rows
    with a good indptr pair) whose page's recorded generation is not the table's."""
    ip = np.asarray(indptr).astype(np.int64)
    batch = len(ip) - 1
    if batch <= 0:
        return found
    bad_rows = found.rows[(found.codes == BAD_INDPTR) & (found.positions < 0)]
    good = np.ones(batch, dtype=bool)
    good[bad_rows[bad_rows >= 0]] = False
    r = np.flatnonzero(good)
    cnt = ip[1:][r] - ip[:-1][r]
    row_of = np.repeat(r, cnt)
    pos = np.repeat(ip[:-1][r] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()), dtype=np.int64)
    keep = ~np.isin(pos, found.positions[found.positions >= 0])
    row_of, pos = row_of[keep], pos[keep]
    pages = np.asarray(indices)[pos].astype(np.int64)
    stale = page_gen[pages - layout.base] != generations[pos]
    return _merge(found, row_of[stale], pos[stale], pages[stale], STALE_PAGE)


def csr_violations(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                   layout: PageLayout, generations: np.ndarray | None = None,
                   page_gen: np.ndarray | None = None) -> tuple[TableViolations, np.ndarray]:
    """Every violation of a CSR table (kvservice.contract.pagetable.table_violations: the one
    definition, then stale_page with generations) and the per-row reason bit mask int32 [batch]
    (bit reason - 1)."""
    batch = api.check_csr(indptr, indices, last_page_len)
    checked = api._check_gens("generations", generations, int(indices.shape[0]), page_gen, layout, "[nnz]")
    found = table_violations(indptr, indices, last_page_len, layout.page_size, base=layout.base,
                             upper_bound=layout.upper_bound, scale=layout.scale, offset=layout.offset,
                             pool_pages=layout.pool_pages)
    if checked:
        found = stale_entries(found, indptr, indices, layout, generations, page_gen)
    status = np.zeros(batch, dtype=np.int32)
    in_row = found.rows >= 0
    np.bitwise_or.at(status, found.rows[in_row], (1 << (found.codes[in_row] - 1)).astype(np.int32))
    return found, status


def validate_page_table(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                        layout: PageLayout, *, generations: np.ndarray | None = None,
                        page_gen: np.ndarray | None = None) -> ValidationResult:
    """See kernel_api.validate_page_table."""
    found, status = csr_violations(indptr, indices, last_page_len, layout, generations, page_gen)
    return ValidationResult(status, _record("validate_page_table", found))


def decode_attention(q: np.ndarray, cache: np.ndarray, layout: PageLayout, indptr: np.ndarray,
                     indices: np.ndarray, last_page_len: np.ndarray, *, sm_scale: float | None = None,
                     window: int = 0, policy: Policy = Policy.NAN, kv_chunk_pages: int | None = None,
                     max_pages: int | None = None, out: np.ndarray | None = None,
                     lse: np.ndarray | None = None, generations: np.ndarray | None = None,
                     page_gen: np.ndarray | None = None) -> api.AttentionCall:
    """See kernel_api.decode_attention (kv_chunk_pages/max_pages are ignored)."""
    api.refuse_k_only(layout)
    api.check_cache("cache", cache, layout, 0)
    batch = api.check_csr(indptr, indices, last_page_len)
    hq = q.shape[1] if q.ndim == 3 else -1
    api.check_array("q", q, (batch, hq, layout.head_dim), DTYPES[layout.dtype], "[batch, num_q_heads, head_dim]")
    if hq <= 0 or hq % layout.kv_heads:
        raise ValueError(f"q: num_q_heads {hq} must be a positive multiple of kv_heads {layout.kv_heads}")
    scale = np.float32(1.0 / np.sqrt(layout.head_dim) if sm_scale is None else sm_scale)
    found, status = csr_violations(indptr, indices, last_page_len, layout, generations, page_gen)
    out, lse = api.attention_outputs(np, out, lse, batch, hq, layout.head_dim)
    flat = cache.reshape(-1)
    ps, kh, d = layout.page_size, layout.kv_heads, layout.head_dim
    qf = _to_f32(q, layout.dtype).reshape(batch, kh, hq // kh, d)
    for r in range(batch):
        if r % 16 == 0:
            cancel.check("decode_attention")     # the call's deadline reaches the loop (kvservice/worker/cancel.py)
        if status[r]:
            out[r] = 0.0 if policy == Policy.ZEROS else np.nan
            lse[r] = -np.inf if policy == Policy.ZEROS else np.nan
            continue
        a, b = int(indptr[r]), int(indptr[r + 1])
        if b == a:
            out[r], lse[r] = 0.0, -np.inf
            continue
        seq = (b - a - 1) * ps + int(last_page_len[r])
        lo = seq - window if 0 < window < seq else 0
        tok = np.arange(lo, seq)
        pages = indices[a + tok // ps].astype(np.int64) - layout.base
        base = pages * layout.page_stride + (tok % ps) * kh * d
        idx = base[:, None] + np.arange(kh * d)
        k = _to_f32(flat[idx], layout.dtype).reshape(-1, kh, d)
        v = _to_f32(flat[idx + ps * kh * d], layout.dtype).reshape(-1, kh, d)
        s = np.einsum("hgd,thd->hgt", qf[r], k) * scale
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        den = p.sum(axis=-1, keepdims=True)
        out[r] = (np.einsum("hgt,thd->hgd", p, v) / den).reshape(hq, d)
        lse[r] = (m + np.log(den)).reshape(hq)
    call = api.AttentionCall(out, lse, None, np.asarray)
    _call("decode_attention", found, policy, call)
    return call


def append_kv(cache: np.ndarray, layout: PageLayout, k: np.ndarray, v: np.ndarray,
              slot_mapping: np.ndarray, *, policy: Policy = Policy.NAN, slot_generations: np.ndarray | None = None,
              page_gen: np.ndarray | None = None) -> KernelCall:
    """See kernel_api.append_kv."""
    api.check_cache("cache", cache, layout, 0)
    n = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    api.check_array("slot_mapping", slot_mapping, (n,), np.int64, "[n]")
    shape = (n, layout.kv_heads, layout.head_dim)
    api.check_array("k", k, shape, DTYPES[layout.dtype], "[n, kv_heads, head_dim]")
    api.check_v(v, shape, layout)
    checked = api._check_gens("slot_generations", slot_generations, n, page_gen, layout, "[n]")
    api.check_distinct_slots(np, slot_mapping)
    s = slot_mapping.astype(np.int64)
    skip = s == api.SKIP_SLOT                       # a token this layer does not hold: written nowhere
    page = np.where(s < 0, -1, s // layout.page_size)
    reasons = np.where(skip, 0, layout.reasons(page))
    if checked:                                     # paged.cuh kv_append_gen_reason, on the record before the call
        at = np.flatnonzero((reasons == 0) & ~skip)
        g = slot_generations[at]
        off = s[at] - page[at] * layout.page_size
        r = page_gen[page[at] - layout.base]
        first = at - off
        opens = (first >= 0) & (s[np.maximum(first, 0)] == s[at] - off) & \
            (slot_generations[np.maximum(first, 0)] == g)
        reasons[at[(r != g) & ~(opens & _newer(g, r))]] = STALE_PAGE
    bad = np.flatnonzero(reasons)
    found = _entries(bad, bad, s[bad], reasons[bad])
    ok = (reasons == 0) & ~skip
    row = layout.kv_heads * layout.head_dim
    base = (page[ok] - layout.base) * layout.page_stride + (s[ok] % layout.page_size) * row
    idx = base[:, None] + np.arange(row)
    flat = cache.reshape(-1)
    flat[idx] = k[ok].reshape(-1, row)
    if v is not None:
        flat[idx + layout.page_size * row] = v[ok].reshape(-1, row)
    if checked:
        page_gen[page[ok] - layout.base] = slot_generations[ok]
    return _call("append_kv", found, policy)


def copy_blocks(caches: Sequence[np.ndarray], layout: PageLayout, pairs: np.ndarray,
                *, policy: Policy = Policy.NAN, generations: np.ndarray | None = None,
                page_gens: Sequence[np.ndarray] | None = None) -> KernelCall:
    """See kernel_api.copy_blocks."""
    if not caches:
        raise ValueError("caches: need at least one buffer")
    for i, c in enumerate(caches):
        api.check_cache(f"caches[{i}]", c, layout, 0)
    n = pairs.shape[0] if pairs.ndim == 2 else -1
    api.check_array("pairs", pairs, (n, 2), np.int64, "[n, 2]")
    if page_gens is not None and len(page_gens) != len(caches):
        raise ValueError(f"page_gens: one record per buffer of caches ({len(caches)}), got {len(page_gens)}")
    checked = api._check_gens("generations", generations, (n, 2), page_gens, layout, "[n, 2]")
    api.check_copy_pairs(np, pairs)
    reasons = layout.reasons(pairs)
    i, j = np.nonzero(reasons)
    found = _entries(i, j, pairs[i, j], reasons[i, j])
    good_rows = np.flatnonzero((reasons == 0).all(axis=1))
    elems = np.arange(layout.page_elems)
    for li, c in enumerate(caches):  # destinations are distinct and never a source: the order does not matter
        rows = good_rows
        if checked:                  # paged.cuh kv_copy_blocks, per layer, on the record before the call
            pg = page_gens[li]
            src_p, dst_p = pairs[rows, 0] - layout.base, pairs[rows, 1] - layout.base
            gs = pg[src_p] != generations[rows, 0]
            held, want = pg[dst_p], generations[rows, 1]
            gd = (held != want) & ~_newer(want, held)
            for col, stale in ((0, gs), (1, gd)):
                found = _merge(found, rows[stale], np.full(int(stale.sum()), col, dtype=np.int64),
                               pairs[rows[stale], col], STALE_PAGE)
            rows = rows[~(gs | gd)]
        good = pairs[rows] - layout.base     # buffer pages
        src, dst = good[:, :1] * layout.page_stride + elems, good[:, 1:] * layout.page_stride + elems
        flat = c.reshape(-1)
        flat[dst] = flat[src]
        if checked:
            page_gens[li][good[:, 1]] = generations[rows, 1]
    return _call("copy_blocks", found, policy)


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """See kernel_api.widen: float16 by NumPy's conversion, bfloat16 by placing the 16 bits
    in the high half of a float32 (exact for every pattern, NaN payloads included)."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    api.check_array("x", x, (None,), DTYPES[dtype], "[n]")
    return _to_f32(x, dtype)


def guard_fill(buf: np.ndarray, guard_bytes: int) -> None:
    """See kvservice.worker.guards.guard_fill."""
    guards.check_guarded(buf, guard_bytes)
    pat = guards.guard_pattern(guard_bytes)
    buf[:guard_bytes] = pat
    buf[buf.shape[0] - guard_bytes:] = pat


def guard_check(buf: np.ndarray, guard_bytes: int) -> GuardReport:
    """See kvservice.worker.guards.guard_check."""
    guards.check_guarded(buf, guard_bytes)
    pat = guards.guard_pattern(guard_bytes)
    n = buf.shape[0]
    bad = np.concatenate([np.flatnonzero(buf[:guard_bytes] != pat),
                          n - guard_bytes + np.flatnonzero(buf[n - guard_bytes:] != pat)])
    return GuardReport(int(bad.size), int(bad.min()) if bad.size else -1)
