"""ManagerAPI, BlockManager, replies and WorkerRegistry against hand-kept models: PoolStats after random steps
(slots = sum of ceil(tokens / page_size), docs/DESIGN.md), apply_step changing a pool exactly as Step does,
incarnations of created and deleted pools, the derived incarnation's documented formula, the layer range a
worker may register and the pool filter of the registry."""

import hashlib

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, KVError, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.manager.api import ManagerAPI, derived_incarnation
from kvservice.manager.pools import BlockManager
from kvservice.manager.workers import WorkerRegistry
from kvservice.v1 import block_manager_pb2 as pb

PS = 4
SLOTS = 40
SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)


def _u64(a):
    return to_tensor(np.asarray(a, dtype=np.uint64))


def _i64(a):
    return to_tensor(np.asarray(a, dtype=np.int64))


def _pages(n):
    return -(-n // PS)


def _random_request(rng, live, next_id):
    """A Step request over the model `live` (seq id -> tokens): frees, extensions and admissions."""
    ids = list(live)
    free = [i for i in ids if rng.random() < 0.25]
    ext = [i for i in ids if i not in free and rng.random() < 0.5]
    admit = list(range(next_id, next_id + int(rng.integers(0, 4))))
    r = pb.StepRequest(pool="p")
    if free:
        r.free_seq_ids.CopyFrom(_u64(free))
    k = rng.integers(1, 3 * PS, len(ext))
    if ext:
        r.extend_seq_ids.CopyFrom(_u64(ext))
        r.extend_num_tokens.CopyFrom(_i64(k))
    n = rng.integers(1, 6 * PS, len(admit))
    if admit:
        r.admit_seq_ids.CopyFrom(_u64(admit))
        r.admit_num_tokens.CopyFrom(_i64(n))
    return r, free, dict(zip(ext, k.tolist(), strict=True)), dict(zip(admit, n.tolist(), strict=True))


def test_pool_stats_follow_a_model_of_random_steps():
    rng = np.random.default_rng(17)
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS))
    api = ManagerAPI(m)
    live: dict[int, int] = {}
    next_id, steps, admitted, refused, peak = 1, 0, 0, 0, 0
    for _ in range(80):
        r, free, ext, adm = _random_request(rng, live, next_id)
        new = {i: n for i, n in live.items() if i not in free}
        for i, k in ext.items():
            new[i] += k
        new.update(adm)
        used = sum(_pages(n) for n in new.values())
        try:
            api.Step(r)
        except ResourceExhausted:
            assert used > SLOTS
            refused += 1
            continue
        assert used <= SLOTS
        live, steps, admitted, peak = new, steps + 1, admitted + len(adm), max(peak, used)
        next_id += len(adm)
        s = api.GetStats(pb.GetStatsRequest(pool="p")).pools["p"]
        want = pb.PoolStats(num_slots=SLOTS, num_free_slots=SLOTS - used, peak_used_slots=peak,
                            num_sequences=len(live), num_tokens=sum(live.values()), steps=steps, admitted=admitted,
                            refused=refused, prefix_caching=False)
        assert s == want
    assert refused > 3 and peak > SLOTS // 2
    info = api.GetPool(pb.GetPoolRequest(pool="p"))
    assert info.stats.peak_used_slots == peak and info.stats.refused == refused


def test_apply_step_changes_the_pool_as_step_does():
    rng = np.random.default_rng(29)
    a, b = BlockManager(), BlockManager()
    for m in (a, b):
        m.create_pool("p", SPEC, Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS), incarnation=77)
    api_a, api_b = ManagerAPI(a), ManagerAPI(b)
    live: dict[int, int] = {}
    next_id, applied = 1, 0
    for _ in range(40):
        r, free, ext, adm = _random_request(rng, live, next_id)
        try:
            api_a.Step(r)
        except KVError as err:
            with pytest.raises(type(err)):
                api_b.apply_step(r)
        else:
            assert api_b.apply_step(r) is None
            applied += 1
            live = {i: n for i, n in live.items() if i not in free}
            for i, k in ext.items():
                live[i] += k
            live.update(adm)
            next_id += len(adm)
        with a.locked("p") as pa, b.locked("p") as pb_:
            (ia, ta), (ib, tb) = pa.sequences(), pb_.sequences()
            assert ia.tolist() == ib.tolist() == sorted(live)
            assert ta.tolist() == tb.tolist() == [live[i] for i in sorted(live)]
            assert pa.num_free_slots == pb_.num_free_slots and pa.steps == pb_.steps
    assert applied > 20
    bad = pb.StepRequest(pool="p", extend_seq_ids=_u64([10**6]), extend_num_tokens=_i64([3]))
    with pytest.raises(KVError):
        api_b.apply_step(bad)


def test_incarnations_of_created_and_deleted_pools():
    m = BlockManager()
    api = ManagerAPI(m)
    m.create_pool("a", SPEC, Sizing(num_slots=8, max_seq_len=32), incarnation=5)
    m.create_pool("b", SPEC, Sizing(num_slots=8, max_seq_len=32))
    inc_b = m.incarnation("b")
    assert 1 <= inc_b < 2**63 and m.incarnations() == {"a": 5, "b": inc_b}
    assert api.GetPool(pb.GetPoolRequest(pool="a")).incarnation == 5
    m.delete_pool("a")
    assert m.incarnations() == {"b": inc_b} and "a" not in m._incarnations
    with pytest.raises(NotFound):
        m.incarnation("a")
    m.create_pool("a", SPEC, Sizing(num_slots=8, max_seq_len=32), incarnation=9)
    assert m.incarnations() == {"a": 9, "b": inc_b}
    with m.locked("a") as pool:                       # the new pool has a lock of its own
        assert pool.name == "a" and pool.incarnation == 9
    held = m.pool_and_lock("a")[1]
    assert held.acquire(blocking=False)
    try:
        assert not held.acquire(blocking=False)
    finally:
        held.release()


def test_derived_incarnation_is_the_documented_hash_of_the_request():
    rng = np.random.default_rng(3)
    for _ in range(20):
        req = pb.CreatePoolRequest(name=f"p{int(rng.integers(1 << 30))}", model=str(rng.integers(1 << 40)))
        digest = hashlib.blake2b(req.SerializeToString(deterministic=True), digest_size=8).digest()
        want = sum(b << (8 * i) for i, b in enumerate(digest)) >> 1        # little-endian, then one bit less
        assert derived_incarnation(req) == (want or 1)
        assert 1 <= derived_incarnation(req) < 2**63


@pytest.mark.parametrize("num_layers", [1, 3, 4])
def test_a_worker_registers_exactly_the_layer_ranges_inside_the_pool(num_layers):
    reg = WorkerRegistry(lease_seconds=5.0, clock=lambda: 100.0)
    n = 0
    for begin in range(-1, num_layers + 2):
        for end in range(-1, num_layers + 2):
            eff = end or num_layers
            ok = 0 <= begin < eff <= num_layers
            n += 1
            if ok:
                rec = reg.register(f"w{n}", "p", num_layers, layer_begin=begin, layer_end=end)
                assert (rec.layer_begin, rec.layer_end) == (begin, eff)
            else:
                with pytest.raises(InvalidArgument):
                    reg.register(f"w{n}", "p", num_layers, layer_begin=begin, layer_end=end)


def test_the_registry_lists_a_pools_workers_or_all_sorted_by_id():
    rng = np.random.default_rng(41)
    reg = WorkerRegistry(lease_seconds=5.0, clock=lambda: 7.0)
    want: dict[str, str] = {}
    for _ in range(30):
        wid = f"w-{int(rng.integers(1000)):03d}"
        pool = str(rng.choice(["x", "y", "z"]))
        if wid in want:
            continue
        reg.register(wid, pool, 4)
        want[wid] = pool
    assert [w.worker_id for w in reg.workers()] == sorted(want)
    for pool in ("x", "y", "z", "none"):
        got = reg.workers(pool)
        assert [w.worker_id for w in got] == sorted(k for k, v in want.items() if v == pool)
        assert all(w.pool == pool for w in got)
    api_m = BlockManager()
    api_m.create_pool("x", SPEC, Sizing(num_slots=8, max_seq_len=32))
    api_m.create_pool("y", SPEC, Sizing(num_slots=8, max_seq_len=32))
    for wid, pool in (("b", "x"), ("a", "y"), ("c", "x")):
        api_m.register_worker(wid, pool)
    api = ManagerAPI(api_m)
    assert [w.worker_id for w in api.ListWorkers(pb.ListWorkersRequest()).workers] == ["a", "b", "c"]
    assert [w.worker_id for w in api.ListWorkers(pb.ListWorkersRequest(pool="x")).workers] == ["b", "c"]


def test_delete_pool_refuses_live_sequences_then_forgets_the_pool_and_its_workers():
    m = BlockManager()
    api = ManagerAPI(m)
    for name in ("a", "b"):
        m.create_pool(name, SPEC, Sizing(num_slots=8, max_seq_len=32), prefix_caching=True, incarnation=3)
    m.register_worker("wa", "a")
    m.register_worker("wb", "b")
    api.Step(pb.StepRequest(pool="a", admit_seq_ids=_u64([5]), admit_num_tokens=_i64([6])))
    with pytest.raises(KVError) as e:
        api.DeletePool(pb.DeletePoolRequest(pool="a"))
    assert e.value.reason == "FAILED_PRECONDITION"
    assert m.pool_names() == ["a", "b"] and m.incarnations() == {"a": 3, "b": 3}
    assert [w.worker_id for w in m.workers.workers()] == ["wa", "wb"]
    api.DeletePool(pb.DeletePoolRequest(pool="a", force=True))
    assert m.pool_names() == ["b"] and m.incarnations() == {"b": 3}
    assert [w.worker_id for w in m.workers.workers()] == ["wb"]
    assert [p.name for p in api.ListPools(pb.ListPoolsRequest()).pools] == ["b"]
    with pytest.raises(NotFound):
        api.DeletePool(pb.DeletePoolRequest(pool="a"))
    m.register_worker("wa", "b")                          # its worker_id is free again


def test_prefix_cache_hits_in_pool_stats_are_the_pages_admissions_found():
    rng = np.random.default_rng(53)
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=2000, max_seq_len=400), prefix_caching=True)
    api = ManagerAPI(m)
    family = rng.integers(1, 10_000, 80)
    seen: set = set()
    hits = 0
    for i in range(1, 25):
        prompt = np.concatenate((family[:int(rng.integers(1, 80))], rng.integers(1, 10_000, int(rng.integers(0, 7)))))
        pages = [tuple(prompt[j * PS:(j + 1) * PS]) for j in range(len(prompt) // PS)]
        found = 0
        while found < (len(prompt) - 1) // PS and tuple(pages[:found + 1]) in seen:
            found += 1
        seen.update(tuple(pages[:j]) for j in range(1, len(pages) + 1))
        hits += found
        reply = api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([i]), admit_num_tokens=_i64([len(prompt)]),
                                        admit_token_ids=_i64(prompt)))
        assert np.frombuffer(reply.admit_cached_tokens.data, np.int64).tolist() == [found * PS]
        s = api.GetStats(pb.GetStatsRequest()).pools["p"]
        assert s.prefix_caching and s.prefix_cache_hits == hits and s.admitted == i and s.steps == i
    assert hits > 30


def test_list_sequences_is_the_live_rows_by_id_with_their_slots():
    rng = np.random.default_rng(61)
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=400, max_seq_len=200))
    ids = np.unique(rng.integers(1, 10**12, 40))[:12]
    rng.shuffle(ids)
    toks = rng.integers(1, 60, 12)
    ManagerAPI(m).Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(ids), admit_num_tokens=_i64(toks)))
    model = sorted(zip(ids.tolist(), toks.tolist(), strict=True))
    per_seq = 36 + 11 * 1                                     # SequenceInfo bytes at most, one layer group
    cases = [(0, 0, True), (0, 7, True)]
    for limit_bytes in (64 + 5 * per_seq, 64 + 6 * per_seq - 1):      # room for 5 rows, not 6: 64 framing
        cases += [(limit_bytes, 5, True), (limit_bytes, 4, True), (limit_bytes, 6, False), (limit_bytes, 0, False)]
    for max_bytes, limit, ok in cases:
        api = ManagerAPI(m, max_reply_bytes=max_bytes)
        req = pb.ListSequencesRequest(pool="p", limit=limit)
        if not ok:
            with pytest.raises(ResourceExhausted) as e:
                api.ListSequences(req)
            assert e.value.reason == "REPLY_TOO_LARGE" and e.value.metadata["fits"] == "5"
            continue
        reply = api.ListSequences(req)
        rows = model[:limit] if limit else model
        assert reply.total == 12
        assert [(s.seq_id, s.num_tokens, s.num_slots, list(s.num_slots_per_group)) for s in reply.sequences] == \
            [(i, n, _pages(n), [_pages(n)]) for i, n in rows]


def test_register_checks_backend_tensor_parallel_rank_and_id():
    reg = WorkerRegistry(lease_seconds=5.0, clock=lambda: 1.0)
    n = 0
    for tp_size in (0, 1, 2, 4):
        for tp_rank in range(0, 6):
            n += 1
            if tp_rank < (tp_size or 1):
                rec = reg.register(f"w{n}", "p", 2, tp_rank=tp_rank, tp_size=tp_size, backend="cuda")
                assert (rec.tp_rank, rec.tp_size, rec.backend, rec.epoch) == (tp_rank, tp_size or 1, "cuda", 1)
            else:
                with pytest.raises(InvalidArgument):
                    reg.register(f"w{n}", "p", 2, tp_rank=tp_rank, tp_size=tp_size)
    for bad in ("", "a b", "x" * 129, "w\n", "w/1"):
        with pytest.raises(InvalidArgument):
            reg.register(bad, "p", 2)
    with pytest.raises(InvalidArgument):
        reg.register("ok", "p", 2, backend="tpu")
    assert reg.register("x" * 128, "p", 2).epoch == 1 and reg.register("x" * 128, "p", 2).epoch == 2


def test_heartbeat_and_register_replies_carry_the_lease():
    m = BlockManager(lease_seconds=7.5)
    m.create_pool("p", SPEC, Sizing(num_slots=8, max_seq_len=32), incarnation=12)
    api = ManagerAPI(m)
    r = api.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w", pool="p", layer_end=1, address="h:1",
                                                    backend="cpu"))
    assert (r.epoch, r.lease_seconds, r.pool.name, r.pool.incarnation) == (1, 7.5, "p", 12)
    assert api.Heartbeat(pb.HeartbeatRequest(worker_id="w", epoch=1, pool="p", incarnation=12)).lease_seconds == 7.5
    (w,) = api.ListWorkers(pb.ListWorkersRequest(pool="p")).workers
    assert (w.worker_id, w.layer_begin, w.layer_end, w.address, w.epoch, w.alive, w.incarnation) == \
        ("w", 0, 1, "h:1", 1, True, 12)


def test_every_reply_fits_the_bound_reserved_for_it_and_an_oversized_step_changes_nothing():
    rng = np.random.default_rng(71)
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS))
    api = ManagerAPI(m, max_reply_bytes=1 << 20)
    reserved: list[int] = []
    api.reserve_reply = reserved.append
    live: dict[int, int] = {}
    next_id = 1
    for _ in range(60):
        r, free, ext, adm = _random_request(rng, live, next_id)
        r.omit_tables = bool(rng.random() < 0.3)
        r.include_block_table = bool(rng.random() < 0.3)
        n = len(reserved)
        b0 = api.step_reply_bound(r, level=0)          # from the request alone (the limit is far above it)
        try:
            reply = api.Step(r)
        except ResourceExhausted:
            continue
        assert len(reserved) == n + 1 and reply.ByteSize() <= reserved[-1] == b0.total
        live = {i: k for i, k in live.items() if i not in free}
        for i, k in ext.items():
            live[i] += k
        live.update(adm)
        next_id += len(adm)
    assert len(reserved) > 30
    small = ManagerAPI(m, max_reply_bytes=200)
    with m.locked("p") as pool:
        before = [a.tolist() for a in pool.sequences()], pool.steps
    big = pb.StepRequest(pool="p", admit_seq_ids=_u64(range(10**6, 10**6 + 30)), admit_num_tokens=_i64([4] * 30))
    with pytest.raises(ResourceExhausted) as e:
        small.Step(big)
    assert e.value.reason == "REPLY_TOO_LARGE" and e.value.metadata["limit"] == "200"
    assert int(e.value.metadata["reply_bytes"]) > 200
    with m.locked("p") as pool:
        assert ([a.tolist() for a in pool.sequences()], pool.steps) == before
