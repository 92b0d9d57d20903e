"""Float64 torch oracle for the paged kernels: gather a row's pages, dense
decode attention with GQA and a sliding window. Test/benchmark use only.

Independent of the kernels' addressing: pages are found from RAW BYTE OFFSETS
computed from the pool geometry (slot -> ``slot * slot_bytes + byte_offset``),
never through ``kvservice.worker.kernel_api.PageLayout`` or ``paged.cuh``. The oracle sees
the same quantised inputs as the kernels (16-bit values widened exactly), so
the only difference left is the kernels' float32 arithmetic: ``TOLERANCE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvservice.contract.geometry import Geometry

#: Largest relative error of a kernel's float32 output and lse per row against
#: this oracle (see ``row_rel_err``), by cache dtype. The oracle widens the same
#: 16-bit inputs exactly, so the dtype does not change what float32 accumulation
#: allows: about 1e-5 for the sequence lengths of the tests (a few hundred tokens).
TOLERANCE: dict[str, float] = {"float32": 1e-5, "float16": 1e-5, "bfloat16": 1e-5}

_STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class RawLayer:
    """Where one layer's pages are, in bytes of its buffer, from the geometry alone.

    Slot x of the layer's buffer holds this layer's page at bytes
    ``[x * slot_bytes + byte_offset, ... + page_bytes)``; the page index of slot x
    is ``base + x * scale + offset`` (NUMBERING.md).
    """

    num_slots: int
    slot_bytes: int
    byte_offset: int
    scale: int
    offset: int
    base: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def page_bytes(self) -> int:
        return 2 * self.page_size * self.kv_heads * self.head_dim * _ITEMSIZE[self.dtype]

    @classmethod
    def per_layer(cls, num_slots: int, page_size: int, kv_heads: int, head_dim: int, dtype: str,
                  base: int = 0) -> RawLayer:
        pb = 2 * page_size * kv_heads * head_dim * _ITEMSIZE[dtype]
        return cls(num_slots, pb, 0, 1, 0, base, page_size, kv_heads, head_dim, dtype)

    @classmethod
    def interleaved(cls, num_slots: int, slot_bytes: int, byte_offset: int, page_size: int, kv_heads: int,
                    head_dim: int, dtype: str, base: int = 0) -> RawLayer:
        pb = 2 * page_size * kv_heads * head_dim * _ITEMSIZE[dtype]
        return cls(num_slots, slot_bytes, byte_offset, slot_bytes // pb, byte_offset // pb, base, page_size,
                   kv_heads, head_dim, dtype)

    @classmethod
    def from_geometry(cls, geo: Geometry, layer: int) -> RawLayer:
        """From the pool geometry: the LayerView and LayerGroup of ``layer``."""
        v, ls = geo.layers[layer], geo.spec.layers[layer]
        slot_bytes = geo.groups[v.group].slot_bytes if geo.spec.layout == "interleaved" else v.page_bytes
        return cls(geo.num_slots, slot_bytes, v.byte_offset, v.scale, v.offset, v.base, geo.spec.page_size,
                   ls.kv_heads, ls.head_dim, ls.dtype)

    def byte_offset_of(self, page: int) -> int:
        """Byte offset of page ``page`` in the layer's buffer; IndexError if no slot holds it."""
        slot, rem = divmod(page - self.base - self.offset, self.scale)
        if rem or not 0 <= slot < self.num_slots:
            raise IndexError(f"page {page} is no slot of this layer (base {self.base}, scale {self.scale}, "
                             f"offset {self.offset}, {self.num_slots} slots)")
        return slot * self.slot_bytes + self.byte_offset


def page_view(cache: np.ndarray, raw: RawLayer, page: int) -> np.ndarray:
    """Page ``page`` of a layer buffer as [2, page_size, kv_heads, head_dim] of the storage
    dtype: a view of the buffer's bytes (writable if the buffer is)."""
    if not cache.flags.c_contiguous:
        raise ValueError("cache must be C-contiguous")
    start = raw.byte_offset_of(page)
    flat = cache.reshape(-1).view(np.uint8)
    if start + raw.page_bytes > flat.shape[0]:
        raise IndexError(f"page {page} ends at byte {start + raw.page_bytes}, past the {flat.shape[0]}-byte buffer")
    return flat[start:start + raw.page_bytes].view(_STORAGE[raw.dtype]).reshape(
        2, raw.page_size, raw.kv_heads, raw.head_dim)


def to_float64(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Storage array (bfloat16 as uint16 bits) -> float64 tensor."""
    a = np.ascontiguousarray(a)
    if dtype == "bfloat16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(a.astype(np.float64))


def gather_pages(cache: np.ndarray, raw: RawLayer, indptr: np.ndarray, indices: np.ndarray,
                 last_page_len: np.ndarray, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one row as float64 [seq_len, kv_heads, head_dim]. Raises
    IndexError on a page no slot of the layer holds."""
    a, b = int(indptr[row]), int(indptr[row + 1])
    ks, vs = [], []
    for pos in range(a, b):
        n = int(last_page_len[row]) if pos == b - 1 else raw.page_size
        page = to_float64(page_view(cache, raw, int(indices[pos])), raw.dtype)
        ks.append(page[0, :n])
        vs.append(page[1, :n])
    shape = (0, raw.kv_heads, raw.head_dim)
    if not ks:
        return torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    return torch.cat(ks), torch.cat(vs)


def decode_attention_ref(q: np.ndarray, cache: np.ndarray, raw: RawLayer, indptr: np.ndarray,
                         indices: np.ndarray, last_page_len: np.ndarray, *,
                         sm_scale: float | None = None, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Dense float64 decode attention; rows with a page no slot holds come back NaN.
    q: [batch, q_heads, head_dim] storage dtype. Returns out float64 [batch, q_heads,
    head_dim] and lse float64 [batch, q_heads] (natural log)."""
    batch, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = hq // raw.kv_heads
    qf = to_float64(q, raw.dtype)
    out = torch.full((batch, hq, d), float("nan"), dtype=torch.float64)
    lse = torch.full((batch, hq), float("nan"), dtype=torch.float64)
    for r in range(batch):
        try:
            k, v = gather_pages(cache, raw, indptr, indices, last_page_len, r)
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


def row_rel_err(a: np.ndarray, ref: np.ndarray, floor: float = 1e-30) -> float:
    """Largest per-row relative error: max over rows r (axis 0) of
    ``max|a_r - ref_r| / max(max|ref_r|, floor)`` over the finite entries of ``ref_r``; the
    non-finite entries (-inf lse of an empty row) must match exactly, else inf. Rows that
    are all NaN in ``ref`` (an invalid page) are skipped. For lse use ``floor=1``: lse
    enters the output as exp(s - lse), so an lse near 0 is judged by its absolute error."""
    a64 = np.asarray(a, np.float64).reshape(len(a), -1)
    r64 = np.asarray(ref, np.float64).reshape(len(ref), -1)
    worst = 0.0
    for x, y in zip(a64, r64, strict=True):
        if np.isnan(y).all():
            continue
        fin = np.isfinite(y)
        if not np.array_equal(fin, np.isfinite(x)) or not np.array_equal(x[~fin], y[~fin]):
            return math.inf
        if fin.any():
            worst = max(worst, float(np.abs(x[fin] - y[fin]).max() / max(np.abs(y[fin]).max(), floor)))
    return worst
