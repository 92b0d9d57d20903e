"""The journal: recovery rebuilds the exact state, retries are answered once, failures stop, limits hold."""

import sqlite3
import time

import numpy as np
import pytest

from kvservice.errors import AlreadyExists, InvalidArgument, KVError, ResourceExhausted
from kvservice.geometry import CacheSpec, LayerSpec
from kvservice.invariants import assert_invariants
from kvservice.journal import Journal, JournalConfig, StateError, create_request, state_tree
from kvservice.manager import BlockManager
from kvservice.planner import Sizing
from kvservice.servicer import JournalUnavailable, Limits
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.wire import to_tensor

FAST = JournalConfig(sync="normal", compact_every=1000)


def step_req(pool, free=(), extend=(), k=1, admit=(), n=(), rid="", **extra):
    r = pb.StepRequest(pool=pool, request_id=rid, **extra)
    if len(free):
        r.free_seq_ids.CopyFrom(to_tensor(np.asarray(free, np.uint64)))
    if len(extend):
        r.extend_seq_ids.CopyFrom(to_tensor(np.asarray(extend, np.uint64)))
        r.extend_num_tokens.CopyFrom(to_tensor(np.broadcast_to(np.int64(k), (len(extend),)).copy()))
    if len(admit):
        r.admit_seq_ids.CopyFrom(to_tensor(np.asarray(admit, np.uint64)))
        r.admit_num_tokens.CopyFrom(to_tensor(np.asarray(n, np.int64)))
    return r


def run(j, method, req):
    return j.execute(method, req, getattr(j.api, method))


def crash(j):
    """Drop a journal as kill -9 would: no snapshot, nothing flushed beyond what was committed."""
    j.close(snapshot=False)


def workload(j, rng, steps, pools=("a", "b")):
    """Random admits, extends and frees over two pools (one interleaved with a sliding group)."""
    live = {p: {} for p in pools}
    next_id = 1
    for _ in range(steps):
        p = pools[rng.integers(len(pools))]
        seqs = live[p]
        ids = list(seqs)
        free = [i for i in ids if rng.random() < 0.15]
        ext = [i for i in ids if i not in free and rng.random() < 0.7]
        admit = list(range(next_id, next_id + int(rng.integers(0, 4))))
        next_id += len(admit)
        n = rng.integers(1, 90, len(admit))
        k = int(rng.integers(1, 20))
        try:
            run(j, "Step", step_req(p, free, ext, k, admit, n, rid=f"r{next_id}-{rng.integers(1 << 30)}"))
        except (ResourceExhausted, InvalidArgument):
            run(j, "Step", step_req(p, free=ids))          # preempt everything
            seqs.clear()
            continue
        for i in free:
            del seqs[i]
        for i in ext:
            seqs[i] += k
        seqs.update(zip(admit, n.tolist(), strict=True))


def prefix_workload(j, rng, steps, pool="c") -> dict[int, int]:
    """Admissions sharing prompt prefixes (prefix cache hits), forks (shared slots, copy-on-write) and frees.

    Returns the live sequences it expects (id -> tokens)."""
    live: dict[int, int] = {}
    prompts = [rng.integers(0, 50, 200) for _ in range(3)]
    next_id = 10_000
    for _ in range(steps):
        ids = list(live)
        free = [i for i in ids if rng.random() < 0.2]
        rest = [i for i in ids if i not in free]
        parents = [i for i in rest if rng.random() < 0.2][:2]
        children = list(range(next_id, next_id + len(parents)))
        ext = [i for i in rest if rng.random() < 0.5]
        admit = list(range(next_id + len(parents), next_id + len(parents) + int(rng.integers(0, 3))))
        next_id += len(parents) + len(admit)
        n = rng.integers(1, 120, len(admit))
        toks = [prompts[rng.integers(3)][:m] for m in n.tolist()]
        extra = {}
        if parents:
            extra = {"fork_parent_ids": to_tensor(np.asarray(parents, np.uint64)),
                     "fork_child_ids": to_tensor(np.asarray(children, np.uint64))}
        req = step_req(pool, free, ext, 3, admit, n, rid=f"c{next_id}", **extra)
        if admit:
            req.admit_token_ids.CopyFrom(to_tensor(np.concatenate(toks).astype(np.int64)))
        try:
            run(j, "Step", req)
        except (ResourceExhausted, InvalidArgument):
            run(j, "Step", step_req(pool, free=ids))
            live.clear()
            continue
        for i in free:
            del live[i]
        live.update((c, live[p]) for p, c in zip(parents, children, strict=True))
        for i in ext:
            live[i] += 3
        live.update(zip(admit, n.tolist(), strict=True))
    return live


def setup_pools(j):
    run(j, "CreatePool", create_request("a", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=96,
                                        max_seq_len=512), ()))
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128), LayerSpec(2, 64, sliding_window=32)), 16, "interleaved")
    run(j, "CreatePool", create_request("b", spec, Sizing(num_slots=64, max_seq_len=512), ()))
    c = create_request("c", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=512), ())
    c.enable_prefix_caching = True
    run(j, "CreatePool", c)
    run(j, "RegisterWorker", pb.RegisterWorkerRequest(worker_id="w0", pool="a", backend="cpu", address="127.0.0.1:1"))


@pytest.mark.parametrize("compact_every", [1000, 17])
def test_recovery_rebuilds_the_exact_state(tmp_path, compact_every):
    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=compact_every))
    setup_pools(j)
    workload(j, np.random.default_rng(compact_every), 150)
    live = prefix_workload(j, np.random.default_rng(compact_every), 80)
    with j.manager.locked("c") as pool:
        assert pool.prefix.hits > 0                                   # the prefix cache was exercised
        ids, tokens = pool.sequences()
        assert ids.tolist() == sorted(live) and tokens.tolist() == [live[i] for i in sorted(live)]
    before = state_tree(j.manager)
    crash(j)
    j2 = Journal.open(tmp_path, config=FAST)
    assert state_tree(j2.manager) == before
    for name in j2.manager.pool_names():
        with j2.manager.locked(name) as pool:
            assert_invariants(pool)
    # The recovered manager keeps going exactly like the original would have.
    workload(j2, np.random.default_rng(5), 40)
    after = state_tree(j2.manager)
    j2.close()                                            # clean: snapshot
    j3 = Journal.open(tmp_path, config=FAST)
    assert state_tree(j3.manager) == after and j3.seq == j3.snapshot_seq
    j3.close()


def test_snapshots_bound_the_journal_tail(tmp_path):
    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=10))
    setup_pools(j)
    workload(j, np.random.default_rng(1), 45)
    assert j.snapshots >= 3 and j.seq - j.snapshot_seq < 10
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == j.seq - j.snapshot_seq
    assert db.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0] == 1
    db.close()
    crash(j)


def test_retry_returns_the_original_reply_and_allocates_nothing(tmp_path):
    j = Journal.open(tmp_path, config=FAST)
    setup_pools(j)
    req = step_req("a", admit=[1, 2], n=[40, 17], rid="step-1")
    first = run(j, "Step", req)
    free = first.num_free_slots
    again = run(j, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))
    assert again.SerializeToString() == first.SerializeToString()
    with j.manager.locked("a") as pool:
        assert pool.num_free_slots == free and pool.steps == 1
    with pytest.raises(InvalidArgument) as exc:                       # same id, another request
        run(j, "Step", step_req("a", admit=[3], n=[1], rid="step-1"))
    assert exc.value.reason == "REQUEST_ID_REUSED"
    crash(j)
    j2 = Journal.open(tmp_path, config=FAST)                          # the reply is regenerated by replay
    assert run(j2, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1")).SerializeToString() == \
        first.SerializeToString()
    j2.close()                                                        # ... or comes from the snapshot
    j3 = Journal.open(tmp_path, config=FAST)
    assert j3.seq == j3.snapshot_seq
    assert run(j3, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1")).SerializeToString() == \
        first.SerializeToString()
    assert j3.window.hits == 1
    j3.close()


def test_idempotency_window_is_bounded():
    j = Journal(BlockManager(), config=JournalConfig(id_window=3, reply_cache_bytes=1))
    setup_pools(j)
    for i in range(5):
        run(j, "Step", step_req("a", admit=[i + 1], n=[3], rid=f"id{i}"))
    assert list(j.window.ids) == ["id2", "id3", "id4"]
    with pytest.raises(AlreadyExists) as exc:             # known id, reply dropped: never applied twice
        run(j, "Step", step_req("a", admit=[5], n=[3], rid="id4"))
    assert exc.value.reason == "REQUEST_ALREADY_APPLIED"
    with pytest.raises(AlreadyExists):                    # forgotten id: applied again, the domain refuses it
        run(j, "Step", step_req("a", admit=[1], n=[3], rid="id0"))


def test_window_expires_by_age():
    j = Journal(BlockManager(), config=JournalConfig(id_window_seconds=0.05))
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[1], n=[3], rid="old"))
    time.sleep(0.1)
    run(j, "Step", step_req("a", admit=[2], n=[3], rid="new"))
    assert list(j.window.ids) == ["new"]


def test_write_failure_fail_stops_and_acknowledges_nothing(tmp_path):
    j = Journal.open(tmp_path, config=FAST)
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[1], n=[20], rid="ok"))
    durable = state_tree(j.manager)
    stops = []
    j.on_fail = stops.append

    def broken(*_a):
        raise sqlite3.OperationalError("disk I/O error")
    j.store.append = broken
    with pytest.raises(JournalUnavailable, match="not made durable"):
        run(j, "Step", step_req("a", admit=[2], n=[20], rid="lost"))
    assert stops and "disk I/O error" in stops[0] and j.failed
    with pytest.raises(JournalUnavailable):
        run(j, "Step", step_req("a", admit=[3], n=[20]))
    with pytest.raises(JournalUnavailable):
        j.read(pb.GetPoolRequest(pool="a"), j.api.GetPool)
    crash(j)
    j2 = Journal.open(tmp_path, config=FAST)
    assert state_tree(j2.manager) == durable              # the unacknowledged step is not there
    j2.close()


def test_unexpected_error_fail_stops_a_durable_journal_only(tmp_path):
    def bug(_request):
        raise RuntimeError("a bug")
    mem = Journal(BlockManager())
    with pytest.raises(RuntimeError):
        mem.execute("Step", step_req("a"), bug)
    assert mem.failed is None
    j = Journal.open(tmp_path, config=FAST)
    with pytest.raises(RuntimeError):
        j.execute("Step", step_req("a"), bug)
    assert j.failed and "may differ" in j.failed
    crash(j)


def test_refused_requests_are_not_journaled(tmp_path):
    j = Journal.open(tmp_path, config=FAST)
    setup_pools(j)
    seq = j.seq
    with pytest.raises(KVError):
        run(j, "Step", step_req("a", extend=[99], rid="x"))
    assert j.seq == seq and "x" not in j.window.ids
    crash(j)


def test_state_dir_is_locked_and_checked(tmp_path):
    j = Journal.open(tmp_path, config=FAST)
    with pytest.raises(StateError, match="in use by another kvservice"):
        Journal.open(tmp_path, config=FAST)
    ro = Journal.open(tmp_path, readonly=True)            # inspection works while it runs
    ro.close()
    crash(j)
    with pytest.raises(StateError, match="no kvservice state"):
        Journal.open(tmp_path / "empty", readonly=True)


def test_snapshot_from_another_pool_layout_is_refused(tmp_path, monkeypatch):
    j = Journal.open(tmp_path, config=FAST)
    setup_pools(j)
    j.close()
    import kvservice.journal as journal_mod
    monkeypatch.setattr(journal_mod, "_pool_fields", lambda: frozenset({"name", "new_field"}))
    with pytest.raises(StateError, match="another Pool layout"):
        Journal.open(tmp_path, config=FAST)


def test_workers_survive_a_restart_with_a_fresh_lease(tmp_path):
    j = Journal.open(tmp_path, lease_seconds=0.6, config=FAST)
    setup_pools(j)
    epoch = run(j, "RegisterWorker", pb.RegisterWorkerRequest(worker_id="w1", pool="b", backend="cpu")).epoch
    time.sleep(0.7)                                       # w1's lease lapses before the crash
    crash(j)
    j2 = Journal.open(tmp_path, lease_seconds=0.6, config=FAST)
    (w1,) = [w for w in j2.manager.workers.workers() if w.worker_id == "w1"]
    assert w1.epoch == epoch and w1.alive                 # recovered alive, fresh lease
    j2.api.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=epoch))
    with pytest.raises(KVError, match="epoch"):           # fencing survives: a stale epoch is refused
        j2.api.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=epoch - 1 if epoch > 1 else epoch + 5))
    time.sleep(0.7)
    assert not next(w for w in j2.manager.workers.workers() if w.worker_id == "w1").alive
    again = run(j2, "RegisterWorker", pb.RegisterWorkerRequest(worker_id="w1", pool="b", backend="cpu"))
    assert again.epoch == epoch + 1
    j2.close()


def test_limits_refuse_oversized_requests():
    m = BlockManager()
    lim = Limits(max_step_sequences=4, max_step_tokens=100, max_pool_slots=1000, max_pools=1)
    lim.check("Step", step_req("p", admit=[1, 2, 3, 4], n=[25] * 4), m)
    for req, words in [(step_req("p", free=[1, 2], admit=[3, 4, 5], n=[1] * 3), "sequences in one Step: 5"),
                       (step_req("p", admit=[1], n=[101]), "admit_num_tokens entry"),
                       (step_req("p", extend=[1, 2], k=60), "new tokens in one Step: 120"),
                       (step_req("p", rid="x" * 200), "request_id")]:
        with pytest.raises(InvalidArgument, match=words) as exc:
            lim.check("Step", req, m)
        assert exc.value.reason == "LIMIT_EXCEEDED"
    with pytest.raises(InvalidArgument, match="slots x layer groups"):
        lim.check("CreatePool", create_request("big", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=1001), ()), m)
    m.create_pool("one", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=8))
    with pytest.raises(ResourceExhausted, match="--max-pools"):
        lim.check("CreatePool", create_request("two", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=8), ()), m)
