"""Float64 torch oracle for the paged kernels: gather a row's pages, dense
decode attention with GQA and a sliding window. Test/benchmark use only."""

from __future__ import annotations

import math

import numpy as np
import torch

from worker.kernel_api import PageLayout


def to_float64(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Storage array (bfloat16 as uint16 bits) -> float64 tensor."""
    a = np.ascontiguousarray(a)
    if dtype == "bfloat16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(a.astype(np.float64))


def page_view(cache: np.ndarray, layout: PageLayout, page: int) -> np.ndarray:
    """Page ``page`` of a layer buffer as [2, page_size, kv_heads, head_dim] (no checks)."""
    flat = cache.reshape(-1)
    start = page * layout.page_stride
    return flat[start:start + layout.page_elems].reshape(2, layout.page_size, layout.kv_heads, layout.head_dim)


def gather_pages(cache: np.ndarray, layout: PageLayout, indptr: np.ndarray, indices: np.ndarray,
                 last_page_len: np.ndarray, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one row as float64 [seq_len, kv_heads, head_dim]. Raises
    IndexError on a page the layout does not allow."""
    a, b = int(indptr[row]), int(indptr[row + 1])
    ks, vs = [], []
    for pos in range(a, b):
        p = int(indices[pos])
        if layout.reasons(np.array([p]))[0] != 0:
            raise IndexError(f"row {row} position {pos}: page {p} not valid in this index space")
        n = int(last_page_len[row]) if pos == b - 1 else layout.page_size
        page = to_float64(page_view(cache, layout, p), layout.dtype)
        ks.append(page[0, :n])
        vs.append(page[1, :n])
    shape = (0, layout.kv_heads, layout.head_dim)
    if not ks:
        return torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    return torch.cat(ks), torch.cat(vs)


def decode_attention_ref(q: np.ndarray, cache: np.ndarray, layout: PageLayout, indptr: np.ndarray,
                         indices: np.ndarray, last_page_len: np.ndarray, *,
                         sm_scale: float | None = None, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Dense float64 decode attention; rows whose table is invalid come back NaN.
    Returns out [batch, q_heads, head_dim] and lse [batch, q_heads] (natural log)."""
    batch, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = hq // layout.kv_heads
    qf = to_float64(q, layout.dtype)
    out = torch.full((batch, hq, d), float("nan"), dtype=torch.float64)
    lse = torch.full((batch, hq), float("nan"), dtype=torch.float64)
    for r in range(batch):
        try:
            k, v = gather_pages(cache, layout, indptr, indices, last_page_len, r)
        except IndexError:
            continue
        if window > 0:
            k, v = k[-window:], v[-window:]
        if k.shape[0] == 0:
            out[r], lse[r] = 0.0, float("-inf")
            continue
        kk = k.repeat_interleave(group, dim=1)  # [T, hq, d]
        vv = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", qf[r], kk) * scale
        lse[r] = torch.logsumexp(s, dim=1)
        out[r] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=1), vv)
    return out.numpy(), lse.numpy()
