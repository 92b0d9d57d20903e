"""Two small worker modules pinned further: launch_plan.decode_geometry holds ints (as DecodeGeometry declares; the
kernels take them as compile-time integers) for every entry; PageLayout's constructors default to base 0 and a
pool of exactly the layer's space, with integer fields, and validate() takes any K-only row of whole 16-byte pieces
(kv_heads x head_dim a multiple of the vector width, however it splits)."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice.worker.launch_plan import ENTRY, HEAD_DIMS, decode_geometry
from kvservice.worker.page_layout import PageLayout


def test_every_decode_geometry_field_is_an_int():
    for dtype in ENTRY:
        for heads in (1, 4, 8):
            for d in HEAD_DIMS:
                g = decode_geometry(dtype, heads, d)
                bad = {f.name: v for f in dataclasses.fields(g) if type(v := getattr(g, f.name)) is not int}
                assert not bad, (dtype, heads, d, bad)


def test_the_constructors_default_to_a_pool_of_the_layers_own_space_at_base_0():
    il = PageLayout.interleaved(5, 8192, 6144, 4, 2, 64, "float16")
    assert (il.base, il.pool_pages, il.upper_bound, il.scale, il.offset) == (0, 20, 20, 4, 3)
    assert all(type(getattr(il, f.name)) is int for f in dataclasses.fields(il) if f.type in ("int", int))
    pl = PageLayout.per_layer(9, 4, 2, 64, "float16")
    assert (pl.base, pl.pool_pages, pl.upper_bound, pl.scale, pl.offset) == (0, 9, 9, 1, 0)
    il.validate()
    pl.validate()


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(8, 1), (2, 4), (4, 2), (1, 8)])
def test_a_k_only_row_of_whole_16_byte_pieces_is_taken_however_it_splits(kv_heads, head_dim):
    """float16: 8 elements per 16 bytes; kv_heads x head_dim = 8 in each case."""
    elems = 4 * kv_heads * head_dim
    PageLayout(4, kv_heads, head_dim, "float16", elems, 1, 0, 3, 0, 3, True).validate()
