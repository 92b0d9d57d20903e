"""Step semantics: slot mappings and tables against hand-computed values, and every failure path."""

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import validate_page_table
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool


def make_pool(num_slots=64, page_size=4, layout="per_layer", layers=None, max_seq_len=0):
    layers = layers or (LayerSpec(2, 64),) * 2
    return Pool("p", plan(CacheSpec(tuple(layers), page_size, layout), Sizing(num_slots=num_slots,
                                                                              max_seq_len=max_seq_len)))


def snapshot(pool):
    ids, toks = pool.sequences()
    slots = {i: [pool.sequence_slots(i, g).tolist() for g in range(len(pool.allocators))] for i in ids.tolist()}
    return ids.tolist(), toks.tolist(), slots, [a.num_free for a in pool.allocators], \
        [a.free_slots().tolist() for a in pool.allocators]


def test_admit_extend_free_values():
    pool = make_pool()
    r = pool.step(admit_ids=[7, 9], admit_tokens=[5, 3])
    assert r.seq_ids.tolist() == [7, 9] and r.num_tokens.tolist() == [5, 3]
    assert r.new_token_indptr.tolist() == [0, 5, 8]
    (st,) = r.tables
    s7, s9 = pool.sequence_slots(7), pool.sequence_slots(9)
    assert len(s7) == 2 and len(s9) == 1 and not set(s7) & set(s9)
    want = [s7[t // 4] * 4 + t % 4 for t in range(5)] + [s9[0] * 4 + t for t in range(3)]
    assert st.slot_mapping.tolist() == want and st.slot_mapping.dtype == np.int64
    assert st.table.indptr.tolist() == [0, 2, 3]
    assert st.table.indices.tolist() == [*s7, *s9]
    assert st.table.last_page_len.tolist() == [1, 3]
    r = pool.step(extend_ids=[9, 7], extend_tokens=[1, 4], block_table=True)
    (st,) = r.tables
    s7b, s9b = pool.sequence_slots(7), pool.sequence_slots(9)
    assert s7b[:2].tolist() == s7.tolist() and s9b.tolist() == s9.tolist()   # pages never move
    assert st.slot_mapping.tolist() == [s9[0] * 4 + 3] + [s7b[t // 4] * 4 + t % 4 for t in range(5, 9)]
    assert st.table.last_page_len.tolist() == [4, 1]
    assert st.block_table.tolist() == [[s9[0], -1, -1], s7b.tolist()]
    pool.step(free_ids=[7])
    assert pool.num_free_slots == 64 - 1
    assert_invariants(pool)


def test_seed000_batch_of_8_into_128_slots_is_refused_and_pool_unchanged():
    spec = CacheSpec.uniform(32, 8, 128, "float16", 16)
    pool = Pool("small", plan(spec, Sizing(num_slots=128, max_seq_len=2048)))
    pool.step(admit_ids=[100], admit_tokens=[16])
    before = snapshot(pool)
    with pytest.raises(ResourceExhausted) as exc:
        pool.step(admit_ids=np.arange(8), admit_tokens=np.full(8, 2048))
    assert "needs 1024 slots" in exc.value.message and "only 127 are free" in exc.value.message
    assert exc.value.metadata == {"needed": "1024", "free": "127", "num_slots": "128", "group": "0"}
    assert snapshot(pool) == before
    assert pool.refused == 1 and pool.alloc_failures == {"out_of_slots": 1}
    assert_invariants(pool)


def test_frees_in_the_same_step_make_room():
    pool = make_pool(num_slots=4)
    pool.step(admit_ids=[1], admit_tokens=[16])
    with pytest.raises(ResourceExhausted):
        pool.step(admit_ids=[2], admit_tokens=[4])
    r = pool.step(free_ids=[1], admit_ids=[2], admit_tokens=[16])
    assert r.seq_ids.tolist() == [2] and pool.num_free_slots == 0
    assert_invariants(pool)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"free_ids": [42]}, NotFound, "sequence 42 is not in pool"),
    ({"extend_ids": [42], "extend_tokens": [1]}, NotFound, "extend_seq_ids: sequence 42"),
    ({"admit_ids": [1], "admit_tokens": [1]}, AlreadyExists, "sequence 1 is already"),
    ({"extend_ids": [1], "extend_tokens": [0]}, InvalidArgument, "must be > 0"),
    ({"extend_ids": [1], "extend_tokens": [-3]}, InvalidArgument, "must be > 0"),
    ({"admit_ids": [5], "admit_tokens": [1, 2]}, InvalidArgument, "2 entries for 1 sequence ids"),
    ({"admit_ids": [-5], "admit_tokens": [1]}, InvalidArgument, "negative sequence id"),
    ({"admit_ids": [5, 5], "admit_tokens": [1, 1]}, InvalidArgument, "sequence 5 appears more than once"),
    ({"free_ids": [1], "extend_ids": [1], "extend_tokens": [1]}, InvalidArgument, "more than once"),
    ({"admit_ids": [[5]], "admit_tokens": [[1]]}, InvalidArgument, "1-D integer"),
    ({"admit_ids": [5.0], "admit_tokens": [1]}, InvalidArgument, "1-D integer"),
    ({"admit_ids": [5], "admit_tokens": [1000]}, InvalidArgument, "max_seq_len=40"),
    ({"extend_ids": [1], "extend_tokens": [39]}, InvalidArgument, "would hold 42 tokens"),
])
def test_bad_steps_are_clean_errors_and_change_nothing(kwargs, exc, match):
    pool = make_pool(num_slots=32, max_seq_len=40)
    pool.step(admit_ids=[1, 2], admit_tokens=[3, 6])
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.step(**kwargs)
    assert snapshot(pool) == before
    assert_invariants(pool)


def test_double_free_is_an_error():
    pool = make_pool()
    pool.step(admit_ids=[1], admit_tokens=[3])
    pool.step(free_ids=[1])
    with pytest.raises(NotFound):
        pool.step(free_ids=[1])
    assert pool.num_free_slots == 64


def test_interleaved_tables_valid_for_own_space_and_rejected_by_the_other():
    layers = (LayerSpec(2, 256), LayerSpec(2, 512))
    pool = make_pool(num_slots=100, page_size=16, layout="interleaved", layers=layers)
    rng = np.random.default_rng(3)
    r = pool.step(admit_ids=np.arange(1, 9), admit_tokens=rng.integers(100, 200, 8))
    assert len(r.tables) == 2
    a, b = r.tables
    assert a.space.scale != b.space.scale
    pool_pages = pool.plan.geometry.pool_pages
    to_slots = [(st.table.indices.astype(np.int64) - st.space.base - st.space.offset) // st.space.scale
                for st in r.tables]
    for st in r.tables:
        assert validate_page_table(st.table, st.space, 16, pool_pages=pool_pages).ok
        pages = st.table.indices.astype(np.int64)
        assert ((pages - st.space.base - st.space.offset) % st.space.scale == 0).all()
    # Both spaces describe the same slots.
    assert to_slots[0].tolist() == to_slots[1].tolist()
    # Seed 004: one space's table fed to the other's layer: every entry is reported, never only some.
    nnz = len(a.table.indices)
    for table, space in ((a.table, b.space), (b.table, a.space)):
        wrong = validate_page_table(table, space, 16, max_reports=nnz, pool_pages=pool_pages)
        assert wrong.counts() == {"wrong_index_space": nnz} and wrong.num_violations == nnz
    assert_invariants(pool)


def test_sliding_window_group_gets_its_own_slots_and_space():
    layers = (LayerSpec(2, 64),) * 2 + (LayerSpec(2, 64, sliding_window=8),)
    pool = make_pool(num_slots=20, layers=layers)
    r = pool.step(admit_ids=[1], admit_tokens=[9])
    assert [st.space.group for st in r.tables] == [0, 1]
    assert len(pool.sequence_slots(1, 0)) == len(pool.sequence_slots(1, 1)) == 3
    assert_invariants(pool)


def test_rows_and_width_grow():
    pool = make_pool(num_slots=4000, page_size=1, max_seq_len=100)
    ids = np.arange(1000, 1040)
    pool.step(admit_ids=ids, admit_tokens=np.full(40, 3))
    pool.step(extend_ids=ids[::2], extend_tokens=np.full(20, 90))
    pool.step(free_ids=ids[1::4])
    pool.step(admit_ids=ids + 5000, admit_tokens=np.full(40, 7))
    assert pool.num_sequences == 70
    assert_invariants(pool)


def test_decode_fast_path_equals_the_general_path():
    rng = np.random.default_rng(9)
    fast, slow = make_pool(num_slots=400, max_seq_len=200), make_pool(num_slots=400, max_seq_len=200)
    slow._fast = False
    ids = np.arange(1, 13)
    for p in (fast, slow):
        p.step(admit_ids=ids, admit_tokens=rng.integers(1, 40, 12) if p is fast else fast.sequences()[1])
    calls = []
    general = fast._decode_step
    fast._decode_step = lambda *a: calls.append(1) or general(*a)
    for i in range(120):
        if i % 17 == 16:                                  # a free + admit breaks the batch
            new = np.array([100 + i])
            kwargs = {"free_ids": ids[:1], "admit_ids": new, "admit_tokens": [5]}
            ids = np.concatenate((ids[1:], new))
        else:
            k = np.ones(len(ids), dtype=np.int64) if i % 5 else rng.integers(1, 4, len(ids))
            kwargs = {"extend_ids": ids, "extend_tokens": k, "block_table": i % 3 == 0}
        a, b = fast.step(**kwargs), slow.step(**kwargs)
        for x, y in ((a.seq_ids, b.seq_ids), (a.num_tokens, b.num_tokens),
                     (a.new_token_indptr, b.new_token_indptr)):
            assert x.tolist() == y.tolist()
        for sa, sb in zip(a.tables, b.tables, strict=True):
            assert sa.slot_mapping.tolist() == sb.slot_mapping.tolist()
            assert sa.table.indices.tolist() == sb.table.indices.tolist()
            assert sa.table.indptr.tolist() == sb.table.indptr.tolist()
            assert sa.table.last_page_len.tolist() == sb.table.last_page_len.tolist()
            assert (sa.block_table is None) == (sb.block_table is None)
            if sa.block_table is not None:
                assert sa.block_table.tolist() == sb.block_table.tolist()
        assert a.num_free_slots == b.num_free_slots
    assert len(calls) > 80                                 # the fast path really ran
    with pytest.raises(InvalidArgument, match="max_seq_len=200"):       # errors come from the general path
        fast.step(extend_ids=ids, extend_tokens=np.full(len(ids), 150))
    assert_invariants(fast)
    assert fast.sequences()[1].tolist() == slow.sequences()[1].tolist()


def test_slots_held_counts_each_group_and_excludes_released_window_pages():
    layers = (LayerSpec(2, 64),) * 2 + (LayerSpec(2, 64, sliding_window=8),)
    pool = make_pool(num_slots=40, layers=layers)
    pool.step(admit_ids=[1, 2], admit_tokens=[9, 3])
    pool.step(extend_ids=[1], extend_tokens=[20])          # 29 tokens: the chunk's queries see pages 0..7
    assert pool.slots_held(np.array([1, 2])).tolist() == [[8, 8], [1, 1]]
    pool.step(extend_ids=[1], extend_tokens=[1])           # query 29 sees tokens 22..29: pages 0..4 go
    held = pool.slots_held(np.array([1, 2]))
    assert held.tolist() == [[8, 3], [1, 1]]
    assert [len(pool.sequence_slots(1, g)) for g in (0, 1)] == [8, 3] and pool.first_page(1, 1) == 5
    with pytest.raises(NotFound):
        pool.slots_held(np.array([3]))
    none = pool.slots_held(np.array([], dtype=np.int64))   # no sequences: no rows, one column per group
    assert none.shape == (0, 2) and none.dtype == np.int64


@pytest.mark.parametrize(("prepare", "step", "want_rows"), [
    # The two mixed steps of issue #10: a fork child (no new token) beside 2 new tokens.
    ({"admit_ids": [10], "admit_tokens": [12]},
     {"fork_parents": [10], "fork_children": [11], "admit_ids": [12], "admit_tokens": [2]}, [12, 11]),
    ({"admit_ids": [5], "admit_tokens": [12]},
     {"fork_parents": [5], "fork_children": [6], "extend_ids": [5], "extend_tokens": [2]}, [5, 6]),
])
def test_mixed_fork_step_slot_mapping_follows_the_tables(prepare, step, want_rows):
    pool = make_pool(num_slots=32, page_size=8, layers=(LayerSpec(1, 64),))
    pool.step(**prepare)
    r = pool.step(**step)
    assert r.seq_ids.tolist() == want_rows
    (st,) = r.tables
    row = st.table.row(0).tolist()                          # the row that got the 2 new tokens
    pos = np.arange(r.num_tokens[0] - 2, r.num_tokens[0])
    assert st.slot_mapping.tolist() == [row[p // 8] * 8 + p % 8 for p in pos.tolist()]
    assert r.new_token_indptr.tolist() == [0, 2, 2]
    assert_invariants(pool)


# ---- issue #10: Steps mixing forks with admissions or extensions -------------------------------------
def one_layer_pool(**kw):
    return Pool("p", plan(CacheSpec.uniform(1, 1, 64, page_size=8), Sizing(num_slots=32)), **kw)


def test_fork_and_admission_in_one_step_map_the_admission_to_its_own_page():
    pool = one_layer_pool()
    pool.step(admit_ids=[10], admit_tokens=[12])                     # slots 1, 0 (the stack's top first)
    r = pool.step(fork_parents=[10], fork_children=[11], admit_ids=[12], admit_tokens=[2])
    assert r.seq_ids.tolist() == [12, 11] and r.new_token_indptr.tolist() == [0, 2, 2]
    (st,) = r.tables
    (page,) = st.table.row(0).tolist()                                 # seq 12's one page, per its own table
    assert page == pool.sequence_slots(12)[0] and page not in pool.sequence_slots(10)
    assert st.slot_mapping.tolist() == [page * 8, page * 8 + 1] == [16, 17]
    assert st.table.row(1).tolist() == pool.sequence_slots(10).tolist()  # the child shares the parent's pages
    assert_invariants(pool)


def test_fork_and_parent_extension_in_one_step_write_into_the_parents_copy():
    pool = one_layer_pool()
    pool.step(admit_ids=[5], admit_tokens=[12])                      # page 1 holds 4 of 8 tokens
    before = pool.sequence_slots(5).tolist()
    r = pool.step(fork_parents=[5], fork_children=[6], extend_ids=[5], extend_tokens=[2])
    assert r.seq_ids.tolist() == [5, 6] and r.num_tokens.tolist() == [14, 12]
    # Page 1 has two owners and one writer: the parent copies it (r = 2 > c = 1) and writes the copy.
    ((src, dst),) = r.copies[0].tolist()
    assert src == before[1] and dst not in before
    (st,) = r.tables
    assert st.slot_mapping.tolist() == [dst * 8 + 4, dst * 8 + 5] == [20, 21]
    assert st.table.row(0).tolist() == [before[0], dst] and st.table.row(1).tolist() == before
    assert pool.sequence_slots(6).tolist() == before
    assert_invariants(pool)


def test_fork_in_the_step_of_the_parents_window_release_copies_the_parent_before_it():
    # Documented order: frees, forks, extensions. The child is the parent as it was before this
    # step's extension, so it keeps the pages the parent's window releases in that extension.
    layers = (LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6))
    pool = make_pool(num_slots=32, page_size=4, layers=layers)
    pool.step(admit_ids=[1], admit_tokens=[24])
    full, window = pool.sequence_slots(1, 0).tolist(), pool.sequence_slots(1, 1).tolist()
    assert len(window) == 6
    r = pool.step(fork_parents=[1], fork_children=[2], extend_ids=[1], extend_tokens=[1])
    assert pool.first_page(1, 1) == (24 + 1 - 6) // 4 == 4              # the parent released pages 0..3
    assert pool.first_page(2, 1) == 0 and pool.sequence_slots(2, 1).tolist() == window
    assert pool.sequence_slots(2, 0).tolist() == full
    child = r.tables[1].table.row(1) - getattr(r.tables[1].space, "base", 0)
    assert child.tolist() == window and r.tables[1].table.last_page_len.tolist() == [1, 4]
    assert pool.allocators[1].refcount(np.array(window[:4])).tolist() == [1, 1, 1, 1]     # now the child's alone
    assert_invariants(pool)


@pytest.mark.parametrize("kwargs", [{"admit_salts": ["a", "b"]}, {"admit_extra_keys": ["lora"]},
                                    {"admit_token_ids": np.array([1, 2, 3])}])
def test_prefix_fields_without_admissions_are_refused(kwargs):
    # One salt / extra key per admission, sum(admit_tokens) token ids: with no admission, none.
    pool = Pool("c", plan(CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=8)), prefix_caching=True)
    pool.step(admit_ids=[1], admit_tokens=[5], admit_token_ids=np.arange(5))
    before = snapshot(pool)
    with pytest.raises(InvalidArgument):
        pool.step(extend_ids=[1], extend_tokens=[1], **kwargs)
    assert snapshot(pool) == before


# Error contract: a refused step names the request field a client must fix (mutation check survivors).

@pytest.mark.parametrize(("step", "message"), [
    ({"fork_parents": [3], "fork_children": [[4, 5]]},
     "fork_child_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"extend_ids": [3], "extend_tokens": [2.5]},
     "extend_num_tokens must be a 1-D integer array, got shape (1,) dtype float64"),
    ({"free_ids": [3], "admit_token_ids": [11, 12]},
     "admit_token_ids given for a step with no admissions; send it only with admit_seq_ids (one entry per "
     "admission, token ids: their sum)"),
    ({"free_ids": [3], "admit_salts": ["tenant-a"]}, "admit_cache_salts given for a step with no admissions"),
    ({"free_ids": [3], "admit_extra_keys": ["lora-7"]}, "admit_extra_keys given for a step with no admissions"),
    ({"free_ids": [3.0]}, "free_seq_ids must be a 1-D integer array, got shape (1,) dtype float64"),
    ({"extend_ids": [[3]], "extend_tokens": [2]},
     "extend_seq_ids must be a 1-D integer array, got shape (1, 1) dtype int64"),
])
def test_refused_step_names_the_field(step, message):
    pool = make_pool()
    pool.step(admit_ids=[3], admit_tokens=[6])
    before = snapshot(pool)
    with pytest.raises(InvalidArgument) as e:
        pool.step(**step)
    assert e.value.message.startswith(message)
    assert snapshot(pool) == before


def test_an_unknown_fork_parent_and_extra_salts_are_named_with_the_field():
    pool = Pool("c", plan(CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=16)), prefix_caching=True)
    pool.step(admit_ids=[1], admit_tokens=[5], admit_token_ids=np.arange(11, 16))
    before = snapshot(pool)
    with pytest.raises(NotFound) as e:
        pool.step(fork_parents=[9], fork_children=[4])
    assert e.value.message == "fork_parent_ids: sequence 9 is not in pool 'c'"
    with pytest.raises(InvalidArgument) as e:
        pool.step(admit_ids=[7], admit_tokens=[4], admit_token_ids=np.arange(21, 25), admit_salts=["a", "b"])
    assert e.value.message == "admit_cache_salts has 2 entries for 1 admissions; give one per admission or none"
    assert snapshot(pool) == before


def test_state_without_an_incarnation_restores_as_none_yet():
    """A version-2 state that lacks the incarnation field passes the state check and restores with 0."""
    from kvservice.core.invariants import check_pool_state
    pool = make_pool()
    pool.incarnation = 5
    rng = np.random.default_rng(8)
    pool.step(admit_ids=[4, 8, 15], admit_tokens=rng.integers(1, 30, 3))
    state = pool.export_state()
    assert state.meta.pop("incarnation") == 5
    assert check_pool_state(state, pool.plan) == []
    twin = Pool.from_state(state, pool.plan)
    assert twin.incarnation == 0
    assert snapshot(twin) == snapshot(pool)


def test_state_keeps_the_model_and_one_without_it_restores_unnamed():
    """The model name round-trips through a state; a state that lacks the field restores as "" (unnamed)."""
    from kvservice.core.invariants import check_pool_state
    pool = Pool("p", make_pool().plan, False, "m-7b")
    pool.step(admit_ids=[4, 9], admit_tokens=np.random.default_rng(9).integers(1, 30, 2))
    state = pool.export_state()
    assert Pool.from_state(state, pool.plan).model == "m-7b"
    assert state.meta.pop("model") == "m-7b"
    assert check_pool_state(state, pool.plan) == []
    twin = Pool.from_state(state, pool.plan)
    assert twin.model == ""
    assert snapshot(twin) == snapshot(pool)


def test_state_spec_stores_runs_of_equal_layers_and_rebuilds_the_plan():
    """meta["spec"]["layers"] holds [kv_heads, head_dim, dtype, window, count] per run of equal consecutive
    layers, and pool_plan rebuilds the very layer list from it."""
    from kvservice.state.snapshot import pool_plan
    a, b, c = LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=8), LayerSpec(4, 32, "bfloat16")
    layers = (a, a, a, b, c, c, a)
    pool = make_pool(num_slots=48, layers=layers)
    meta = pool.export_state().meta
    assert meta["spec"]["layers"] == [[2, 64, a.dtype, 0, 3], [2, 64, a.dtype, 8, 1], [4, 32, "bfloat16", 0, 2],
                                      [2, 64, a.dtype, 0, 1]]
    assert pool_plan(meta).geometry.spec.layers == layers


def test_a_free_stack_of_descending_runs_is_captured_as_runs_when_asked():
    """Past 2**20 free slots the captured free stack is kept as runs of descending ids; finish(runs=True)
    hands those runs on (what the snapshot encoder writes), finish() the plain array, both the same ids."""
    from kvservice.core.pool_state import IdRuns
    n = (1 << 20) + 96
    pool = make_pool(num_slots=n, layers=(LayerSpec(2, 64),))
    rng = np.random.default_rng(10)
    pool.step(admit_ids=[1, 2, 3], admit_tokens=rng.integers(5, 40, 3))
    pool.step(free_ids=[2])
    runs = pool.capture_state()(runs=True).arrays["free_stack/0"]
    plain = pool.capture_state()().arrays["free_stack/0"]
    assert isinstance(runs, IdRuns) and isinstance(plain, np.ndarray) and plain.dtype == np.int64
    assert np.array_equal(runs.array(), plain)
    held = np.concatenate([pool.sequence_slots(i, 0) for i in (1, 3)])
    assert np.array_equal(np.sort(plain), np.setdiff1d(np.arange(n), held))


@pytest.mark.parametrize("n", [(1 << 20) + 1, (1 << 20) + 2, (2 << 20) + 2])
def test_runs_found_chunk_by_chunk_give_back_every_id(n):
    """copy_ids scans in 2**20-element chunks: a run broken at any place, the last id and the chunk
    edges included, comes back as the same ids (a few breaks: IdRuns; the reference is the array itself)."""
    from kvservice.core.pool_state import IdRuns, copy_ids
    rng = np.random.default_rng(n)
    a = np.arange(3 * n, 2 * n, -1, dtype=np.int64)       # one descending run of n ids
    at = np.unique(np.concatenate([[n - 1, (1 << 20) - 1, 1 << 20], rng.integers(1, n, 5)]))
    a[at] = rng.integers(5 * n, 6 * n, len(at))             # each breaks the run before and after it
    runs = copy_ids(a)
    assert isinstance(runs, IdRuns)
    assert np.array_equal(runs.array(), a)


def test_unknown_sequence_in_slots_held_names_the_field_and_the_id():
    pool = make_pool()
    pool.step(admit_ids=[3, 8], admit_tokens=[6, 9])
    assert pool.slots_held(np.array([8, 3])).tolist() == [[3], [2]]
    with pytest.raises(NotFound) as e:
        pool.slots_held(np.array([3, 41]))
    assert e.value.message == "seq_ids: sequence 41 is not in pool 'p'"


def test_decode_step_lists_no_copies_per_layer_group():
    """The repeated-batch fast path (no sliding window, nothing shared) answers like the general path:
    one (0, 2) copy list per layer group."""
    pool = make_pool()
    rng = np.random.default_rng(4)
    pool.step(admit_ids=[1, 2, 3], admit_tokens=rng.integers(2, 9, 3))
    general = pool.step(extend_ids=[1, 2, 3], extend_tokens=[1, 1, 1])
    decode = pool.step(extend_ids=[1, 2, 3], extend_tokens=[1, 1, 1])     # the same rows again: the fast path
    assert decode.num_tokens.tolist() == (general.num_tokens + 1).tolist()
    for r in (general, decode):
        assert len(r.copies) == len(pool.allocators) == 1
        assert all(c.shape == (0, 2) and c.dtype == np.int64 for c in r.copies)


@pytest.mark.parametrize("kind", ["extend", "admit"])
def test_too_long_a_sequence_names_the_step_part_the_id_and_the_limit(kind):
    pool = make_pool(max_seq_len=40)
    pool.step(admit_ids=[3, 8], admit_tokens=[6, 30])
    before = snapshot(pool)
    step = {"extend_ids": [3, 8], "extend_tokens": [2, 15]} if kind == "extend" else \
        {"admit_ids": [5, 9], "admit_tokens": [41, 7]}
    seq, n = (8, 45) if kind == "extend" else (5, 41)
    with pytest.raises(InvalidArgument) as e:
        pool.step(**step)
    assert e.value.message == f"{kind}: sequence {seq} would hold {n} tokens; pool 'p' takes at most max_seq_len=40"
    assert e.value.metadata == {"seq_id": str(seq), "max_seq_len": "40"}
    assert snapshot(pool) == before


def test_slot_tables_switch_to_int64_exactly_past_int32():
    from kvservice.core.pool import slot_table_dtype
    assert [slot_table_dtype(n) for n in (1, 2**31 - 1, 2**31, 2**32 - 1, 2**32)] == \
        [np.dtype(np.int32)] * 2 + [np.dtype(np.int64)] * 3
    pool = make_pool(num_slots=48)
    assert all(rs.dtype == np.int32 for rs in pool._slots)


def test_refusals_for_lack_of_slots_are_counted_one_by_one():
    pool = make_pool(num_slots=6)
    pool.step(admit_ids=[1], admit_tokens=[9])            # 3 of 6 slots
    rng = np.random.default_rng(6)
    for i in range(3):
        with pytest.raises(ResourceExhausted):
            pool.step(admit_ids=[10 + i], admit_tokens=[int(rng.integers(13, 25))])   # > 3 free pages
        assert pool.refused == i + 1 and pool.alloc_failures == {"out_of_slots": i + 1}


def test_a_refusal_counts_the_slots_this_step_releases_apart_from_the_free_ones():
    """16 slots of 4 tokens: sequences of 10 and 4 pages leave 2 free. A step that frees the second (4 pages
    back) and admits 12 pages has 2 + 4 = 6 to take from: refused, the message splitting the 6 as such, and
    nothing changes."""
    pool = make_pool(num_slots=16, max_seq_len=64)
    rng = np.random.default_rng(16)
    pool.step(admit_ids=[1, 2], admit_tokens=[40, 13])
    before = snapshot(pool)
    with pytest.raises(ResourceExhausted) as err:
        pool.step(free_ids=[2], admit_ids=[3], admit_tokens=[int(rng.integers(45, 49))])
    assert ("pool 'p': this step needs 12 slots in layer group 0 but only 6 are free (2 free + 4 released by "
            "this step) of 16; ") in err.value.message
    assert err.value.metadata["needed"] == "12" and err.value.metadata["free"] == "6"
    assert snapshot(pool) == before
