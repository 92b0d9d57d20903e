"""The worker's KV memory: one guarded buffer per layer (per_layer) or per layer group (interleaved).

Each buffer is a uint8 allocation ``[guard | payload | guard]``; the guards hold
a canary pattern (kvservice.worker.guards.guard_pattern) so a stray write by any
kernel, ours or not, is caught by CheckGuards. Layers view the payload through
their PageLayout: the same page addressing the manager planned (geometry is
rebuilt from the pool's CacheSpec and cross-checked against the manager's plan),
including each index space's range ``[base, upper_bound)`` of the pool's page
numbering ``[0, pool_pages)`` (docs NUMBERING): page p is buffer page ``p - base``.

Beside each layer's pages the worker keeps their generations (``page_gen(layer)``, uint32 per
page, 0 = never written): the kernels record what they write under and refuse to read a page
whose generation is not the one its table expects (docs/KERNELS.md, "Page generations").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvservice.contract.geometry import INT32_MAX, CacheSpec, Geometry
from kvservice.worker.guards import guarded_view
from kvservice.worker.kernel_api import DTYPES, PageLayout

GUARD_BYTES = 4096


@dataclass
class Buffer:
    name: str          # "layer3" (per_layer) or "group0" (interleaved)
    raw: Any           # uint8 [guard + payload + guard], NumPy or CuPy
    payload_bytes: int


class CacheSet:
    """Buffers and page layouts of layers [layer_begin, layer_end) of one pool.

    ops: the kernel module (kvservice.worker.ops_numpy, kvservice.worker.kernels_cpu or kvservice.worker.kernels_cuda).
    xp: numpy or cupy.
    """

    def __init__(self, spec: CacheSpec, num_slots: int | Sequence[int], layer_begin: int, layer_end: int,
                 ops: ModuleType, xp: Any = np, guard_bytes: int = GUARD_BYTES,
                 expected: list[tuple[int, int, int]] | None = None, max_seq_len: int = 0):
        """num_slots: every group's slot count, or one per layer group (the plan's groups[].num_slots);
        max_seq_len: the pool's (PlanReply.max_seq_len; 0: what the largest group holds)."""
        self.spec = spec
        self.geometry = Geometry(spec, num_slots)
        self.max_seq_len = max_seq_len or self.geometry.num_slots * spec.page_size
        if not 0 <= layer_begin <= layer_end <= len(spec.layers):
            raise ValueError(f"layers [{layer_begin}, {layer_end}) are not a range of this pool's {len(spec.layers)} "
                             "layers: serve layers [b, e) with 0 <= b <= e <= the pool's layer count")
        self.layer_begin, self.layer_end = layer_begin, layer_end
        self.ops, self.xp, self.guard_bytes = ops, xp, guard_bytes
        geo = self.geometry
        if expected is not None:   # (scale, offset, upper_bound) per layer from the manager's plan
            mine = [(v.scale, v.offset, v.upper_bound) for v in geo.layers]
            if mine != [tuple(e) for e in expected]:
                first = next(i for i, (m, e) in enumerate(zip(mine, expected, strict=False)) if m != tuple(e)) \
                    if len(mine) == len(expected) else min(len(mine), len(expected))
                raise ValueError(f"the pool geometry rebuilt here differs from the manager's plan (first at layer "
                                 f"{first}: worker (scale, offset, upper_bound) "
                                 f"{mine[first] if first < len(mine) else None}, manager "
                                 f"{tuple(expected[first]) if first < len(expected) else None}); "
                                 "manager and worker run different versions")
        self.buffers: dict[str, Buffer] = {}
        self._layer_buffer: dict[int, str] = {}
        self.layouts: dict[int, PageLayout] = {}
        self._page_gen: dict[int, Any] = {}
        for layer in range(layer_begin, layer_end):
            ls, view = spec.layers[layer], geo.layers[layer]
            group = geo.groups[view.group]
            num_slots = group.num_slots
            space = dict(base=view.base, pool_pages=geo.pool_pages)
            if spec.layout == "per_layer":
                name, nbytes = f"layer{layer}", num_slots * view.page_bytes
                layout = PageLayout.per_layer(num_slots, spec.page_size, ls.kv_heads, ls.head_dim, ls.dtype,
                                              k_only=ls.k_only, **space)
            else:
                name, nbytes = f"group{group.id}", num_slots * group.slot_bytes
                layout = PageLayout.interleaved(num_slots, group.slot_bytes, view.byte_offset, spec.page_size,
                                                ls.kv_heads, ls.head_dim, ls.dtype, k_only=ls.k_only, **space)
            try:
                layout.validate()
                if layout.upper_bound - 1 > INT32_MAX:
                    raise ValueError(f"its index space ends at page {layout.upper_bound}, past the int32 page "
                                     "indices of the worker's page tables")
            except ValueError as err:
                raise ValueError(f"layer {layer} of this pool cannot run on the worker's kernels: {err}") from None
            assert (layout.scale, layout.offset, layout.base, layout.upper_bound) == \
                (view.scale, view.offset, view.base, view.upper_bound), f"layer {layer}: {layout} != {view}"
            if name not in self.buffers:
                raw = xp.zeros(nbytes + 2 * guard_bytes, dtype=np.uint8)
                ops.guard_fill(raw, guard_bytes)
                self.buffers[name] = Buffer(name, raw, nbytes)
            self._layer_buffer[layer] = name
            self.layouts[layer] = layout
            self._page_gen[layer] = xp.zeros(layout.num_pages, dtype=np.uint32)

    @property
    def cache_bytes(self) -> int:
        return sum(b.payload_bytes for b in self.buffers.values())

    def holds(self, layer: int) -> bool:
        return self.layer_begin <= layer < self.layer_end

    def cache(self, layer: int) -> Any:
        """The layer's buffer payload as a flat array of its storage dtype."""
        buf = self.buffers[self._layer_buffer[layer]]
        return guarded_view(buf.raw, self.guard_bytes, DTYPES[self.spec.layers[layer].dtype])

    def page_gen(self, layer: int) -> Any:
        """uint32 [num_pages] of a layer: the generation each page was last written under (0 = never)."""
        return self._page_gen[layer]

    def forget_generations(self) -> None:
        """Every page unwritten (0): the memory now serves another pool incarnation, whose slots are numbered
        and generated afresh."""
        for a in self._page_gen.values():
            a.fill(0)

    @property
    def generation_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self._page_gen.values())

    def group_layers(self, group: int) -> list[int]:
        return [la for la in range(self.layer_begin, self.layer_end) if self.geometry.layers[la].group == group]
