"""Page generations on every kernel that reads or writes through a table (emulated CUDA and NumPy).

The manager's own allocator (kvservice.core.allocator.SlotAllocator) hands out the slots and their
generations, as it does for a pool: sequence A takes two slots and its K/V is written; A is freed and
sequence B gets the same slots (a new generation) and writes its own K/V. A's old table, read after
that, must be stale_page on every page, never B's numbers; A's old slot mapping must write nothing;
a copy from a stale source must copy nothing. B's own table reads B's K/V exactly (float64 oracle).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import TOL, Cache, make_cache, poisoned, rand, rel_err

from kvservice.core.allocator import SlotAllocator
from kvservice.worker import reference
from kvservice.worker.kernel_api import KernelViolationError, Policy

PS, SLOTS, KH, D, HQ = 4, 8, 2, 64, 4


@dataclass
class Seq:
    """One sequence's pages as a worker gets them: slot mapping of its tokens, its table and generations."""

    slots: np.ndarray
    gens: np.ndarray          # uint32 [pages]
    sm: np.ndarray            # int64 [n]
    sm_gens: np.ndarray       # uint32 [n]
    table: tuple              # (indptr, indices, last_page_len) of one row


def admit(alloc: SlotAllocator, c: Cache, n: int) -> Seq:
    pages = -(-n // PS)
    slots = alloc.allocate(pages)
    gens = alloc.generation[slots].copy()
    idx = np.asarray(c.layout.page_index(slots), dtype=np.int64)
    tok = np.arange(n)
    sm = idx[tok // PS] * PS + tok % PS
    table = (np.array([0, pages], np.int32), idx.astype(np.int32), np.array([n - (pages - 1) * PS], np.int32))
    return Seq(slots, gens, sm.astype(np.int64), gens[tok // PS], table)


@pytest.fixture(params=["per_layer", "interleaved"])
def world(request):
    """A cache, the worker's generation record, and A's table made stale by B taking A's slots."""
    rng = np.random.default_rng(7)
    c = make_cache(rng, request.param, SLOTS, PS, KH, D, "float32")
    pg = np.zeros(c.layout.num_pages, np.uint32)
    alloc = SlotAllocator(SLOTS)
    return rng, c, pg, alloc


def write(ops, rng, c: Cache, pg: np.ndarray, s: Seq) -> None:
    k, v = rand(rng, (len(s.sm), KH, D), "float32"), rand(rng, (len(s.sm), KH, D), "float32")
    rec = ops.append_kv(c.buf, c.layout, k, v, s.sm, slot_generations=s.sm_gens, page_gen=pg).record
    assert rec.count == 0, rec


def reuse(ops, world) -> tuple[Seq, Seq]:
    """A written, freed; B takes the same slots (newer generations) and is written."""
    rng, c, pg, alloc = world
    a = admit(alloc, c, 6)
    write(ops, rng, c, pg, a)
    alloc.free(a.slots)
    b = admit(alloc, c, 7)
    assert sorted(b.slots.tolist()) == sorted(a.slots.tolist()) and (b.gens > 0).all()
    assert all(int(b.gens[b.slots.tolist().index(s)]) == int(g) + 1 for s, g in zip(a.slots, a.gens, strict=True))
    write(ops, rng, c, pg, b)
    return a, b


@pytest.mark.parametrize("split", [0, 1])
def test_decode_through_a_table_whose_pages_were_reallocated_is_stale(ops, world, split):
    rng, c, pg, _ = world
    a, b = reuse(ops, world)
    q = rand(rng, (1, HQ, D), "float32")
    old = ops.decode_attention(q, c.buf, c.layout, *a.table, generations=a.gens, page_gen=pg, kv_chunk_pages=split,
                               out=poisoned((1, HQ, D)), lse=poisoned((1, HQ)))
    r = old.record
    assert (r.count, r.row, r.position, r.value, r.reason) == (2, 0, 0, int(a.table[1][0]), "stale_page")
    assert np.isnan(old.out).all() and np.isnan(old.lse).all()           # never B's numbers
    zeros = ops.decode_attention(q, c.buf, c.layout, *a.table, generations=a.gens, page_gen=pg, policy=Policy.ZEROS)
    assert (zeros.out == 0).all() and np.isneginf(zeros.lse).all()
    with pytest.raises(KernelViolationError, match="stale_page"):
        ops.decode_attention(q, c.buf, c.layout, *a.table, generations=a.gens, page_gen=pg, policy=Policy.ERROR)
    new = ops.decode_attention(q, c.buf, c.layout, *b.table, generations=b.gens, page_gen=pg, kv_chunk_pages=split)
    assert new.record.count == 0
    out, lse = reference.decode_attention_ref(q, c.buf, c.raw, *b.table)
    assert rel_err(new.out, out) <= TOL["float32"] and rel_err(new.lse, lse) <= TOL["float32"]
    # Without generations the same stale table is read: what the check exists to stop.
    blind = ops.decode_attention(q, c.buf, c.layout, *a.table)
    assert blind.record.count == 0 and np.isfinite(blind.out).all()


def test_validate_marks_the_stale_row(ops, world):
    _, c, pg, _ = world
    a, b = reuse(ops, world)
    indptr = np.array([0, 2, 4], np.int32)
    indices = np.concatenate((a.table[1], b.table[1]))
    lpl = np.array([2, 3], np.int32)
    res = ops.validate_page_table(indptr, indices, lpl, c.layout, generations=np.concatenate((a.gens, b.gens)),
                                  page_gen=pg)
    assert np.asarray(res.row_status).tolist() == [1 << 5, 0]              # bit (code 6 - 1): stale_page
    assert (res.record.count, res.record.row, res.record.reason) == (2, 0, "stale_page")
    assert ops.validate_page_table(indptr, indices, lpl, c.layout).record.count == 0


def test_append_through_a_stale_slot_mapping_writes_nothing(ops, world):
    rng, c, pg, _ = world
    a, _ = reuse(ops, world)
    before, gens = c.buf.copy(), pg.copy()
    k = rand(rng, (len(a.sm), KH, D), "float32")
    r = ops.append_kv(c.buf, c.layout, k, k, a.sm, slot_generations=a.sm_gens, page_gen=pg).record
    assert (r.count, r.row, r.position, r.value, r.reason) == (6, 0, 0, int(a.sm[0]), "stale_page")
    assert np.array_equal(c.buf, before) and np.array_equal(pg, gens)      # B's K/V and record untouched
    with pytest.raises(KernelViolationError, match="stale_page"):
        ops.append_kv(c.buf, c.layout, k, k, a.sm, slot_generations=a.sm_gens, page_gen=pg, policy=Policy.ERROR)
    assert np.array_equal(c.buf, before)


def test_append_needs_the_page_opened_or_held_under_its_generation(ops, world):
    """A continued page whose earlier tokens were not written under this generation (a copy-on-write copy never
    run, a worker that lost them) is stale; a page opened in the call with a newer generation is written."""
    rng, c, pg, alloc = world
    s = admit(alloc, c, 8)                       # two full pages
    k = rand(rng, (8, KH, D), "float32")
    r = ops.append_kv(c.buf, c.layout, k[4:], k[4:], s.sm[4:], slot_generations=s.sm_gens[4:], page_gen=pg).record
    assert r.count == 0                          # page 2 opened by its offset-0 token in this call
    before = c.buf.copy()
    r = ops.append_kv(c.buf, c.layout, k[1:4], k[1:4], s.sm[1:4], slot_generations=s.sm_gens[1:4],
                      page_gen=pg).record
    assert (r.count, r.row, r.reason) == (3, 0, "stale_page") and np.array_equal(c.buf, before)
    r = ops.append_kv(c.buf, c.layout, k[:4], k[:4], s.sm[:4], slot_generations=s.sm_gens[:4], page_gen=pg).record
    assert r.count == 0 and pg[s.table[1][0] - c.layout.base] == s.gens[0]
    older = s.sm_gens[:4] - 1                    # an older generation never overwrites a newer page
    r = ops.append_kv(c.buf, c.layout, k[:4], k[:4], s.sm[:4], slot_generations=older, page_gen=pg).record
    assert (r.count, r.reason) == (4, "stale_page")


def test_copy_from_a_stale_source_copies_nothing(ops, world):
    _, c, pg, alloc = world
    a, b = reuse(ops, world)
    dst = alloc.allocate(1)
    src_page, dst_page = int(b.table[1][0]), int(c.layout.page_index(dst[0]))
    pairs = np.array([[src_page, dst_page]], np.int64)
    before, gens = c.buf.copy(), pg.copy()
    stale = np.array([[a.gens[0], alloc.generation[dst[0]]]], np.uint32)     # A's generation for B's page
    r = ops.copy_blocks([c.buf], c.layout, pairs, generations=stale, page_gens=[pg]).record
    assert (r.count, r.row, r.position, r.value, r.reason) == (1, 0, 0, src_page, "stale_page")
    assert np.array_equal(c.buf, before) and np.array_equal(pg, gens)
    good = np.array([[b.gens[0], alloc.generation[dst[0]]]], np.uint32)
    assert ops.copy_blocks([c.buf], c.layout, pairs, generations=good, page_gens=[pg]).record.count == 0
    assert pg[dst_page - c.layout.base] == alloc.generation[dst[0]]        # the copy now holds dst's generation
    src_view = reference.page_view(c.buf, c.raw, src_page)
    assert np.array_equal(reference.page_view(c.buf, c.raw, dst_page), src_view)
    newer = np.array([[b.gens[0], alloc.generation[dst[0]] - 1]], np.uint32)   # an older copy onto a newer page
    r = ops.copy_blocks([c.buf], c.layout, pairs, generations=newer, page_gens=[pg]).record
    assert (r.count, r.position, r.reason) == (1, 1, "stale_page")


def test_a_page_this_worker_never_wrote_is_stale(ops, world):
    rng, c, pg, alloc = world
    s = admit(alloc, c, 5)
    q = rand(rng, (1, HQ, D), "float32")
    r = ops.decode_attention(q, c.buf, c.layout, *s.table, generations=s.gens, page_gen=pg).record
    assert (r.count, r.reason) == (2, "stale_page")


def test_generation_arguments_are_checked(ops, world):
    rng, c, pg, alloc = world
    s = admit(alloc, c, 5)
    q = rand(rng, (1, HQ, D), "float32")
    with pytest.raises(ValueError, match="give both or neither"):
        ops.decode_attention(q, c.buf, c.layout, *s.table, generations=s.gens)
    with pytest.raises(TypeError, match="generations: expected dtype uint32"):
        ops.decode_attention(q, c.buf, c.layout, *s.table, generations=s.gens.astype(np.int32), page_gen=pg)
    with pytest.raises(ValueError, match="page_gen: expected shape"):
        ops.decode_attention(q, c.buf, c.layout, *s.table, generations=s.gens, page_gen=pg[:-1])
    with pytest.raises(ValueError, match="slot_generations: expected shape"):
        ops.append_kv(c.buf, c.layout, rand(rng, (5, KH, D), "float32"), rand(rng, (5, KH, D), "float32"), s.sm,
                      slot_generations=s.sm_gens[:4], page_gen=pg)


def test_emulated_and_numpy_agree_on_a_random_mix() -> None:
    """Random tables of fresh, stale and never-written pages: the same records, outputs and generation records."""
    from kvservice.worker import kernels_cpu, ops_numpy

    rng = np.random.default_rng(11)
    c = make_cache(rng, "interleaved", 16, PS, KH, D, "float32")
    n_pages = c.layout.num_pages
    pg = rng.integers(0, 4, n_pages).astype(np.uint32)
    slots = rng.permutation(16)[:10]
    idx = np.asarray(c.layout.page_index(slots), np.int32)
    gens = np.array([pg[p - c.layout.base] if rng.random() < 0.7 else rng.integers(0, 4) for p in idx], np.uint32)
    indptr = np.array([0, 3, 3, 7, 10], np.int32)
    lpl = np.array([2, 1, 4, 3], np.int32)
    q = rand(rng, (4, HQ, D), "float32")
    got = [ops.decode_attention(q, c.buf, c.layout, indptr, idx, lpl, generations=gens, page_gen=pg)
           for ops in (kernels_cpu, ops_numpy)]
    assert got[0].record == got[1].record and got[0].record.count > 0
    assert np.array_equal(np.isnan(got[0].lse), np.isnan(got[1].lse))
    sm = np.ascontiguousarray((idx.astype(np.int64)[:, None] * PS + np.arange(PS)).ravel()[::3])
    sg = np.ascontiguousarray(np.repeat(gens, PS)[::3])
    recs, bufs, pgs = [], [], []
    for ops in (kernels_cpu, ops_numpy):
        buf, p = c.buf.copy(), pg.copy()
        k = np.ones((len(sm), KH, D), np.float32)
        recs.append(ops.append_kv(buf, c.layout, k, k, sm, slot_generations=sg, page_gen=p).record)
        bufs.append(buf)
        pgs.append(p)
    assert recs[0] == recs[1] and np.array_equal(bufs[0], bufs[1]) and np.array_equal(pgs[0], pgs[1])


def test_argument_errors_name_the_documented_shapes(world):
    """A wrong extent is named with the shape docs/KERNELS.md gives each argument (generations [nnz] of a
    table, slot_generations [n], copy generations [n, 2], v [n, kv_heads, head_dim]) and the extents wanted."""
    from kvservice.worker import kernels_cpu

    rng, c, pg, alloc = world
    s = admit(alloc, c, 5)                                                   # 2 pages
    q = rand(rng, (1, HQ, D), "float32")
    with pytest.raises(ValueError) as err:
        kernels_cpu.decode_attention(q, c.buf, c.layout, *s.table, generations=s.gens[:1], page_gen=pg)
    assert str(err.value) == "generations: expected shape [nnz] = (2,), got (1,)"
    k = rand(rng, (5, KH, D), "float32")
    with pytest.raises(ValueError) as err:
        kernels_cpu.append_kv(c.buf, c.layout, k, k, s.sm, slot_generations=s.sm_gens[:4], page_gen=pg)
    assert str(err.value) == "slot_generations: expected shape [n] = (5,), got (4,)"
    with pytest.raises(ValueError) as err:
        kernels_cpu.append_kv(c.buf, c.layout, k, k[:4], s.sm)
    assert str(err.value) == f"v: expected shape [n, kv_heads, head_dim] = (5, {KH}, {D}), got (4, {KH}, {D})"
    pairs = np.array([[int(s.table[1][0]), int(s.table[1][1])]], np.int64)
    with pytest.raises(ValueError) as err:
        kernels_cpu.copy_blocks([c.buf], c.layout, pairs, generations=s.gens[None, :1], page_gens=[pg])
    assert str(err.value) == "generations: expected shape [n, 2] = (1, 2), got (1, 1)"


def test_one_copy_takes_up_to_65535_buffers():
    """copy_blocks launches one grid row per buffer, and a CUDA grid's y extent is at most 65535: 65535
    buffers are taken (here with no pairs, so nothing is launched), 65536 are refused before anything runs."""
    from kvservice.worker import kernels_cpu

    c = make_cache(np.random.default_rng(16), "per_layer", SLOTS, PS, KH, D, "float32")
    none = np.zeros((0, 2), np.int64)
    assert kernels_cpu.copy_blocks([c.buf] * 65535, c.layout, none).record.count == 0
    with pytest.raises(ValueError, match="caches: at most 65535 layers per call"):
        kernels_cpu.copy_blocks([c.buf] * 65536, c.layout, none)


def test_a_bad_page_generation_record_is_named_by_its_place_in_the_sequence():
    """check_generations over several layers' records names the bad one page_gen[i]; a single record, page_gen."""
    from kvservice.worker.generations import check_generations
    from kvservice.worker.kernel_api import check_array

    rng = np.random.default_rng(35)
    gens = rng.integers(1, 2**32, 6, dtype=np.uint32)
    good = rng.integers(1, 2**32, 10, dtype=np.uint32)
    assert check_generations("generations", gens, 6, [good, good.copy()], 10, "[nnz]", check_array)
    with pytest.raises(ValueError, match=r"^page_gen\[1\]: expected shape \[num_pages\]"):
        check_generations("generations", gens, 6, [good, good[:9].copy(), good], 10, "[nnz]", check_array)
    with pytest.raises(TypeError, match=r"^page_gen\[2\]: expected dtype uint32, got int64"):
        check_generations("generations", gens, 6, [good, good, good.astype(np.int64)], 10, "[nnz]", check_array)
    with pytest.raises(ValueError, match=r"^page_gen: expected shape \[num_pages\]"):
        check_generations("generations", gens, 6, good[:9].copy(), 10, "[nnz]", check_array)
