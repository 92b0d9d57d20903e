"""64-bit addressing: read and write a page whose byte offset is past 2^32.
np.zeros of > 4 GiB commits memory lazily; only the touched pages are used."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOL, rand, rel_err

from kvservice.worker import kernels_cpu, ops_numpy, reference
from kvservice.worker.kernel_api import PageLayout
from kvservice.worker.reference import RawLayer

PS, KH, D = 16, 8, 128  # float16 page = 64 KiB
NUM_SLOTS = 2**16 + 8  # 4 GiB + 512 KiB


@pytest.fixture(scope="module")
def big() -> tuple[np.ndarray, PageLayout]:
    layout = PageLayout.per_layer(NUM_SLOTS, PS, KH, D, "float16")
    try:
        cache = np.zeros(NUM_SLOTS * layout.page_elems, dtype=np.float16)
    except MemoryError:
        pytest.skip("cannot reserve 4 GiB of virtual memory")
    return cache, layout


@pytest.mark.parametrize("ops", [kernels_cpu, ops_numpy], ids=["emu", "numpy"])
def test_page_past_4gib(big: tuple[np.ndarray, PageLayout], ops) -> None:
    cache, layout = big
    raw = RawLayer.per_layer(NUM_SLOTS, PS, KH, D, "float16")
    high = 2**16 + 1  # byte offset (2^16 + 1) * 2^16 > 2^32; wraps to page 1 in 32 bits
    assert high * layout.page_elems * 2 > 2**32
    rng = np.random.default_rng(40)
    n = 20
    k, v = rand(rng, (n, KH, D), "float16"), rand(rng, (n, KH, D), "float16")
    sm = np.concatenate([3 * PS + np.arange(PS), high * PS + np.arange(n - PS)]).astype(np.int64)
    assert ops.append_kv(cache, layout, k, v, sm).record.count == 0
    page = reference.page_view(cache, raw, high)
    assert np.array_equal(page[0, : n - PS], k[PS:]) and np.array_equal(page[1, : n - PS], v[PS:])
    for wrapped in (0, 1, 2):  # where 32-bit offsets would have landed
        assert not reference.page_view(cache, raw, wrapped).any()
    # copy the high page further up, then attend over [3, high, high + 2]
    assert ops.copy_blocks([cache], layout, np.array([[high, high + 2]], dtype=np.int64)).record.count == 0
    assert np.array_equal(reference.page_view(cache, raw, high + 2), page)
    indptr = np.array([0, 3], dtype=np.int32)
    indices = np.array([3, high, high + 2], dtype=np.int32)
    lpl = np.array([n - PS], dtype=np.int32)
    q = rand(rng, (1, 16, D), "float16")
    res = ops.decode_attention(q, cache, layout, indptr, indices, lpl, kv_chunk_pages=1)
    out, _ = reference.decode_attention_ref(q, cache, raw, indptr, indices, lpl)
    assert rel_err(res.out, out) <= TOL["float16"]
    for p in (3, high, high + 2):  # leave the module fixture clean
        reference.page_view(cache, raw, p)[...] = 0


def test_a_page_of_2_31_elements_is_refused() -> None:
    """Offsets inside a page are 32-bit in the kernels (page strides and bases stay 64-bit): a layout whose
    page holds 2^31 elements is refused before any kernel runs, one of 2^30 is not."""
    huge = PageLayout.per_layer(4, 2**16, 128, 128, "float16")  # 2 x 2^16 x 2^7 x 2^7 = 2^31 elements
    with pytest.raises(ValueError, match=r"a page holds 2147483648 elements; the kernels take fewer than 2\^31"):
        huge.validate()
    cache, k = np.zeros(16, dtype=np.float16), np.zeros((1, 128, 128), dtype=np.float16)
    with pytest.raises(ValueError, match=r"fewer than 2\^31 per page"):
        kernels_cpu.append_kv(cache, huge, k, k, np.zeros(1, dtype=np.int64))
    PageLayout.per_layer(4, 2**15, 128, 128, "float16").validate()
