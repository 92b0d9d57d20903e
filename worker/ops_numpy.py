"""NumPy implementation of every kernel, same semantics and the same violation
records as worker/kernels/*.cu (for CPU workers). Same API as kernels_cpu."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker import kernel_api as api
from worker.kernel_api import DTYPES, GuardReport, KernelCall, PageLayout, Policy, ValidationResult, ViolationRecord

_ROW = -1  # position of a row-level entry


def _call(kernel: str, found: list[tuple[int, int, int, int]], policy: Policy,
          call: KernelCall | None = None) -> KernelCall:
    """found: (row, position, value, reason code) of every offending entry."""
    call = KernelCall(kernel, None, np.asarray) if call is None else call
    if found:
        row, pos, value, reason = min(found, key=lambda f: (f[0], f[1]))
        call._record = ViolationRecord(kernel, len(found), row, pos, value, api.REASONS[reason])
    else:
        call._record = ViolationRecord(kernel)
    call.raise_if(policy)
    return call


def _to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def csr_violations(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                   layout: PageLayout) -> tuple[list[tuple[int, int, int, int]], np.ndarray]:
    """Every offending entry of a CSR table and the per-row reason bit mask."""
    api.check_csr(indptr, indices, last_page_len)
    nnz = indices.shape[0]
    a, b = indptr[:-1].astype(np.int64), indptr[1:].astype(np.int64)
    lpl = last_page_len.astype(np.int64)
    bad_a = (a < 0) | (a > nnz)
    bad_ip = bad_a | (b < a) | (b > nnz)
    bad_l = ~bad_ip & (b > a) & ((lpl <= 0) | (lpl > layout.page_size))
    status = np.zeros(a.shape[0], dtype=np.int32)
    found: list[tuple[int, int, int, int]] = []
    for r in np.flatnonzero(bad_ip):
        found.append((int(r), _ROW, int(a[r] if bad_a[r] else b[r]), 4))
        status[r] |= 1 << 3
    for r in np.flatnonzero(bad_l):
        found.append((int(r), _ROW, int(lpl[r]), 3))
        status[r] |= 1 << 2
    lengths = np.where(bad_ip, 0, b - a)
    rows = np.repeat(np.arange(a.shape[0]), lengths)
    starts = np.repeat(np.where(bad_ip, 0, a) - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    pos = np.arange(rows.shape[0]) + starts
    vals = indices[pos].astype(np.int64)
    reasons = layout.reasons(vals)
    for i in np.flatnonzero(reasons):
        found.append((int(rows[i]), int(pos[i]), int(vals[i]), int(reasons[i])))
        status[rows[i]] |= 1 << (int(reasons[i]) - 1)
    return found, status


def validate_page_table(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                        layout: PageLayout) -> ValidationResult:
    """See kernel_api.validate_page_table."""
    found, status = csr_violations(indptr, indices, last_page_len, layout)
    return ValidationResult(status, _call("validate_page_table", found, Policy.NAN).record)


def decode_attention(q: np.ndarray, cache: np.ndarray, layout: PageLayout, indptr: np.ndarray,
                     indices: np.ndarray, last_page_len: np.ndarray, *, sm_scale: float | None = None,
                     window: int = 0, policy: Policy = Policy.NAN, kv_chunk_pages: int | None = None,
                     max_pages: int | None = None, out: np.ndarray | None = None,
                     lse: np.ndarray | None = None) -> api.AttentionCall:
    """See kernel_api.decode_attention (kv_chunk_pages/max_pages are ignored)."""
    api.check_cache("cache", cache, layout, 0)
    batch = api.check_csr(indptr, indices, last_page_len)
    hq = q.shape[1] if q.ndim == 3 else -1
    api.check_array("q", q, (batch, hq, layout.head_dim), DTYPES[layout.dtype], "[batch, num_q_heads, head_dim]")
    if hq <= 0 or hq % layout.kv_heads:
        raise ValueError(f"q: num_q_heads {hq} must be a positive multiple of kv_heads {layout.kv_heads}")
    scale = np.float32(1.0 / np.sqrt(layout.head_dim) if sm_scale is None else sm_scale)
    found, status = csr_violations(indptr, indices, last_page_len, layout)
    out, lse = api.attention_outputs(np, out, lse, batch, hq, layout.head_dim)
    flat = cache.reshape(-1)
    ps, kh, d = layout.page_size, layout.kv_heads, layout.head_dim
    qf = _to_f32(q, layout.dtype).reshape(batch, kh, hq // kh, d)
    for r in range(batch):
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
        pages = indices[a + tok // ps].astype(np.int64)
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
              slot_mapping: np.ndarray, *, policy: Policy = Policy.NAN) -> KernelCall:
    """See kernel_api.append_kv."""
    api.check_cache("cache", cache, layout, 0)
    n = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    api.check_array("slot_mapping", slot_mapping, (n,), np.int64, "[n]")
    for name, t in (("k", k), ("v", v)):
        api.check_array(name, t, (n, layout.kv_heads, layout.head_dim), DTYPES[layout.dtype],
                        "[n, kv_heads, head_dim]")
    s = slot_mapping.astype(np.int64)
    page = np.where(s < 0, -1, s // layout.page_size)
    reasons = layout.reasons(page)
    found = [(int(i), int(i), int(s[i]), int(reasons[i])) for i in np.flatnonzero(reasons)]
    ok = reasons == 0
    row = layout.kv_heads * layout.head_dim
    base = page[ok] * layout.page_stride + (s[ok] % layout.page_size) * row
    idx = base[:, None] + np.arange(row)
    flat = cache.reshape(-1)
    flat[idx] = k[ok].reshape(-1, row)
    flat[idx + layout.page_size * row] = v[ok].reshape(-1, row)
    return _call("append_kv", found, policy)


def copy_blocks(caches: Sequence[np.ndarray], layout: PageLayout, pairs: np.ndarray,
                *, policy: Policy = Policy.NAN) -> KernelCall:
    """See kernel_api.copy_blocks."""
    if not caches:
        raise ValueError("caches: need at least one buffer")
    for i, c in enumerate(caches):
        api.check_cache(f"caches[{i}]", c, layout, 0)
    n = pairs.shape[0] if pairs.ndim == 2 else -1
    api.check_array("pairs", pairs, (n, 2), np.int64, "[n, 2]")
    reasons = layout.reasons(pairs)
    found = [(int(i), int(j), int(pairs[i, j]), int(reasons[i, j])) for i, j in zip(*np.nonzero(reasons), strict=True)]
    good = pairs[(reasons == 0).all(axis=1)]
    for c in caches:
        flat = c.reshape(-1)
        for src, dst in good:
            s0, d0 = src * layout.page_stride, dst * layout.page_stride
            flat[d0:d0 + layout.page_elems] = flat[s0:s0 + layout.page_elems]
    return _call("copy_blocks", found, policy)


def guard_fill(buf: np.ndarray, guard_bytes: int) -> None:
    """See kernel_api.guard_fill."""
    api._check_guarded(buf, guard_bytes)
    pat = api.guard_pattern(guard_bytes)
    buf[:guard_bytes] = pat
    buf[buf.shape[0] - guard_bytes:] = pat


def guard_check(buf: np.ndarray, guard_bytes: int) -> GuardReport:
    """See kernel_api.guard_check."""
    api._check_guarded(buf, guard_bytes)
    pat = api.guard_pattern(guard_bytes)
    n = buf.shape[0]
    bad = np.concatenate([np.flatnonzero(buf[:guard_bytes] != pat),
                          n - guard_bytes + np.flatnonzero(buf[n - guard_bytes:] != pat)])
    return GuardReport(int(bad.size), int(bad.min()) if bad.size else -1)
