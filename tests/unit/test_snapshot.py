"""Snapshot format: exact round trip, compact free lists, damage always named, invariants checked before loading."""

import json

import numpy as np
import pytest

from kvservice.contract.errors import KVError, StateError
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.allocator import SlotAllocator
from kvservice.core.invariants import assert_invariants, check_pool_state
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.pool_state import PoolState
from kvservice.core.prefix import PrefixCache
from kvservice.manager.pools import BlockManager
from kvservice.state import snapshot as snap
from kvservice.state.journal import METHODS, Journal, JournalConfig
from kvservice.state.tree import state_tree

from .test_journal import prefix_workload, setup_pools, workload


@pytest.fixture(scope="module")
def busy():
    """A manager after random admits, extends, frees, forks, prefix hits and sliding-window releases."""
    j = Journal(BlockManager(), config=JournalConfig(background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(11), 150)
    prefix_workload(j, np.random.default_rng(12), 80)
    return j


def encode_manager(j, seq=7):
    pools = {}
    for name in j.manager.pool_names():
        with j.manager.locked(name) as pool:
            pools[name] = pool.export_state()
    ids, replies = j.window.capture()
    window = snap.WindowState(ids, [(rid, m, msg.SerializeToString()) for rid, m, msg in replies])
    return snap.encode(seq, 3, 1.5, pools, j.manager.workers.workers(), window, METHODS)


def blob(enc):
    return b"".join(bytes(c) for c in enc.chunks)


def test_round_trip_rebuilds_every_pool_exactly(busy):
    data = blob(encode_manager(busy))
    s = snap.decode(data)
    assert (s.seq, s.incarnation, s.created) == (7, 3, 1.5)
    rebuilt = BlockManager()
    rebuilt.restore(snap.build_pools(s.pools, "test"), s.workers)
    assert state_tree(rebuilt) == state_tree(busy.manager)
    assert [(rid, m, d, q) for rid, m, d, q, _ in s.window.ids] == \
        [(rid, m, d, q) for rid, (m, d, q, _) in busy.window.ids.items()]
    kept = list(busy.window.replies.items())[-busy.config.snapshot_replies:]
    assert [(rid, data) for rid, _, data in s.window.replies] == [(rid, m.SerializeToString()) for rid, (m, _) in kept]


def test_the_rebuilt_pool_hands_out_the_same_slots():
    """Free lists keep their order: the next allocations of the original and the rebuilt pool agree."""
    j = Journal(BlockManager(), config=JournalConfig(background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(21), 60)
    state = snap.decode(blob(encode_manager(j))).pools["a"]
    with j.manager.locked("a") as pool:
        twin = Pool.from_state(state, pool.plan)
        ids = pool.sequences()[0]
        assert len(ids) > 3
        step = {"free_ids": ids[:2], "extend_ids": ids[2:], "extend_tokens": np.full(len(ids) - 2, 17),
                "admit_ids": [10**6, 10**6 + 1], "admit_tokens": [40, 3]}
        want, got = pool.step(**step), twin.step(**step)
    assert np.array_equal(got.tables[0].slot_mapping, want.tables[0].slot_mapping)
    assert np.array_equal(got.tables[0].table.indices, want.tables[0].table.indices)
    assert got.num_free_slots == want.num_free_slots


def test_every_pool_field_is_exported_or_rebuilt():
    """Fails when Pool, SlotAllocator or PrefixCache gain a field: extend export_state / from_state, then this list."""
    p = Pool("p", plan(CacheSpec.uniform(1, 1, 64), Sizing(num_slots=8)), prefix_caching=True)
    assert set(vars(p)) == {
        # exported
        "name", "plan", "model", "incarnation", "prefix_hash", "prefix_hash_seed", "prefix", "prefixes", "_sharing",
        "_rows", "_seq_ids",
        "_num_tokens", "_held", "_first", "_slots", "_free_rows", "_num_rows", "steps", "admitted", "refused",
        "alloc_failures", "allocators", "events",
        # rebuilt from the plan, or caches and scratch
        "page_size", "max_seq_len", "windows", "layer_space", "_sliding", "_is_sliding", "_anchor_group",
        "_register_order",
        "_sorted", "_last_batch", "_fast", "_one_full_group"}
    assert set(SlotAllocator.__slots__) == {"_stack", "_top", "_cached", "peak_used", "evictions", "_refcnt",
                                            "cacheable", "_mark", "_ones", "num_slots", "caching", "on_evict",
                                            "clock", "policy", "generation"}
    assert set(vars(PrefixCache(SlotAllocator(4), 16))) == {"by_hash", "hash", "parent", "parent_hash", "anchor",
                                                            "namespace", "tokens", "namespaces", "hits",
                                                            "allocator", "page_size", "hash_fn", "group", "sink",
                                                            "fleet"}


def test_an_idle_pool_at_the_default_maximum_size_is_small():
    p = Pool("big", plan(CacheSpec.uniform(32, 8, 128), Sizing(num_slots=1 << 24)))
    enc = snap.encode(1, 1, 0.0, {"big": p.export_state()}, [], snap.WindowState(), METHODS)
    assert enc.nbytes < 16 << 10                             # free stack: one run, not 16.7 M ids
    s = snap.decode(blob(enc))
    assert np.array_equal(s.pools["big"].arrays["free_stack/0"], p.allocators[0]._stack)


@pytest.mark.parametrize("seed", range(3))
def test_runs_encoding_round_trips_any_integer_array(seed):
    rng = np.random.default_rng(seed)
    parts = [np.arange(500, 0, -1), rng.integers(-50, 50, 300), np.full(200, 7), np.arange(40, 1000),
             rng.integers(0, 1 << 40, 70)]
    a = np.concatenate([parts[i] for i in rng.permutation(len(parts))]).astype(np.int64)
    p = PoolState({"version": 1}, {"x": a})
    s = snap.decode(blob(snap.encode(1, 1, 0.0, {"q": p}, [], snap.WindowState(), METHODS)))
    assert s.pools["q"].arrays["x"].dtype == np.int64 and np.array_equal(s.pools["q"].arrays["x"], a)


def test_every_flipped_bit_is_named_or_harmless(busy):
    """One bit flipped anywhere: StateError naming the damaged part, or (alignment padding) the same state."""
    data = blob(encode_manager(busy))
    want = state_tree(busy.manager)
    rng = np.random.default_rng(5)
    outcomes = {"refused": 0, "same": 0}
    for pos in rng.integers(0, 8 * len(data), 300).tolist():
        bad = bytearray(data)
        bad[pos // 8] ^= 1 << (pos % 8)
        try:
            s = snap.decode(bytes(bad))
        except StateError as err:
            assert "snapshot" in err.message
            outcomes["refused"] += 1
            continue
        rebuilt = BlockManager()
        rebuilt.restore(snap.build_pools(s.pools, "test"), s.workers)
        assert state_tree(rebuilt) == want, f"bit {pos} changed the state silently"
        outcomes["same"] += 1
    assert outcomes["refused"] > 250


def test_a_snapshot_from_a_newer_release_or_with_object_arrays_is_refused(busy):
    enc = encode_manager(busy)
    data = blob(enc)
    hlen = int.from_bytes(data[12:16], "little")
    header = json.loads(data[32:32 + hlen])

    def rewrite(h):
        raw = json.dumps(h).encode()
        head = snap._PREFIX.pack(snap.MAGIC, snap.CONTAINER, len(raw), snap.digest16(raw)) + raw
        head += bytes(-len(head) % snap.ALIGN)
        old_head = 32 + hlen + (-(32 + hlen) % snap.ALIGN)
        return head + data[old_head:]

    with pytest.raises(StateError, match="newer kvservice") as exc:
        snap.decode(rewrite({**header, "version": snap.VERSION + 1}))
    assert exc.value.reason == "STATE_TOO_NEW"
    arrays = [dict(a, dtype="|O") if i == 0 else a for i, a in enumerate(header["arrays"])]
    with pytest.raises(StateError, match="not allowed"):
        snap.decode(rewrite({**header, "arrays": arrays}))
    with pytest.raises(StateError, match=r"truncated|past the end"):
        snap.decode(data[:len(data) // 2])
    with pytest.raises(StateError, match="not a kvservice snapshot"):
        snap.decode(b"\x80\x04" + data[2:])                  # e.g. a pickle where a snapshot should be


def broken(state, edit):
    arrays = {k: v.copy() for k, v in state.arrays.items()}
    meta = json.loads(json.dumps(state.meta))
    edit(meta, arrays)
    return PoolState(meta, arrays)


def test_check_pool_state_finds_each_broken_invariant(busy):
    with busy.manager.locked("a") as pool:
        state, p = pool.export_state(), pool.plan
    assert check_pool_state(state, p) == []
    owned = state.arrays["slots/0"]
    free = state.arrays["free_stack/0"]
    assert len(owned) > 2 and len(free) > 1

    def owned_twice(m, a):
        a["slots/0"][1] = a["slots/0"][0]

    def free_and_owned(m, a):
        a["free_stack/0"][0] = a["slots/0"][0]

    def lost_slot(m, a):
        a["free_stack/0"] = a["free_stack/0"][1:]

    def too_long(m, a):
        a["num_tokens"][0] = p.max_seq_len + 1

    def duplicate_id(m, a):
        a["seq_ids"][1] = a["seq_ids"][0]

    def out_of_range(m, a):
        a["free_stack/0"][0] = p.num_slots

    def wrong_count(m, a):
        a["num_tokens"][0] += p.page_size

    cases = {owned_twice: "several owners", free_and_owned: "also owned", lost_slot: "free +",
             too_long: "max_seq_len", duplicate_id: "live twice", out_of_range: "outside",
             wrong_count: "held pages"}
    for edit, words in cases.items():
        problems = check_pool_state(broken(state, edit), p)
        assert problems and any(words in x for x in problems), (edit.__name__, problems)
        with pytest.raises(StateError, match="pool 'a'"):
            snap.build_pools({"a": broken(state, edit)}, "snapshot")


def test_check_pool_state_covers_prefix_caches_and_sliding_windows(busy):
    with busy.manager.locked("c") as pool:
        c, pc = pool.export_state(), pool.plan
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=32)), 16)
    pool = Pool("w", plan(spec, Sizing(num_slots=64, max_seq_len=512)))
    pool.step(admit_ids=[1, 2], admit_tokens=[100, 7])
    pool.step(extend_ids=[1, 2], extend_tokens=[30, 90])
    b, pb_ = pool.export_state(), pool.plan
    assert check_pool_state(c, pc) == [] and check_pool_state(b, pb_) == []
    assert len(c.arrays["prefix/0/slot"]) > 0
    sliding = next(g for g, grp in enumerate(pb_.geometry.groups) if grp.sliding_window)
    assert (b.arrays[f"first/{sliding}"] > 0).any()             # the window released early pages

    def stack_registered(m, a):
        a["free_stack/0"] = np.concatenate((a["free_stack/0"], a["prefix/0/slot"][:1]))

    def bad_namespace(m, a):
        a["prefix/0/namespace"][0] = len(m["prefix"]["namespaces"])

    def window_kept(m, a):
        i = int(np.flatnonzero(a[f"first/{sliding}"] > 0)[0])
        a[f"first/{sliding}"][i] = 0

    assert any("plain free stack" in x or "free twice" in x or "owned" in x
               for x in check_pool_state(broken(c, stack_registered), pc))
    assert any("namespace" in x for x in check_pool_state(broken(c, bad_namespace), pc))
    assert any("slots for" in x for x in check_pool_state(broken(b, window_kept), pb_))


@pytest.mark.parametrize("group_slots", [(), (48, 20, 26)])
@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_hybrid_prefix_cached_pool_round_trips_and_then_behaves_the_same(layout, group_slots):
    """Per-group prefix caches (anchors, parent hashes, LRU order), event numbers and the incarnation come
    back from a snapshot; the restored pool then answers every later step exactly as the original. Also
    with sliding groups smaller than the full one: their counts come back from the snapshot's meta."""
    layers = (LayerSpec(1, 64), LayerSpec(2, 64, sliding_window=8), LayerSpec(1, 32, sliding_window=13))
    pool = Pool("h", plan(CacheSpec(layers, 4, layout), Sizing(num_slots=48, max_seq_len=96, group_slots=group_slots)),
                prefix_caching=True)
    pool.incarnation = 77
    rng = np.random.default_rng(4)
    base = [rng.integers(0, 30, 40).tolist() for _ in range(3)]

    def steps(p, r, n):
        out, live, nxt = [], sorted(p._rows), 1000 + len(p._rows) * 7
        for _ in range(n):
            try:
                if r.random() < 0.5 or not live:
                    toks = [*base[r.integers(0, 3)][:int(r.integers(2, 40))], int(r.integers(0, 30))]
                    res = p.step(admit_ids=[nxt], admit_tokens=[len(toks)], admit_token_ids=np.array(toks))
                    live.append(nxt)
                    nxt += 1
                elif r.random() < 0.7:
                    sid = live[int(r.integers(0, len(live)))]
                    res = p.step(extend_ids=[sid], extend_tokens=[int(r.integers(1, 6))])
                else:
                    res = p.step(free_ids=[live.pop(int(r.integers(0, len(live))))])
                out.append((res.seq_ids.tolist(), [t.slot_mapping.tolist() for t in res.tables],
                            None if res.cached_tokens is None else res.cached_tokens.tolist()))
            except KVError as err:
                out.append(type(err).__name__)
        return out

    steps(pool, rng, 120)
    pool.events.take_batch([])
    assert pool.events.seq > 0 and any(pc.hits for pc in pool.prefixes[1:])
    exported = pool.export_state()
    rebuilt_plan = snap.pool_plan(exported.meta)
    assert rebuilt_plan.group_slots == pool.plan.group_slots == (group_slots or (48, 48, 48))
    assert check_pool_state(exported, rebuilt_plan) == []
    back = Pool.from_state(exported, rebuilt_plan)
    assert state_of(back) == state_of(pool) and back.incarnation == 77 and back.events.seq == pool.events.seq
    assert steps(back, np.random.default_rng(9), 80) == steps(pool, np.random.default_rng(9), 80)
    assert state_of(back) == state_of(pool)
    assert_invariants(back)


def state_of(pool):
    st = pool.export_state()
    return {k: v for k, v in st.meta.items()}, {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in st.arrays.items()}


def test_a_snapshot_without_release_clocks_restores_the_cached_pages_in_their_stored_order():
    """States written before the release clocks were kept (no cached_stamp/<g>) list the cached free slots in
    eviction order: the restored pool keeps that order, and evicts the same slots as the pool that wrote it."""
    ps = 4
    spec = CacheSpec.uniform(2, 1, 64, page_size=ps)
    pool = Pool("p", plan(spec, Sizing(num_slots=24, max_seq_len=96)), prefix_caching=True)
    rng = np.random.default_rng(16)
    for i in range(3):                                # three prompts, released in three steps
        tokens = rng.integers(1, 50_000, 3 * ps + 1)
        pool.step(admit_ids=[i + 1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
    for i in (2, 1, 3):
        pool.step(free_ids=[i])
    state = pool.export_state()
    arrays = {k: v for k, v in state.arrays.items() if not k.startswith("cached_stamp/")}
    old = PoolState(state.meta, arrays)
    assert len(arrays["cached/0"]) >= 9 and check_pool_state(old, pool.plan) == []
    twin = Pool.from_state(old, pool.plan)
    assert twin.export_state().arrays["cached/0"].tolist() == arrays["cached/0"].tolist()
    big = rng.integers(1, 50_000, 20 * ps)            # 20 pages of 24 slots: evicts cached pages in both
    for p in (pool, twin):
        p.step(admit_ids=[9], admit_tokens=[len(big)], admit_token_ids=big)
    assert twin.sequence_slots(9, 0).tolist() == pool.sequence_slots(9, 0).tolist()
    assert twin.allocators[0].evictions == pool.allocators[0].evictions > 0
    assert_invariants(twin)


def test_a_free_stack_kept_as_runs_is_written_as_those_runs():
    """An IdRuns (pool_state: run k's element i is tops[k] - i) is encoded as runs without expanding it, and
    decodes to the ids it stands for, written out by hand here."""
    from kvservice.core.pool_state import IdRuns
    ids = IdRuns(np.array([0, 3, 5], dtype=np.int64), np.array([9, 23, 9], dtype=np.int64), 9)
    enc = snap.encode(1, 1, 0.0, {"q": PoolState({"version": 1}, {"free_stack/0": ids})}, [], snap.WindowState(),
                      METHODS)
    data = blob(enc)
    header = json.loads(bytes(data[snap._PREFIX.size:snap._PREFIX.size + snap._PREFIX.unpack(
        data[:snap._PREFIX.size])[2]]))
    (entry,) = [e for e in header["arrays"] if e["name"] == "pool/q/free_stack/0"]
    assert (entry["encoding"], entry["step"], entry["runs"], entry["shape"]) == ("runs", -1, 3, [9])
    got = snap.decode(data).pools["q"].arrays["free_stack/0"]
    assert got.dtype == np.int64 and got.tolist() == [9, 8, 7, 20, 19, 4, 3, 2, 1]


def test_state_tree_holds_every_array_as_dtype_shape_and_bytes():
    """tree.state_tree's documented form: each pool's arrays (less `skip`) as ("ndarray", dtype, shape, bytes),
    sorted by name; two pools that differ only in their token ids give different trees."""
    rng = np.random.default_rng(17)

    def manager(tokens):
        m = BlockManager()
        m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=4), Sizing(num_slots=32, max_seq_len=64),
                      prefix_caching=True)
        pool, lock = m.pool_and_lock("p")
        with lock:
            pool.step(admit_ids=[5], admit_tokens=[len(tokens)], admit_token_ids=tokens)
        return m

    tokens = rng.integers(1, 50_000, 13).astype(np.int64)
    m = manager(tokens)
    st = m.pool_and_lock("p")[0].export_state()
    meta, arrays = state_tree(m)["pools"]["p"]
    assert meta[0] == "meta" and arrays[0] == "arrays"
    assert [k for k, _ in arrays[1]] == sorted(st.arrays)
    for k, (tag, dtype, shape, data) in arrays[1]:
        a = np.asarray(st.arrays[k])
        assert (tag, dtype, shape, data) == ("ndarray", a.dtype.str, a.shape, a.tobytes()), k
    skip = frozenset({sorted(st.arrays)[0]})
    assert [k for k, _ in state_tree(m, skip)["pools"]["p"][1][1]] == sorted(st.arrays)[1:]
    other = tokens.copy()
    other[0] += 1
    assert state_tree(manager(other)) != state_tree(m)
