"""kvservice.worker.kernel_api against oracles that do not share its code: the violation record's word layout and
reason codes as kernels/paged.cuh defines them, hand-written error messages, hand-computed launch grids (seen by a
spy that records each launch and then runs it on the real CPU emulation backend), and a plain-NumPy float64
attention for the decode results."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # the emulation's 128-thread teams on a small machine

import numpy as np
import pytest

from kvservice.worker import kernel_api as api
from kvservice.worker import kernels_cpu
from kvservice.worker.kernel_api import (
    KernelViolationError,
    PageLayout,
    Policy,
    ViolationRecord,
)

PAGED_CUH = Path(api.__file__).resolve().parent / "kernels" / "paged.cuh"
U64 = 2**64


class Spy:
    """kernel_api.Backend that records each launch (name, grid, block, a copy of the record words) and runs it on
    the real CPU emulation backend."""

    def __init__(self) -> None:
        self.be = kernels_cpu.backend()
        self.xp, self.sms = self.be.xp, self.be.sms
        self.calls: list[tuple[str, tuple[int, ...], int, list[Any]]] = []

    def resident_blocks(self, name: str, block: int) -> int:
        return self.be.resident_blocks(name, block)

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any]) -> None:
        self.calls.append((name, tuple(grid), block, [a.copy() if isinstance(a, np.ndarray) else a for a in args]))
        self.be.launch(name, grid, block, args)

    def ptr(self, a: Any) -> int:
        return self.be.ptr(a)

    def to_host(self, a: Any) -> np.ndarray:
        return self.be.to_host(a)


def _cache(rng: np.random.Generator, slots: int, ps: int, kh: int, d: int) -> tuple[np.ndarray, PageLayout]:
    """float32 per-layer buffer [slots, 2, ps, kh, d] of random non-zero values; page index = slot."""
    buf = (rng.uniform(0.1, 1.0, (slots, 2, ps, kh, d)) * rng.choice([-1, 1], (slots, 2, ps, kh, d)))
    return buf.astype(np.float32), PageLayout.per_layer(slots, ps, kh, d, "float32")


def _attend(q: np.ndarray, buf: np.ndarray, indptr, indices, lpl, scale: float, window: int = 0):
    """Plain float64 decode attention over a [slots, 2, ps, kh, d] buffer (page index = slot)."""
    batch, hq, d = q.shape
    kh, ps = buf.shape[3], buf.shape[2]
    out, lse = np.zeros((batch, hq, d)), np.zeros((batch, hq))
    for r in range(batch):
        pages = indices[indptr[r]:indptr[r + 1]]
        toks = [(int(p), t) for i, p in enumerate(pages) for t in range(ps if i < len(pages) - 1 else lpl[r])]
        if window:
            toks = toks[-window:]
        for h in range(hq):
            kv = h // (hq // kh)
            k = np.array([buf[p, 0, t, kv] for p, t in toks], np.float64)
            v = np.array([buf[p, 1, t, kv] for p, t in toks], np.float64)
            s = k @ q[r, h].astype(np.float64) * scale
            m = s.max()
            e = np.exp(s - m)
            out[r, h], lse[r, h] = e @ v / e.sum(), m + math.log(e.sum())
    return out, lse


# ---- the violation record ---------------------------------------------------------------------------------------
def test_reason_codes_and_record_words_are_paged_cuhs():
    """REASONS[code] is the name of paged.cuh's KV_<NAME> code; new_record_words is the layout paged.cuh's
    comment asks the host for: 8 uint64, all 0 but [1] = KV_NO_KEY; a fresh array each call."""
    src = PAGED_CUH.read_text()
    codes = {int(v): n.lower() for n, v in re.findall(r"#define KV_(\w+) (\d+)\s*$", src, re.M)
             if n not in ("POLICY_NAN", "POLICY_ZEROS", "POLICY_ERROR")}
    assert codes == dict(enumerate(api.REASONS))
    assert {int(v): n for n, v in re.findall(r"#define KV_POLICY_(\w+) (\d+)", src)} == \
        {p.value: p.name for p in Policy}
    no_key = int(re.search(r"#define KV_NO_KEY (0x[0-9a-f]+)ull", src)[1], 16)
    w = api.new_record_words()
    assert w.dtype == np.uint64 and w.tolist() == [0, no_key, 0, 0, 0, 0, 0, 0] == [0, U64 - 1, 0, 0, 0, 0, 0, 0]
    w[:] = 7
    assert api.new_record_words().tolist() == [0, no_key, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("seed", [1, 2])
def test_from_words_reads_count_row_position_value_reason_at_their_documented_words(seed: int):
    """[0] count, [2] row, [3] position, [4] value (signed, two's complement), [5] reason; [1] (first key),
    [6] (ticket) and [7] (unused) are not part of the record."""
    rng = np.random.default_rng(seed)
    for code, reason in enumerate(api.REASONS[1:], start=1):
        count, row, pos, value = (int(rng.integers(1, 1000)), int(rng.integers(0, 500)),
                                  int(rng.integers(-1, 300)), int(rng.integers(-2**40, 2**40)))
        w = [count, int(rng.integers(0, 2**63)), row % U64, pos % U64, value % U64, code,
             int(rng.integers(1, 2**63)), int(rng.integers(1, 2**63))]
        rec = ViolationRecord.from_words("kname", np.array(w, dtype=np.uint64))
        assert rec == ViolationRecord("kname", count, row, pos, value, reason)
        assert bool(rec) is True
    clean = np.array([0, 5, 6, 7, 8, 3, 9, 9], dtype=np.uint64)  # count 0: the other words are leftovers
    assert ViolationRecord.from_words("k2", clean) == ViolationRecord("k2", 0, -1, -1, 0, None)
    assert bool(ViolationRecord.from_words("k2", clean)) is False


def test_violation_error_names_kernel_count_row_position_value_and_reason():
    rec = ViolationRecord("decode_attention", 3, 2, -1, -7, "bad_indptr")
    err = KernelViolationError(rec)
    assert isinstance(err, RuntimeError)
    assert str(err) == ("decode_attention: 3 page-table violation(s); first at row 2, position -1: value -7 "
                        "(bad_indptr)")
    assert err.record is rec


def test_kernel_call_reads_its_record_once_and_raises_only_under_error_policy():
    reads = []

    def to_host(w):
        reads.append(1)
        return w

    words = np.array([2, 0, 4, 1, 9, 2, 0, 0], dtype=np.uint64)
    call = api.KernelCall("copy_blocks", words, to_host)
    assert reads == []                              # lazily
    assert call.record == ViolationRecord("copy_blocks", 2, 4, 1, 9, "off_lattice")
    assert call.record is call.record and reads == [1]
    call.raise_if(Policy.NAN)
    call.raise_if(Policy.ZEROS)
    with pytest.raises(KernelViolationError) as ei:
        call.raise_if(Policy.ERROR)
    assert ei.value.record == call.record
    empty = api.KernelCall("append_kv", None, to_host)  # nothing launched: a clean record of that kernel
    assert empty.record == ViolationRecord("append_kv") and reads == [1]
    empty.raise_if(Policy.ERROR)


# ---- argument checks --------------------------------------------------------------------------------------------
def test_check_array_each_rule_with_its_message():
    a = np.zeros((3, 5, 2), dtype=np.int32)
    api.check_array("a", a, (3, None, 2), np.int32, "[x, y, z]")           # None: any extent
    api.check_array("a", a, (None, None, None), np.int32, "[x, y, z]")
    with pytest.raises(TypeError, match=r"^a: expected an array \[x, y, z\], got list$"):
        api.check_array("a", [1, 2], (2,), np.int32, "[x, y, z]")
    for shape in ((3, 5), (3, 5, 2, 1), (3, 4, 2), (4, None, 2), (None, 5, 3)):
        want = f"a: expected shape [x, y, z] = {shape}, got (3, 5, 2)"
        with pytest.raises(ValueError) as ei:
            api.check_array("a", a, shape, np.int32, "[x, y, z]")
        assert str(ei.value) == want
    with pytest.raises(TypeError, match=r"^a: expected dtype int64, got int32$"):
        api.check_array("a", a, (3, 5, 2), np.int64, "[x, y, z]")
    with pytest.raises(ValueError, match=r"^a: must be C-contiguous$"):
        api.check_array("a", np.zeros((5, 3, 2), np.int32).transpose(1, 0, 2), (3, 5, 2), np.int32, "[x, y, z]")


def test_check_cache_each_rule_with_its_message():
    lay = PageLayout.per_layer(3, 4, 2, 32, "float16")       # page elems 2*4*2*32 = 512; 3 pages: 1536
    buf = np.zeros(1536 + 8, np.float16)
    api.check_cache("c", buf, lay, buf.ctypes.data & ~15)
    with pytest.raises(TypeError, match=r"^c: expected dtype float16 for float16, got float32$"):
        api.check_cache("c", np.zeros(1536, np.float32), lay, 0)
    with pytest.raises(ValueError, match=r"^c: must be C-contiguous$"):
        api.check_cache("c", np.zeros((1536, 2), np.float16)[:, 0], lay, 0)
    with pytest.raises(ValueError) as ei:
        api.check_cache("c", np.zeros(1535, np.float16), lay, 0)
    assert str(ei.value) == "c: layout needs 1536 elements (3 pages x page_stride 512), buffer has 1535"
    for ptr in (8, 4, 2, 17):
        with pytest.raises(ValueError, match=r"^c: base address must be 16-byte aligned$"):
            api.check_cache("c", buf, lay, ptr)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        api.check_cache("c", buf, PageLayout(4, 2, 48, "float16", 512, upper_bound=3), 0)


def test_check_csr_returns_batch_and_names_each_array():
    ip, idx, lpl = np.array([0, 2, 3], np.int32), np.array([4, 1, 2], np.int32), np.array([3, 1], np.int32)
    assert api.check_csr(ip, idx, lpl) == 2
    assert api.check_csr(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)) == 0
    for bad in (np.zeros(0, np.int32), np.zeros((2, 2), np.int32), [0, 1]):
        with pytest.raises(ValueError, match=r"^indptr: expected shape \[batch \+ 1\]$"):
            api.check_csr(bad, idx, lpl)
    with pytest.raises(TypeError, match=r"^indptr: expected dtype int32, got int64$"):
        api.check_csr(ip.astype(np.int64), idx, lpl)
    with pytest.raises(TypeError, match=r"^indices: expected dtype int32, got int64$"):
        api.check_csr(ip, idx.astype(np.int64), lpl)
    with pytest.raises(ValueError, match=r"^last_page_len: expected shape \[batch\] = \(2,\), got \(3,\)$"):
        api.check_csr(ip, idx, np.array([1, 1, 1], np.int32))


def test_empty_batch_record_follows_pagetable_rule_one():
    assert api.empty_batch_record("k", np.array([0], np.int32), 0) == ViolationRecord("k")
    assert api.empty_batch_record("k", np.array([5], np.int32), 0) == ViolationRecord("k", 1, -1, -1, 5, "bad_indptr")
    assert api.empty_batch_record("k", np.array([0], np.int32), 3) == ViolationRecord("k", 1, -1, -1, 0, "bad_indptr")
    assert api.empty_batch_record("k", np.array([-4], np.int32), 2) == \
        ViolationRecord("k", 1, -1, -1, -4, "bad_indptr")


def test_distinct_slots_and_copy_pairs_checks_on_host_arrays():
    api.check_distinct_slots(np, np.array([5, -1, -1, 7, 2], np.int64))     # SKIP_SLOT may repeat
    api.check_distinct_slots(np, np.array([5], np.int64))
    api.check_distinct_slots(np, np.array([-1, -1], np.int64))
    api.check_distinct_slots(np, np.array([-1, 4, -1], np.int64))
    for sm, v in (([4, 4], 4), ([5, -1, 5], 5), ([0, 3, 0], 0)):
        with pytest.raises(ValueError) as ei:
            api.check_distinct_slots(np, np.array(sm, np.int64))
        assert str(ei.value) == (f"slot_mapping: slot {v} appears more than once; every token needs its own slot "
                                 "(duplicate writes are unordered on a GPU), nothing was written")
    with pytest.raises(ValueError, match=r"^slot_mapping: slot 7 appears more than once;"):
        api.check_distinct_slots(np, np.array([9, 7, -1, 3, 7, 9], np.int64))
    api.check_copy_pairs(np, np.zeros((0, 2), np.int64))
    api.check_copy_pairs(np, np.array([[1, 2], [1, 3], [4, 5]], np.int64))  # a source may repeat
    with pytest.raises(ValueError, match=r"^pairs: destination slot 3 appears more than once; .*nothing was copied$"):
        api.check_copy_pairs(np, np.array([[1, 3], [2, 3], [6, 8], [7, 8]], np.int64), "slot")
    with pytest.raises(ValueError, match=r"^pairs: page 5 is both a source and a destination; copy in two calls"):
        api.check_copy_pairs(np, np.array([[9, 4], [5, 6], [2, 5]], np.int64))
    with pytest.raises(ValueError) as ei:
        api.check_copy_pairs(np, np.array([[1, 3], [2, 3]], np.int64))
    assert str(ei.value) == "pairs: destination page 3 appears more than once; destinations must be distinct, " \
                            "nothing was copied"
    with pytest.raises(ValueError) as ei:
        api.check_copy_pairs(np, np.array([[4, 4]], np.int64))
    assert str(ei.value) == "pairs: page 4 is both a source and a destination; copy in two calls, nothing was copied"


# ---- decode: refusals and outputs -------------------------------------------------------------------------------
def test_decode_names_a_wrong_out_or_lse_and_refuses_k_only():
    rng = np.random.default_rng(31)
    buf, lay = _cache(rng, 6, 4, 2, 64)
    ip, idx, lpl = np.array([0, 2, 3], np.int32), np.array([4, 1, 2], np.int32), np.array([3, 1], np.int32)
    q = rng.uniform(0.1, 1, (2, 4, 64)).astype(np.float32)
    with pytest.raises(ValueError) as ei:
        kernels_cpu.decode_attention(q, buf, lay, ip, idx, lpl, out=np.zeros((2, 4, 32), np.float32))
    assert str(ei.value) == "out: expected shape [batch, num_q_heads, head_dim] = (2, 4, 64), got (2, 4, 32)"
    with pytest.raises(TypeError) as ei:
        kernels_cpu.decode_attention(q, buf, lay, ip, idx, lpl, out=np.zeros((2, 4, 64), np.float64))
    assert str(ei.value) == "out: expected dtype float32, got float64"
    with pytest.raises(ValueError) as ei:
        kernels_cpu.decode_attention(q, buf, lay, ip, idx, lpl, lse=np.zeros((2, 2), np.float32))
    assert str(ei.value) == "lse: expected shape [batch, num_q_heads] = (2, 4), got (2, 2)"
    k_only = PageLayout.per_layer(6, 4, 2, 64, "float32", k_only=True)
    with pytest.raises(ValueError) as ei:
        kernels_cpu.decode_attention(q, buf, k_only, ip, idx, lpl)
    assert str(ei.value) == ("decode attention over a multi-head latent attention (MLA) latent cache is not "
                             "implemented by these kernels (they attend K and V per head); run an MLA decode "
                             "kernel (FlashMLA, FlashInfer's MLA) on the same page tables")
    with pytest.raises(ValueError, match=r"^cache: layout needs 6144 elements \(6 pages x page_stride 1024\)"):
        kernels_cpu.decode_attention(q, buf.reshape(-1)[:3000].copy(), lay, ip, idx, lpl)


def test_decode_fills_caller_outputs_in_place():
    rng = np.random.default_rng(32)
    buf, lay = _cache(rng, 8, 4, 1, 32)
    ip, idx, lpl = np.array([0, 3], np.int32), np.array([6, 0, 3], np.int32), np.array([2], np.int32)
    q = rng.uniform(0.1, 1, (1, 2, 32)).astype(np.float32)
    out, lse = np.full((1, 2, 32), 5.0, np.float32), np.full((1, 2), 5.0, np.float32)
    call = kernels_cpu.decode_attention(q, buf, lay, ip, idx, lpl, out=out, lse=lse, kv_chunk_pages=0)
    assert call.out is out and call.lse is lse
    want_out, want_lse = _attend(q, buf, ip, idx, lpl, 1 / math.sqrt(32))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)


# ---- launches: grids, entries and results -----------------------------------------------------------------------
def test_single_pass_decode_launch_and_result():
    """batch 2, kv_heads 2, 8 q heads (group 4 -> the g4 entry, one head chunk per kv head), head_dim 64: grid
    (2, 2, 1), pages-per-split argument 0; output equal to a float64 attention with sm_scale 0.3."""
    rng = np.random.default_rng(33)
    buf, lay = _cache(rng, 10, 4, 2, 64)
    ip, idx, lpl = np.array([0, 3, 5], np.int32), np.array([7, 2, 9, 0, 5], np.int32), np.array([1, 4], np.int32)
    q = rng.uniform(-1, 1, (2, 8, 64)).astype(np.float32)
    spy = Spy()
    call = api.decode_attention(spy, q, buf, lay, ip, idx, lpl, sm_scale=0.3, kv_chunk_pages=0)
    [(name, grid, block, args)] = spy.calls
    assert (name, grid, block) == ("kv_decode_f32_g4_d64", (2, 2, 1), 128)
    assert args[-1].tolist() == [0, U64 - 1, 0, 0, 0, 0, 0, 0]          # fresh record words
    # q, cache, page geometry (stride, page_size, kv_heads, head_dim), index space (scale, offset, base, upper
    # bound, pool pages), the table, nnz, batch, q heads, window, sm_scale, pages per split, policy
    assert args[2:11] == [1024, 4, 2, 64, 1, 0, 0, 10, 10] and args[14:18] == [5, 2, 8, 0]
    assert args[18] == np.float32(0.3) and args[19:21] == [0, 0]
    want_out, want_lse = _attend(q, buf, ip, idx, lpl, 0.3)
    np.testing.assert_allclose(call.out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(call.lse, want_lse, rtol=1e-5, atol=1e-6)
    assert call.record == ViolationRecord("decode_attention")


def test_split_decode_plans_hand_computed_splits_and_merges():
    """One row of 40 pages, 1 kv head, 1 q head, on the CPU backend (4 SMs x 2 resident blocks = 8 slots): the
    automatic plan is 5 pages per split (fewest splits to keep >= 90% of the 8 slots busy: 8 splits), grid
    (1, 1, 8), then kv_decode_merge over (batch, q heads, 1) = (1, 1, 1). max_pages given by the caller plans
    the same without reading indptr; a window of 9 tokens (page_size 4: at most 4 pages) does not split."""
    rng = np.random.default_rng(34)
    buf, lay = _cache(rng, 48, 4, 1, 32)
    idx = rng.permutation(48)[:40].astype(np.int32)
    ip, lpl = np.array([0, 40], np.int32), np.array([3], np.int32)
    q = rng.uniform(-1, 1, (1, 1, 32)).astype(np.float32)
    want_out, want_lse = _attend(q, buf, ip, idx, lpl, 1 / math.sqrt(32))
    for kw in ({}, {"max_pages": 40}):
        spy = Spy()
        call = api.decode_attention(spy, q, buf, lay, ip, idx, lpl, **kw)
        (n1, g1, b1, a1), (n2, g2, b2, a2) = spy.calls
        assert (n1, g1, b1, n2, g2, b2) == ("kv_decode_f32_g1_d32", (1, 1, 8), 128, "kv_decode_merge", (1, 1, 1), 128)
        assert a1[19:21] == [5, 0] and a2[3:8] == [8, 1, 1, 32, 0]      # splits, batch, hq, head_dim, policy
        np.testing.assert_allclose(call.out, want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(call.lse, want_lse, rtol=1e-5, atol=1e-6)
    spy = Spy()
    api.decode_attention(spy, q, buf, lay, ip, idx, lpl, kv_chunk_pages=7, policy=Policy.ZEROS)
    (_, g1, _, a1), (_, g2, _, a2) = spy.calls
    assert a1[19:21] == [7, int(Policy.ZEROS)] and g1 == (1, 1, 6)        # ceil(40 / 7) splits
    assert g2 == (1, 1, 1) and a2[3] == 6 and a2[7] == int(Policy.ZEROS)
    spy = Spy()
    call = api.decode_attention(spy, q, buf, lay, ip, idx, lpl, window=9)
    [(_, grid, _, _)] = spy.calls
    assert grid == (1, 1, 1)
    w_out, w_lse = _attend(q, buf, ip, idx, lpl, 1 / math.sqrt(32), window=9)
    np.testing.assert_allclose(call.out, w_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(call.lse, w_lse, rtol=1e-5, atol=1e-6)
    # a window bounds the pages a split plans for: (window - 1) // page_size + 2 pages; 8 (= 2 x MIN_SPLIT_PAGES)
    # is the least that splits: window 24 -> 7 pages, one pass; window 25 -> 8 pages, 2 splits of 4
    for window, grid, pps in ((24, (1, 1, 1), 0), (25, (1, 1, 2), 4)):
        spy = Spy()
        call = api.decode_attention(spy, q, buf, lay, ip, idx, lpl, window=window)
        assert spy.calls[0][1] == grid and spy.calls[0][3][17:20] == [window, np.float32(1 / math.sqrt(32)), pps]
        np.testing.assert_allclose(call.out, _attend(q, buf, ip, idx, lpl, 1 / math.sqrt(32), window=window)[0],
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"^kv_chunk_pages 1 gives 70000 splits \(max 65535\)$"):
        api.decode_attention(Spy(), q, buf, lay, ip, idx, lpl, kv_chunk_pages=1, max_pages=70000)


def test_decode_groups_of_heads_per_kv_head():
    """6 q heads over 2 kv heads (group 3 -> g4 entry, 1 chunk per kv head): grid y 2; 8 q heads over 1 kv head
    at head_dim 512 (4 heads per block at most): 2 chunks."""
    rng = np.random.default_rng(35)
    for kh, hq, d, entry, groups in ((2, 6, 64, "kv_decode_f32_g4_d64", 2), (1, 8, 512, "kv_decode_f32_g4_d512", 2),
                                     (2, 2, 32, "kv_decode_f32_g1_d32", 2), (1, 16, 32, "kv_decode_f32_g8_d32", 2)):
        buf, lay = _cache(rng, 4, 2, kh, d)
        ip, idx, lpl = np.array([0, 2], np.int32), np.array([3, 1], np.int32), np.array([1], np.int32)
        q = rng.uniform(-1, 1, (1, hq, d)).astype(np.float32)
        spy = Spy()
        call = api.decode_attention(spy, q, buf, lay, ip, idx, lpl, kv_chunk_pages=0)
        assert [(c[0], c[1]) for c in spy.calls] == [(entry, (1, groups, 1))]
        np.testing.assert_allclose(call.out, _attend(q, buf, ip, idx, lpl, 1 / math.sqrt(d))[0], rtol=1e-5,
                                   atol=1e-6)


def test_decode_violation_record_names_decode_attention_and_error_policy_raises_it():
    rng = np.random.default_rng(36)
    buf, lay = _cache(rng, 6, 4, 1, 32)
    ip, idx, lpl = np.array([0, 1, 3], np.int32), np.array([2, 4, 9], np.int32), np.array([4, 2], np.int32)
    q = rng.uniform(-1, 1, (2, 1, 32)).astype(np.float32)
    for split in (0, None):
        call = api.decode_attention(Spy(), q, buf, lay, ip, idx, lpl, kv_chunk_pages=split, max_pages=2)
        assert call.record == ViolationRecord("decode_attention", 1, 1, 2, 9, "out_of_bounds")
        assert np.isnan(call.out[1]).all() and not np.isnan(call.out[0]).any()
    with pytest.raises(KernelViolationError) as ei:
        api.decode_attention(Spy(), q, buf, lay, ip, idx, lpl, policy=Policy.ERROR)
    assert ei.value.record == ViolationRecord("decode_attention", 1, 1, 2, 9, "out_of_bounds")
    empty = api.decode_attention(Spy(), q[:0], buf, lay, np.array([2], np.int32), idx[:0], lpl[:0])
    assert empty.record == ViolationRecord("decode_attention", 1, -1, -1, 2, "bad_indptr")
    assert empty.out.shape == (0, 1, 32) and empty.lse.shape == (0, 1)
    with pytest.raises(KernelViolationError):
        api.decode_attention(Spy(), q[:0], buf, lay, np.array([2], np.int32), idx[:0], lpl[:0], policy=Policy.ERROR)


def test_append_launch_grid_record_and_writes():
    """n tokens: grid (n, 1, 1); a repeated slot is refused before any launch; an out-of-range token is recorded
    under append_kv and is the only one not written."""
    rng = np.random.default_rng(37)
    buf, lay = _cache(rng, 5, 4, 2, 32)
    k = rng.uniform(-1, 1, (4, 2, 32)).astype(np.float32)
    v = rng.uniform(-1, 1, (4, 2, 32)).astype(np.float32)
    sm = np.array([13, 2, 40, 19], np.int64)          # page 3 off 1, page 0 off 2, page 10 (out), page 4 off 3
    spy, before = Spy(), buf.copy()
    call = api.append_kv(spy, buf, lay, k, v, sm)
    [(name, grid, block, args)] = spy.calls
    assert (name, grid, block) == ("kv_append", (4, 1, 1), 128) and args[-1].tolist() == [0, U64 - 1, 0, 0, 0, 0, 0, 0]
    assert call.record == ViolationRecord("append_kv", 1, 2, 2, 40, "out_of_bounds")
    expect = before.copy()
    for i, s in enumerate(sm):
        if s != 40:
            expect[s // 4, 0, s % 4], expect[s // 4, 1, s % 4] = k[i], v[i]
    assert np.array_equal(buf, expect)
    with pytest.raises(KernelViolationError) as ei:
        api.append_kv(Spy(), buf, lay, k, v, sm, policy=Policy.ERROR)
    assert ei.value.record.kernel == "append_kv"
    spy = Spy()
    with pytest.raises(ValueError, match="slot 2 appears more than once"):
        api.append_kv(spy, buf, lay, k, v, np.array([2, 5, 2, 9], np.int64))
    assert spy.calls == []
    spy = Spy()
    empty = api.append_kv(spy, buf, lay, k[:0], v[:0], sm[:0])
    assert spy.calls == [] and empty.record == ViolationRecord("append_kv")


def test_copy_and_validate_launch_grids_and_records():
    rng = np.random.default_rng(38)
    bufs = [_cache(rng, 6, 2, 1, 32)[0] for _ in range(3)]
    lay = PageLayout.per_layer(6, 2, 1, 32, "float32")
    before = [b.copy() for b in bufs]
    pairs = np.array([[1, 4], [0, 7], [2, 5]], np.int64)
    spy = Spy()
    call = api.copy_blocks(spy, bufs, lay, pairs)
    [(name, grid, block, args)] = spy.calls
    assert (name, grid, block) == ("kv_copy_blocks", (3, 3, 1), 128)
    assert call.record == ViolationRecord("copy_blocks", 1, 1, 1, 7, "out_of_bounds")
    for b, b0 in zip(bufs, before, strict=True):
        expect = b0.copy()
        expect[4], expect[5] = b0[1], b0[2]
        assert np.array_equal(b, expect)
    with pytest.raises(KernelViolationError) as ei:
        api.copy_blocks(Spy(), bufs, lay, pairs, policy=Policy.ERROR)
    assert ei.value.record.kernel == "copy_blocks"
    with pytest.raises(ValueError, match=r"^caches: need at least one buffer$"):
        api.copy_blocks(Spy(), [], lay, pairs)
    with pytest.raises(ValueError, match=r"^pairs: expected shape \[n, 2\] = \(-1, 2\), got \(6,\)$"):
        api.copy_blocks(Spy(), bufs, lay, pairs.reshape(-1))
    with pytest.raises(ValueError, match=r"^page_gens: one record per buffer of caches \(3\), got 2$"):
        api.copy_blocks(Spy(), bufs, lay, pairs, page_gens=[np.zeros(6, np.uint32)] * 2)
    assert api.copy_blocks(Spy(), bufs, lay, pairs[:0]).record == ViolationRecord("copy_blocks")
    ip, idx, lpl = np.array([0, 1, 3, 4], np.int32), np.array([2, 4, 6, 1], np.int32), np.array([2, 1, 3], np.int32)
    spy = Spy()
    res = api.validate_page_table(spy, ip, idx, lpl, lay)
    [(name, grid, block, args)] = spy.calls
    assert (name, grid, block) == ("kv_validate_page_table", (3, 1, 1), 128)
    assert args[3:11] == [3, 4, 2, 1, 0, 0, 6, 6]     # batch, nnz, page_size, index space
    # row 1: page 6 out of bounds (bit 0); row 2: last_page_len 3 > page_size 2 (bad_last_page_len, bit 2)
    assert res.row_status.tolist() == [0, 1, 4]
    assert res.record == ViolationRecord("validate_page_table", 2, 1, 2, 6, "out_of_bounds")
    empty = api.validate_page_table(Spy(), np.array([1], np.int32), idx[:0], lpl[:0], lay)
    assert empty.row_status.shape == (0,) and empty.record == ViolationRecord("validate_page_table", 1, -1, -1, 1,
                                                                                "bad_indptr")


def test_widen_launch_blocks_and_values():
    """ceil(n / (128 threads x 8 per 16 bytes)) blocks, at most 1024; exact float32 of each float16/bfloat16."""
    rng = np.random.default_rng(39)
    for n, blocks in ((8, 1), (1024, 1), (1032, 2), (3000, 3)):
        x = rng.uniform(-4, 4, n).astype(np.float16)
        spy = Spy()
        out = api.widen(spy, x, "float16")
        assert [(c[0], c[1]) for c in spy.calls] == [("kv_widen_f16", (blocks, 1, 1))]
        assert np.array_equal(out, x.astype(np.float32))
        f = rng.uniform(-4, 4, n).astype(np.float32)
        bits = (f.view(np.uint32) >> 16).astype(np.uint16)
        spy = Spy()
        out = api.widen(spy, bits, "bfloat16")
        assert [(c[0], c[1]) for c in spy.calls] == [("kv_widen_bf16", (blocks, 1, 1))]
        assert np.array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)
    spy = Spy()
    assert api.widen(spy, np.zeros(0, np.float16), "float16").shape == (0,) and spy.calls == []
    with pytest.raises(ValueError, match=r"^dtype must be float16 or bfloat16, got 'float32'$"):
        api.widen(Spy(), np.zeros(8, np.float32), "float32")


def test_append_refusals_name_the_argument():
    rng = np.random.default_rng(40)
    buf, lay = _cache(rng, 4, 4, 1, 32)
    k = rng.uniform(-1, 1, (2, 1, 32)).astype(np.float32)
    with pytest.raises(TypeError) as ei:
        api.append_kv(Spy(), buf, lay, k, k, [1, 2])
    assert str(ei.value) == "slot_mapping: expected an array [n], got list"
    with pytest.raises(ValueError) as ei:
        api.append_kv(Spy(), buf, lay, k, k[:, :, :16].copy(), np.array([1, 2], np.int64))
    assert str(ei.value) == "v: expected shape [n, kv_heads, head_dim] = (2, 1, 32), got (2, 1, 16)"
    with pytest.raises(TypeError) as ei:
        api.append_kv(Spy(), buf, lay, k, None, np.array([1, 2], np.int64))
    assert str(ei.value) == "v: expected an array [n, kv_heads, head_dim], got NoneType"
    k_only = PageLayout.per_layer(4, 4, 1, 32, "float32", k_only=True)
    with pytest.raises(ValueError) as ei:
        api.append_kv(Spy(), buf, k_only, k, k, np.array([1, 2], np.int64))
    assert str(ei.value) == ("v: this layer is K-only (a multi-head latent attention latent cache); send the latent "
                             "vectors as k and no v")
    spy, before = Spy(), buf.copy()
    call = api.append_kv(spy, buf, k_only, k, None, np.array([6, 1], np.int64))   # K-only pages: 4 x 32 floats
    assert call.record == ViolationRecord("append_kv") and spy.calls[0][3][1] == api.NULL
    flat, old = buf.reshape(-1), before.reshape(-1)
    expect = old.copy()
    expect[6 * 32:7 * 32], expect[32:64] = k[0, 0], k[1, 0]
    assert np.array_equal(flat, expect)
    with pytest.raises(ValueError, match=r"^x: base address must be 16-byte aligned$"):
        api.widen(Spy(), np.zeros(40, np.float16)[1:33], "float16")


def test_each_call_names_its_generations_argument_and_shape():
    """append's per-token generations are slot_generations [n]; decode's and validate's per-entry ones
    generations [nnz]; copy's per-pair ones generations [n, 2]; the page records are uint32 [num_pages]."""
    rng = np.random.default_rng(41)
    buf, lay = _cache(rng, 4, 4, 1, 32)
    pg = np.zeros(4, np.uint32)
    k = rng.uniform(-1, 1, (2, 1, 32)).astype(np.float32)
    ip, idx, lpl = np.array([0, 3], np.int32), np.array([0, 2, 1], np.int32), np.array([2], np.int32)
    q = rng.uniform(-1, 1, (1, 1, 32)).astype(np.float32)
    g2, g3 = np.zeros(2, np.uint32), np.zeros(3, np.uint32)
    calls = [
        (lambda g: api.append_kv(Spy(), buf, lay, k, k, np.array([1, 6], np.int64), slot_generations=g, page_gen=pg),
         g3, "slot_generations: expected shape [n] = (2,), got (3,)"),
        (lambda g: api.decode_attention(Spy(), q, buf, lay, ip, idx, lpl, generations=g, page_gen=pg),
         g2, "generations: expected shape [nnz] = (3,), got (2,)"),
        (lambda g: api.validate_page_table(Spy(), ip, idx, lpl, lay, generations=g, page_gen=pg),
         g2, "generations: expected shape [nnz] = (3,), got (2,)"),
        (lambda g: api.copy_blocks(Spy(), [buf], lay, np.array([[0, 3]], np.int64), generations=g, page_gens=[pg]),
         g2, "generations: expected shape [n, 2] = (1, 2), got (2,)"),
    ]
    for call, bad, msg in calls:
        with pytest.raises(ValueError) as ei:
            call(bad)
        assert str(ei.value) == msg
    with pytest.raises(ValueError) as ei:
        api.validate_page_table(Spy(), ip, idx, lpl, lay, generations=g3, page_gen=np.zeros(5, np.uint32))
    assert str(ei.value) == "page_gen: expected shape [num_pages] (one per page of the layer) = (4,), got (5,)"
    # matching generations: a clean table stays clean, and the page records travel to the kernel
    spy = Spy()
    res = api.validate_page_table(spy, ip, idx, lpl, lay, generations=g3, page_gen=pg)
    assert res.record == ViolationRecord("validate_page_table") and res.row_status.tolist() == [0]
    assert spy.calls[0][3][11] is not None and np.array_equal(spy.calls[0][3][11], g3)
    stale = np.array([0, 5, 0], np.uint32)              # entry 1 (page 2) written under generation 5, page is at 0
    res = api.validate_page_table(Spy(), ip, idx, lpl, lay, generations=stale, page_gen=pg)
    assert res.record == ViolationRecord("validate_page_table", 1, 0, 1, 2, "stale_page")


def test_decode_names_a_q_that_is_not_three_dimensional_with_the_heads_it_cannot_know():
    """A q without a heads axis cannot say its head count: the refusal shows it as -1, the shape it expected."""
    rng = np.random.default_rng(33)
    buf, lay = _cache(rng, 6, 4, 2, 64)
    ip, idx, lpl = np.array([0, 2, 3], np.int32), np.array([4, 1, 2], np.int32), np.array([3, 1], np.int32)
    for shape in ((2, 64), (2, 1, 4, 64)):
        q = rng.uniform(0.1, 1, shape).astype(np.float32)
        with pytest.raises(ValueError) as ei:
            kernels_cpu.decode_attention(q, buf, lay, ip, idx, lpl)
        assert str(ei.value) == f"q: expected shape [batch, num_q_heads, head_dim] = (2, -1, 64), got {shape}"
