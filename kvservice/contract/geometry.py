"""Cache geometry: layers, layer groups, layouts and index spaces (docs/DESIGN.md, "Domain terms").

A *slot* holds one page of every layer of its layer group. How a layer turns a
slot into a page index depends on the layout:

- ``per_layer``: each layer has its own buffer ``[num_slots, 2, page_size,
  kv_heads, head_dim]`` (``[num_slots, 1, ...]`` for a K-only latent layer,
  ``LayerSpec.k_only``); page index = slot (scale 1, offset 0). Every layer of a
  group shares one index space.
- ``interleaved``: one buffer per layer group; a slot is the concatenation of one
  page of each layer, each placed at a byte offset that is a multiple of its own
  page size, and the slot padded to a multiple of every page size. Layer L views
  the buffer as an array of its own pages: ``page = slot * scale_L + offset_L``
  with ``scale_L = slot_bytes / page_bytes_L`` and ``offset_L = byte_offset_L /
  page_bytes_L``; valid pages are ``< num_slots * scale_L`` and on the lattice
  ``(page - offset_L) % scale_L == 0``.

Disjoint index spaces: the spaces of one pool (in index-space order) occupy
consecutive, disjoint ranges of page indices. Space s starts at ``base_s``
(``base_0 = 0``, ``base_{s+1} = upper_bound_s``) and slot x is page
``base_s + x * scale_s + offset_s``; its layers' buffers hold ``num_slots *
scale_s`` pages, page p at buffer page ``p - base_s``. So a table converted for
one index space can never validate on a layer of another (seed 004): its pages
are ``wrong_index_space`` there, not merely unlikely to pass. A single-space pool
(the usual uniform per_layer model) has base 0 and is numbered exactly as
FlashInfer and vLLM number pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.contract.errors import InvalidArgument

#: Bytes per element of each cache dtype.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3": 1, "float8_e5m2": 1}
LAYOUTS = ("per_layer", "interleaved")
INT32_MAX = 2**31 - 1
MAX_LAYERS = 4096
#: No pool holds more tokens per sequence; keeps every sum of counts far from int64 overflow.
MAX_COUNT = 2**40


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Shape of one layer's K/V cache.

    kv_heads: K/V heads this cache holds (after any tensor-parallel split), > 0.
    head_dim: elements per head, > 0.
    dtype: cache element type, one of DTYPE_BYTES.
    sliding_window: tokens attended by a sliding-window layer; 0 = full attention.
    k_only: the page holds one tensor, not K and V: multi-head latent attention (DeepSeek-V2/V3,
        Kimi-K2) caches one latent vector per token, ``kv_lora_rank + qk_rope_head_dim`` values, as a
        single K-only "head" (kv_heads 1, head_dim = that sum). A page is then
        ``[1, page_size, kv_heads, head_dim]``.
    """

    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    sliding_window: int = 0
    k_only: bool = False

    def __post_init__(self) -> None:
        if self.kv_heads <= 0 or self.head_dim <= 0:
            raise InvalidArgument(
                f"layer needs kv_heads > 0 and head_dim > 0, got kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"unknown cache dtype {self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        if self.sliding_window < 0:
            raise InvalidArgument(
                f"sliding_window must be >= 0 (0 = full attention), got {self.sliding_window}")

    @property
    def kv_tensors(self) -> int:
        """Tensors a page holds per token and head: 2 (K and V), or 1 (k_only)."""
        return 1 if self.k_only else 2

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page: K and V (K only for k_only) for page_size tokens."""
        return self.kv_tensors * page_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Every layer of the model (in order), the page size in tokens, and the layout."""

    layers: tuple[LayerSpec, ...]
    page_size: int
    layout: str = "per_layer"

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidArgument("cache spec has no layers")
        if len(self.layers) > MAX_LAYERS:
            raise InvalidArgument(f"cache spec has {len(self.layers)} layers; at most {MAX_LAYERS}")
        if self.page_size <= 0:
            raise InvalidArgument(f"page_size must be > 0 tokens, got {self.page_size}")
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"unknown layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")

    @classmethod
    def uniform(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: str = "float16",
                page_size: int = 16, layout: str = "per_layer", sliding_window: int = 0) -> CacheSpec:
        """A spec of num_layers identical layers."""
        if num_layers <= 0:
            raise InvalidArgument(f"num_layers must be > 0, got {num_layers}")
        layer = LayerSpec(kv_heads, head_dim, dtype, sliding_window)
        return cls((layer,) * num_layers, page_size, layout)


@dataclass(frozen=True, slots=True)
class IndexSpace:
    """The (group, scale, offset) triple that page indices of some layers live in, and its range.

    Valid pages p: ``base <= p < upper_bound`` and ``(p - base - offset) % scale == 0``;
    slot x is page ``base + x * scale + offset``. ``upper_bound`` is the exclusive end of the
    range, so the space's buffers hold ``num_pages = upper_bound - base`` pages.
    """

    id: int
    group: int
    scale: int
    offset: int
    upper_bound: int
    layers: tuple[int, ...]
    base: int = 0

    @property
    def num_pages(self) -> int:
        """Pages of this space's own size that each of its layers' buffers holds."""
        return self.upper_bound - self.base

    @property
    def index_dtype(self) -> np.dtype:
        """int32 unless upper_bound needs int64."""
        return np.dtype(np.int32 if self.upper_bound - 1 <= INT32_MAX else np.int64)

    def page_indices(self, slots: np.ndarray) -> np.ndarray:
        """Convert slots (any int array) to page indices of this space, dtype index_dtype."""
        if (self.scale, self.offset, self.base) == (1, 0, 0):
            return slots.astype(self.index_dtype, copy=False)
        pages = slots.astype(np.int64) * self.scale + (self.offset + self.base)
        return pages.astype(self.index_dtype, copy=False)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share a life cycle (full attention, or one sliding window) and a slot allocator."""

    id: int
    sliding_window: int
    layers: tuple[int, ...]
    slot_bytes: int          # bytes one slot takes over all layers of the group
    buffer_bytes: int        # largest single buffer of the group
    num_slots: int = 0       # slots of this group (a sliding group may have fewer than a full one)

    @property
    def bytes(self) -> int:
        """Bytes of all the group's buffers: num_slots * slot_bytes."""
        return self.num_slots * self.slot_bytes


@dataclass(frozen=True, slots=True)
class LayerView:
    """How one layer addresses its pages."""

    layer: int
    group: int
    index_space: int
    page_bytes: int
    byte_offset: int         # interleaved: offset of this layer's page inside a slot; else 0
    scale: int
    offset: int
    upper_bound: int
    base: int = 0            # first page index of the layer's index space (see IndexSpace)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def group_windows(spec: CacheSpec) -> list[int]:
    """The sliding window (0 = full attention) of each layer group, in group order (first appearance)."""
    windows: list[int] = []
    for layer in spec.layers:
        if layer.sliding_window not in windows:
            windows.append(layer.sliding_window)
    return windows


class Geometry:
    """Groups, per-layer views and index spaces of a CacheSpec.

    num_slots: slots of every group (an int), or of each group in group order (a sequence: a sliding
    group sized to its window holds fewer than a full-attention group). ``self.num_slots`` is then the
    largest count; each group's own is ``groups[g].num_slots``.
    """

    __slots__ = ("groups", "index_spaces", "layer_space", "layers", "num_slots", "pool_pages", "spec", "warnings")

    def __init__(self, spec: CacheSpec, num_slots: int | Sequence[int]) -> None:
        windows = group_windows(spec)
        counts = [int(num_slots)] * len(windows) if isinstance(num_slots, int | np.integer) else \
            [int(n) for n in num_slots]
        if len(counts) != len(windows):
            raise InvalidArgument(f"{len(counts)} slot counts for {len(windows)} layer groups; give one per group")
        if min(counts) <= 0:
            got = counts[0] if isinstance(num_slots, int | np.integer) else counts
            raise InvalidArgument(f"a pool needs at least one slot, got num_slots={got}")
        self.spec = spec
        self.num_slots = max(counts)
        self.warnings: list[str] = []
        ps = spec.page_size
        groups: list[LayerGroup] = []
        views: dict[int, LayerView] = {}
        spaces: list[IndexSpace] = []
        for gid, window in enumerate(windows):
            num_slots = counts[gid]
            members = tuple(i for i, la in enumerate(spec.layers) if la.sliding_window == window)
            page_bytes = {i: spec.layers[i].page_bytes(ps) for i in members}
            if spec.layout == "per_layer":
                slot_bytes = sum(page_bytes.values())
                buffer_bytes = max(page_bytes.values()) * num_slots
                base = spaces[-1].upper_bound if spaces else 0
                space = IndexSpace(len(spaces), gid, 1, 0, base + num_slots, members, base)
                spaces.append(space)
                for i in members:
                    views[i] = LayerView(i, gid, space.id, page_bytes[i], 0, 1, 0, space.upper_bound, base)
            else:
                # Largest pages first so that alignment padding is rare.
                order = sorted(members, key=lambda i: (-page_bytes[i], i))
                cursor, offsets = 0, {}
                for i in order:
                    offsets[i] = _round_up(cursor, page_bytes[i])
                    cursor = offsets[i] + page_bytes[i]
                slot_bytes = _round_up(cursor, math.lcm(*page_bytes.values()))
                used = sum(page_bytes.values())
                if slot_bytes > used * 5 // 4:
                    self.warnings.append(
                        f"group {gid}: interleaved slot padded from {used} to {slot_bytes} bytes "
                        f"to align every page to its own size")
                buffer_bytes = slot_bytes * num_slots
                by_key: dict[tuple[int, int], list[int]] = {}
                for i in members:
                    by_key.setdefault((slot_bytes // page_bytes[i], offsets[i] // page_bytes[i]), []).append(i)
                for (scale, offset), layer_ids in by_key.items():
                    base = spaces[-1].upper_bound if spaces else 0
                    space = IndexSpace(len(spaces), gid, scale, offset, base + num_slots * scale,
                                       tuple(layer_ids), base)
                    spaces.append(space)
                    for i in layer_ids:
                        views[i] = LayerView(i, gid, space.id, page_bytes[i], offsets[i], scale, offset,
                                             space.upper_bound, base)
            groups.append(LayerGroup(gid, window, members, slot_bytes, buffer_bytes, num_slots))
        self.groups = tuple(groups)
        self.layers = tuple(views[i] for i in range(len(spec.layers)))
        self.index_spaces = tuple(spaces)
        self.pool_pages = spaces[-1].upper_bound     # end of the pool's page numbering
        self.layer_space = np.array([v.index_space for v in self.layers], dtype=np.int32)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes over every group."""
        return sum(g.slot_bytes for g in self.groups)

    @property
    def group_slots(self) -> tuple[int, ...]:
        """Slots of each group, in group order."""
        return tuple(g.num_slots for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """Bytes of every cache buffer: the sum over groups of num_slots * slot_bytes."""
        return sum(g.bytes for g in self.groups)

    def layer_pages(self, layer: int) -> int:
        """Pages of one layer's buffer (its index space's range)."""
        v = self.layers[layer]
        return v.upper_bound - v.base

    @property
    def max_byte_offset(self) -> int:
        """Largest byte offset inside any one cache buffer."""
        return max(g.buffer_bytes for g in self.groups) - 1

    def space_of_layer(self, layer: int) -> IndexSpace:
        """The index space of a layer; InvalidArgument if the layer does not exist."""
        if not 0 <= layer < len(self.layers):
            raise InvalidArgument(f"layer {layer} does not exist; the pool has layers 0..{len(self.layers) - 1}")
        return self.index_spaces[self.layers[layer].index_space]
