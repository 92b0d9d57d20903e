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


def test_the_oracles_page_view_is_the_pages_bytes_or_a_named_refusal():
    """reference.page_view (the float64 oracle's own addressing, from raw byte offsets): page p of a per-layer buffer
    is the view of bytes [slot * page_bytes, + page_bytes) as [2, page_size, kv_heads, head_dim] of the storage dtype,
    writable into the buffer, whatever the buffer's shape (the last page may end at its last byte); a buffer that is
    not C-contiguous, or too short for the page, is refused by name."""
    import numpy as np

    from kvservice.worker.reference import RawLayer, page_view

    raw = RawLayer.per_layer(4, 2, 1, 8, "float16", base=10)           # 2 x 2 x 1 x 8 x 2 = 64-byte pages
    cache = np.arange(4 * 32, dtype=np.float16)
    v = page_view(cache, raw, 12)
    assert v.shape == (2, 2, 1, 8) and v.dtype == np.float16 and v.ravel().tolist() == list(range(64, 96))
    v[0, 0, 0, 0] = -1
    assert cache[64] == -1
    last = page_view(cache, raw, 13)                                  # ends exactly at the buffer's end
    assert last.ravel().tolist() == list(range(96, 128))
    shaped = page_view(cache.reshape(4, 2, 2, 1, 8), raw, 13)        # any C-contiguous shape: its bytes in order
    assert shaped.shape == (2, 2, 1, 8) and shaped.ravel().tolist() == list(range(96, 128))
    with pytest.raises(ValueError) as e:
        page_view(np.zeros((8, 32), np.float16)[:, ::2], raw, 10)
    assert str(e.value) == "cache must be C-contiguous"
    with pytest.raises(IndexError) as e:
        page_view(cache[:100], raw, 13)
    assert str(e.value) == "page 13 ends at byte 256, past the 200-byte buffer"
