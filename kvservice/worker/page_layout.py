"""PageLayout: where each page of a layer's cache lives in device memory (per-layer or interleaved, K and V or
K-only), and the 64-bit offsets the kernels compute; every kernel call takes one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvservice.contract import pagetable
from kvservice.worker.launch_plan import HEAD_DIMS, VEC

#: Cache dtypes: NumPy/CuPy storage dtype (bfloat16 as uint16 bit patterns) and bytes per element.
DTYPES: dict[str, Any] = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class PageLayout:
    """How one layer sees its buffer: pages of ``[2, page_size, kv_heads, head_dim]`` (K then V), or of
    ``[1, page_size, kv_heads, head_dim]`` for a K-only layer (``k_only``: a multi-head latent attention
    layer's latent vectors, appended, copied and validated like any page; decode attention refuses it).

    ``page_stride``: elements between pages. Index space (docs NUMBERING): a page
    index p is valid iff ``base <= p < upper_bound`` and ``(p - base - offset) % scale
    == 0``; it lives at buffer page ``p - base``. ``pool_pages``: end of the pool's
    numbering (0 = ``upper_bound``), which tells ``wrong_index_space`` (a page of another
    space of the pool) from ``out_of_bounds``.
    """

    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_stride: int
    scale: int = 1
    offset: int = 0
    upper_bound: int = 0
    base: int = 0
    pool_pages: int = 0
    k_only: bool = False

    def __post_init__(self) -> None:
        if self.pool_pages == 0:
            object.__setattr__(self, "pool_pages", self.upper_bound)

    @property
    def kv_tensors(self) -> int:
        """Tensors per page: 2 (K and V) or 1 (k_only)."""
        return 1 if self.k_only else 2

    @property
    def num_pages(self) -> int:
        """Pages of the layer's buffer: upper_bound - base."""
        return self.upper_bound - self.base

    @property
    def page_elems(self) -> int:
        return self.kv_tensors * self.page_size * self.kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def required_elems(self) -> int:
        """Buffer elements the highest valid page reaches."""
        return (self.num_pages - 1) * self.page_stride + self.page_elems

    @classmethod
    def per_layer(cls, num_slots: int, page_size: int, kv_heads: int, head_dim: int, dtype: str, *,
                  base: int = 0, pool_pages: int = 0, k_only: bool = False) -> PageLayout:
        """A layer buffer of num_slots pages; page index = base + slot."""
        pe = (1 if k_only else 2) * page_size * kv_heads * head_dim
        return cls(page_size, kv_heads, head_dim, dtype, pe, 1, 0, base + num_slots, base, pool_pages, k_only)

    @classmethod
    def interleaved(
        cls, num_slots: int, slot_bytes: int, byte_offset: int,
        page_size: int, kv_heads: int, head_dim: int, dtype: str, *, base: int = 0, pool_pages: int = 0,
        k_only: bool = False,
    ) -> PageLayout:
        """Layer page inside a slot of ``slot_bytes``; pages aligned to their own size;
        page index = base + slot * scale + offset."""
        pe = (1 if k_only else 2) * page_size * kv_heads * head_dim
        pb = pe * ITEMSIZE[dtype]
        if slot_bytes % pb or byte_offset % pb:
            raise ValueError(f"slot_bytes {slot_bytes} and byte_offset {byte_offset} "
                             f"must be multiples of page bytes {pb}")
        scale = slot_bytes // pb
        return cls(page_size, kv_heads, head_dim, dtype, pe, scale, byte_offset // pb, base + num_slots * scale,
                   base, pool_pages, k_only)

    def page_index(self, slot: np.ndarray | int) -> np.ndarray | int:
        return self.base + slot * self.scale + self.offset

    def reasons(self, pages: np.ndarray) -> np.ndarray:
        """Reason code per page index (0 ok, else out_of_bounds 1 / off_lattice 2 /
        wrong_index_space 5), as kvservice.contract.pagetable.page_reasons; same shape, int8."""
        return pagetable.page_reasons(pages, base=self.base, upper_bound=self.upper_bound, scale=self.scale,
                                      offset=self.offset, pool_pages=self.pool_pages)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.k_only:         # no decode kernel reads it: any row of whole 16-byte pieces
            if self.head_dim <= 0 or (self.head_dim * self.kv_heads) % VEC[self.dtype]:
                raise ValueError(f"a K-only (latent) layer needs kv_heads * head_dim a multiple of "
                                 f"{VEC[self.dtype]}, got {self.kv_heads} x {self.head_dim}")
        elif self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        for name in ("page_size", "kv_heads", "scale", "num_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.offset < self.scale or self.base < 0 or self.pool_pages < self.upper_bound:
            raise ValueError(f"index space needs 0 <= offset < scale, base >= 0 and pool_pages >= upper_bound, "
                             f"got offset {self.offset}, scale {self.scale}, base {self.base}, "
                             f"pool_pages {self.pool_pages}, upper_bound {self.upper_bound}")
        if self.page_elems >= 2**31:  # the kernels' in-page offsets are 32-bit (page strides and bases: 64)
            raise ValueError(f"a page holds {self.page_elems} elements; the kernels take fewer than 2^31 per page")
        if self.page_stride < self.page_elems or self.page_stride % VEC[self.dtype]:
            raise ValueError(f"page_stride {self.page_stride} must be >= page elems {self.page_elems} "
                             f"and a multiple of {VEC[self.dtype]}")
