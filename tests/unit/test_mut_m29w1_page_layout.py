"""kvservice.worker.page_layout.PageLayout against hand-computed fields, the index-space rule of docs/DESIGN.md
(NUMBERING: page p is valid iff base <= p < upper_bound and (p - base - offset) % scale == 0; inside the pool's
[0, pool_pages) but outside the space it is another space's page) written here as a plain loop, and one named
refusal per rule of validate()."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.worker.page_layout import PageLayout


def test_per_layer_fields_by_hand():
    lay = PageLayout.per_layer(7, 16, 4, 128, "bfloat16", base=30, pool_pages=100)
    assert lay == PageLayout(16, 4, 128, "bfloat16", 2 * 16 * 4 * 128, 1, 0, 37, 30, 100, False)
    assert (lay.kv_tensors, lay.num_pages, lay.page_elems, lay.itemsize) == (2, 7, 16384, 2)
    assert lay.required_elems == 7 * 16384
    lay = PageLayout.per_layer(5, 8, 1, 576, "float32", k_only=True)
    assert lay == PageLayout(8, 1, 576, "float32", 8 * 576, 1, 0, 5, 0, 5, True)   # pool_pages defaults to upper
    assert (lay.kv_tensors, lay.page_elems, lay.itemsize, lay.required_elems) == (1, 4608, 4, 5 * 4608)


def test_interleaved_fields_by_hand():
    """Pages of 2 x 4 x 2 x 64 float16 = 2048 bytes in slots of 8192 bytes at byte 6144: scale 4, offset 3."""
    lay = PageLayout.interleaved(6, 8192, 6144, 4, 2, 64, "float16", base=12, pool_pages=80)
    assert lay == PageLayout(4, 2, 64, "float16", 1024, 4, 3, 12 + 24, 12, 80, False)
    assert lay.num_pages == 24 and lay.required_elems == 23 * 1024 + 1024
    assert lay.page_index(np.arange(6)).tolist() == [15, 19, 23, 27, 31, 35]
    assert lay.page_index(2) == 23
    k = PageLayout.interleaved(3, 4096, 1024, 4, 1, 128, "float16", k_only=True)    # 1024-byte pages
    assert (k.scale, k.offset, k.page_stride, k.upper_bound) == (4, 1, 512, 12)
    for sb, bo in ((8192 + 2, 0), (8192, 100), (3000, 2048)):
        with pytest.raises(ValueError) as ei:
            PageLayout.interleaved(6, sb, bo, 4, 2, 64, "float16")
        assert str(ei.value) == f"slot_bytes {sb} and byte_offset {bo} must be multiples of page bytes 2048"


def _rule(p: int, base: int, upper: int, scale: int, offset: int, pool: int) -> int:
    if p < 0 or p >= pool:
        return 1                      # out_of_bounds
    if p < base or p >= upper:
        return 5                      # wrong_index_space
    return 0 if (p - base - offset) % scale == 0 else 2   # off_lattice


@pytest.mark.parametrize(("base", "scale", "offset", "slots", "pool"), [(0, 1, 0, 9, 0), (12, 4, 3, 6, 80),
                                                                        (5, 3, 0, 4, 30), (0, 2, 1, 7, 14)])
def test_reasons_follow_the_numbering_rule(base: int, scale: int, offset: int, slots: int, pool: int):
    upper = base + slots * scale
    lay = PageLayout(4, 1, 64, "float16", 512, scale, offset, upper, base, pool)
    pages = np.arange(-3, max(pool, upper) + 4)
    got = lay.reasons(pages)
    assert got.dtype == np.int8 and got.shape == pages.shape
    assert got.tolist() == [_rule(int(p), base, upper, scale, offset, pool or upper) for p in pages]
    assert (got[lay.page_index(np.arange(slots)) + 3] == 0).all()
    assert int((got == 0).sum()) == slots


def _ok(**kw) -> PageLayout:
    f = {"page_size": 4, "kv_heads": 2, "head_dim": 64, "dtype": "float16", "page_stride": 1024, "scale": 1,
         "offset": 0, "upper_bound": 5, "base": 0, "pool_pages": 0, "k_only": False}
    f.update(kw)
    return PageLayout(**f)


def test_validate_names_each_rule():
    _ok().validate()
    _ok(head_dim=512, page_stride=8192).validate()
    _ok(k_only=True, kv_heads=1, head_dim=24, page_stride=96).validate()      # 24 = 3 x 8 float16 per 16 bytes
    _ok(scale=3, offset=2, upper_bound=15, base=0, pool_pages=15).validate()
    cases = [
        (_ok(dtype="int8"), "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"),
        (_ok(head_dim=48), "head_dim must be one of (32, 64, 128, 256, 512), got 48"),
        (_ok(k_only=True, kv_heads=1, head_dim=20, page_stride=96),
         "a K-only (latent) layer needs kv_heads * head_dim a multiple of 8, got 1 x 20"),
        (_ok(k_only=True, kv_heads=3, head_dim=2, dtype="float32", page_stride=96),
         "a K-only (latent) layer needs kv_heads * head_dim a multiple of 4, got 3 x 2"),
        (_ok(k_only=True, kv_heads=1, head_dim=0, page_stride=96),
         "a K-only (latent) layer needs kv_heads * head_dim a multiple of 8, got 1 x 0"),
        (_ok(page_size=0), "page_size must be positive, got 0"),
        (_ok(kv_heads=-2), "kv_heads must be positive, got -2"),
        (_ok(scale=0), "scale must be positive, got 0"),
        (_ok(upper_bound=3, base=3, pool_pages=3), "num_pages must be positive, got 0"),
        (_ok(scale=2, offset=2, upper_bound=10),
         "index space needs 0 <= offset < scale, base >= 0 and pool_pages >= upper_bound, got offset 2, scale 2, "
         "base 0, pool_pages 10, upper_bound 10"),
        (_ok(offset=-1), "index space needs 0 <= offset < scale, base >= 0 and pool_pages >= upper_bound, got "
                         "offset -1, scale 1, base 0, pool_pages 5, upper_bound 5"),
        (_ok(base=-1), "index space needs 0 <= offset < scale, base >= 0 and pool_pages >= upper_bound, got "
                       "offset 0, scale 1, base -1, pool_pages 5, upper_bound 5"),
        (_ok(pool_pages=4), "index space needs 0 <= offset < scale, base >= 0 and pool_pages >= upper_bound, got "
                            "offset 0, scale 1, base 0, pool_pages 4, upper_bound 5"),
        (_ok(page_size=2**24, kv_heads=1, head_dim=64, page_stride=2**31),
         "a page holds 2147483648 elements; the kernels take fewer than 2^31 per page"),
        (_ok(page_stride=1016), "page_stride 1016 must be >= page elems 1024 and a multiple of 8"),
        (_ok(page_stride=1028), "page_stride 1028 must be >= page elems 1024 and a multiple of 8"),
        (_ok(dtype="float32", page_stride=1026), "page_stride 1026 must be >= page elems 1024 and a multiple of 4"),
    ]
    for lay, msg in cases:
        with pytest.raises(ValueError) as ei:
            lay.validate()
        assert str(ei.value) == msg
    _ok(dtype="float32", page_stride=1028).validate()
    _ok(page_stride=1032).validate()
