"""The journal: retries are answered once, refusals keep serving, storage failures stop, bugs are healed from the
journal, replies carry positions, reads and snapshots do not stall other calls, limits hold.

Recovery itself (exact state, per backend) is tests/unit/test_journal_backends.py; damaged state dirs are
tests/unit/test_state_integrity.py.
"""

import sqlite3
import threading
import time

import numpy as np
import pytest

from kvservice.contract.errors import (
    AlreadyExists,
    InvalidArgument,
    JournalUnavailable,
    KVError,
    ResourceExhausted,
    StateError,
)
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.invariants import assert_invariants
from kvservice.manager.pools import BlockManager
from kvservice.server.limits import Limits
from kvservice.state.journal import Journal, JournalConfig, MemoryStore
from kvservice.state.startup import create_request
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2

FAST = JournalConfig(sync="normal", compact_every=1000, background_snapshots=False)


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


def body(reply):
    """A reply's bytes without its journal position (which says when and by which incarnation it was sent)."""
    r = type(reply)()
    r.CopyFrom(reply)
    if "position" in r.DESCRIPTOR.fields_by_name:
        r.ClearField("position")
    return r.SerializeToString()


def crash(j):
    """Stop a journal without a snapshot: recovery then replays its whole tail.

    (A true kill -9 image of a state dir is test_state_integrity.crash_copy; the integration tests kill processes.)
    """
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


def test_snapshots_bound_the_journal_tail(tmp_path):
    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=10, background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(1), 45)
    assert j.snapshots >= 3 and j.seq - j.snapshot_seq < 10
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == j.seq - j.snapshot_seq
    assert db.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0] == 1
    db.close()
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == [f"snapshot-{j.snapshot_seq:012d}.kvs"]
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
    assert body(run(j2, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))) == body(first)
    j2.close()                                                        # ... or comes from the snapshot
    j3 = Journal.open(tmp_path, config=FAST)
    assert j3.seq == j3.snapshot_seq
    assert body(run(j3, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))) == body(first)
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


# ---- refusals, bugs and storage failures -------------------------------------------------------------
def hostile_step(pool="a"):
    """A 30-byte Step whose admit_seq_ids declares a shape of 2^64 elements over no data."""
    t = common_pb2.Tensor(dtype=common_pb2.UINT64, shape=[1 << 32, 1 << 32], data=b"")
    return pb.StepRequest(pool=pool, admit_seq_ids=t, admit_num_tokens=to_tensor(np.ones(1, np.int64)), request_id="h")


@pytest.mark.parametrize("durable", [False, True])
def test_an_undecodable_step_is_refused_and_the_manager_keeps_serving(tmp_path, durable):
    j = Journal.open(tmp_path, config=FAST) if durable else Journal(BlockManager(), config=FAST)
    setup_pools(j)
    before, seq = state_tree(j.manager), j.seq
    with pytest.raises(InvalidArgument, match="admit_seq_ids"):
        run(j, "Step", hostile_step())
    assert j.failed is None and j.seq == seq and "h" not in j.window.ids and j.resyncs == 0
    assert state_tree(j.manager) == before
    reply = run(j, "Step", step_req("a", admit=[7], n=[33], rid="after"))       # still serving
    assert reply.num_tokens.data == np.array([33], np.int64).tobytes() and reply.position.seq == seq + 1
    j.close()


def buggy_step(j, request):
    """A Step that changes the pool, then fails unexpectedly (a bug past the point of no return)."""
    j.api.Step(request)
    raise RuntimeError("bug after the change")


@pytest.mark.parametrize("durable", [False, True])
def test_an_unexpected_error_rebuilds_the_manager_from_the_journal(tmp_path, durable):
    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=7, background_snapshots=False)) \
        if durable else Journal(BlockManager(), config=JournalConfig(compact_every=7, background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(3), 20)                  # a snapshot and a tail to rebuild from
    acknowledged, seq = state_tree(j.manager), j.seq
    with j.manager.locked("a") as pool:
        live = pool.sequences()[0].tolist()
    with pytest.raises(RuntimeError, match="bug after"):
        j.execute("Step", step_req("a", free=live, admit=[900], n=[70], rid="bug"), lambda r: buggy_step(j, r))
    assert j.resyncs == 1 and j.failed is None and j.seq == seq and "bug" not in j.window.ids
    assert state_tree(j.manager) == acknowledged                 # the half-applied change is gone
    for name in j.manager.pool_names():
        with j.manager.locked(name) as pool:
            assert_invariants(pool)
    run(j, "Step", step_req("a", admit=[900], n=[70], rid="ok"))  # and it keeps serving
    with j.manager.locked("a") as pool:
        assert 900 in pool.sequences()[0].tolist()
    j.close()


def test_a_journal_that_cannot_rebuild_stops():
    store = MemoryStore()
    j = Journal.recover(store, config=JournalConfig(compact_every=5, background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(4), 8)
    seq, blob = store._snapshot
    store._snapshot = (seq, blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])     # the baseline is damaged
    stops = []
    j.on_fail = stops.append
    with pytest.raises(RuntimeError):
        j.execute("Step", step_req("a", admit=[901], n=[5]), lambda r: buggy_step(j, r))
    assert j.failed and "rebuilding the manager from the journal failed" in j.failed and stops
    with pytest.raises(JournalUnavailable):
        run(j, "Step", step_req("a", admit=[902], n=[5]))


# ---- positions -------------------------------------------------------------------------------------
def test_replies_carry_the_journal_position_and_a_restart_bumps_the_incarnation():
    store = MemoryStore()
    j = Journal.recover(store, config=FAST)
    setup_pools(j)                                               # 3 CreatePool + 1 RegisterWorker
    first = run(j, "Step", step_req("a", admit=[1], n=[20], rid="p1"))
    assert (first.position.incarnation, first.position.seq) == (1, 5)
    run(j, "Step", step_req("a", extend=[1], k=3, rid="p2"))
    again = run(j, "Step", step_req("a", admit=[1], n=[20], rid="p1"))          # a retry: now's position
    assert (again.position.incarnation, again.position.seq) == (1, 6)
    assert again.seq_ids == first.seq_ids and again.tables == first.tables
    info = j.read(pb.GetPoolRequest(pool="a"), j.api.GetPool)
    assert info.position.seq == 6 and info.stats.num_sequences == 1
    deleted = run(j, "DeletePool", pb.DeletePoolRequest(pool="b", request_id="d"))
    assert deleted.position.seq == 7
    j.close(snapshot=False)
    j2 = Journal.recover(store, config=FAST)                     # the next incarnation continues the count
    r = run(j2, "Step", step_req("a", extend=[1], k=1, rid="p3"))
    assert (r.position.incarnation, r.position.seq) == (2, 8)


# ---- stalls ------------------------------------------------------------------------------------------
def _waiters(j) -> int:
    return len(j._gate._cv._waiters)                            # threads blocked in the gate (CPython Condition)


def test_reads_wait_only_for_an_uncommitted_change_of_their_own_pool():
    j = Journal(BlockManager(), config=FAST)
    setup_pools(j)
    events = []
    applied, release = threading.Event(), threading.Event()
    j.observe_commit = lambda _s: events.append("commit")
    j.store.durable = True                                       # so that observe_commit is called

    def slow_step(request):
        reply = j.api.Step(request)
        applied.set()
        release.wait(30)
        return reply

    writer = threading.Thread(target=j.execute, args=("Step", step_req("a", admit=[1], n=[50]), slow_step))
    writer.start()
    assert applied.wait(30)
    other = j.read(pb.GetPoolRequest(pool="b"), j.api.GetPool)            # another pool: no wait
    assert other.name == "b"
    results = {}

    def read(key, req, fn):
        results[key] = fn(req) if key == "all" else j.read(req, fn)
        events.append(key)

    same = threading.Thread(target=read, args=("a", pb.GetPoolRequest(pool="a"), j.api.GetPool))
    every = threading.Thread(target=read, args=("all", pb.ListPoolsRequest(),
                                                lambda r: j.read(r, j.api.ListPools)))
    same.start()
    every.start()
    for _ in range(30_000):                                     # both readers reach the gate and block there
        if _waiters(j) >= 2 or events:
            break
        time.sleep(0.001)
    assert events == [] and _waiters(j) == 2
    release.set()
    for t in (writer, same, every):
        t.join(30)
    assert events[0] == "commit" and sorted(events[1:]) == ["a", "all"]      # they read committed state only
    assert results["a"].stats.num_sequences == 1 and results["a"].position.seq == j.seq


class SlowSnapshots(MemoryStore):
    """A memory store whose snapshot writes wait for a signal (as a big snapshot on a slow disk would)."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def write_snapshot(self, seq, encoded):
        self.started.set()
        self.release.wait(30)
        super().write_snapshot(seq, encoded)


def test_calls_go_on_while_a_snapshot_is_written():
    store = SlowSnapshots()
    j = Journal.recover(store, config=JournalConfig(compact_every=16))         # background snapshots
    setup_pools(j)                                              # 4 entries
    for i in range(8):                                          # 12: the tail reaches 3/4 of compact_every
        run(j, "Step", step_req("a", admit=[i + 1], n=[4]))
    assert store.started.wait(30)                               # a snapshot was captured and is being written
    captured, commits = j._compact_at - j.config.compact_every, j.commits
    for i in range(8, 12):                                      # ... and calls are served meanwhile, up to 16
        run(j, "Step", step_req("a", admit=[i + 1], n=[4]))
    assert j.commits == commits + 4 and j.seq == 16 and j.snapshots == 0 and j.snapshot_pause_seconds > 0
    store.release.set()
    assert j.wait_for_snapshot(30)
    assert j.snapshots >= 1 and j.snapshot_seq >= captured and j.snapshot_bytes > 0
    expected = state_tree(j.manager)
    j.close(snapshot=False)
    assert state_tree(Journal.recover(store, config=FAST).manager) == expected      # snapshot + later entries


def test_compact_every_bounds_the_tail_while_a_snapshot_is_slow():
    """A store slower than the tail's last quarter: the call that would take the tail past compact_every waits
    (without the journal lock: reads go on) until the snapshot is stored. So no recovery, even after a crash
    in the middle of that write, replays more than compact_every entries."""
    store = SlowSnapshots()
    j = Journal.recover(store, config=JournalConfig(compact_every=16))
    setup_pools(j)
    for i in range(12):                                         # 16 entries: the snapshot of 12 is being written
        run(j, "Step", step_req("a", admit=[i + 1], n=[4]))
    assert store.started.wait(30) and j.seq == 16 and j.snapshot_seq == 0
    done = threading.Event()
    t = threading.Thread(target=lambda: (run(j, "Step", step_req("a", admit=[99], n=[4])), done.set()))
    t.start()
    t.join(0.5)
    assert t.is_alive() and j.seq == 16 and j.snapshot_waits >= 1       # the 17th waits for the snapshot
    assert j.read(pb.GetStatsRequest(pool="a"), j.api.GetStats).pools["a"].num_sequences == 12   # reads go on
    crashed = Journal.recover(store, config=FAST)               # what a successor would replay now
    assert crashed.seq == 16 and crashed.seq - crashed.snapshot_seq <= 16
    crashed.close(snapshot=False)
    store.release.set()
    assert done.wait(30) and j.seq == 17 and j.snapshot_seq >= 12
    t.join(30)
    j.close(snapshot=False)


def test_prefix_digests_equal_whole_digests():
    """PrefixDigests hashes only what follows a kept prefix; its value is digest() of the whole request on
    every path: repeated prefix, changed byte inside it, shorter or short requests, other keys, eviction."""
    from kvservice.state.journal import PrefixDigests, digest

    rng = np.random.default_rng(11)
    pd = PrefixDigests(max_keys=2)
    body = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    cases = []
    for seq in range(1, 40):
        tail = f"s#{seq}".encode() + rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        data = body + tail
        if seq % 7 == 0:                                  # one byte of the arrays changed
            i = int(rng.integers(0, len(body)))
            data = body[:i] + bytes([body[i] ^ 1]) + body[i + 1:] + tail
        if seq % 11 == 0:
            data = body[:int(rng.integers(0, 1500))]      # short: hashed whole
        cases.append(("pool9" if seq % 13 == 0 else f"pool{seq % 2}", data))    # a third key evicts the others
    for key, data in cases:
        assert pd(key, data) == digest(data)
    assert pd.hits >= 15                                  # the steady requests did reuse a prefix
    assert len(pd._kept) <= 2


def test_prefix_digests_memory_is_bounded_whatever_the_requests():
    """Hostile Steps (made-up pool names, huge arrays) cannot make the kept prefixes grow past the bounds,
    and every digest is still digest() of the whole request."""
    from kvservice.state.journal import PrefixDigests, digest

    rng = np.random.default_rng(12)
    pd = PrefixDigests(max_keys=64, max_bytes=200_000)
    huge = rng.integers(0, 256, PrefixDigests.MAX_PREFIX + 4096, dtype=np.uint8).tobytes()
    assert pd("p", huge) == digest(huge) and pd.kept_bytes == 0        # too long to keep: hashed whole
    for i in range(300):
        data = rng.integers(1, 256, int(rng.integers(2_000, 60_000)), dtype=np.uint8).tobytes()
        assert pd(f"made-up-{i % 97}", data) == digest(data)
        assert pd.kept_bytes == sum(len(p) for p, _ in pd._kept.values()) <= 200_000
        assert len(pd._kept) <= 64


@pytest.mark.parametrize(("kw", "message"), [
    ({"sync": "fast"}, "sync must be one of full, normal, got 'fast'"),
    ({"compact_every": 0}, "compact_every and id_window must be >= 1"),
    ({"id_window": 0}, "compact_every and id_window must be >= 1"),
    ({"replay_replies": -1}, "replay_replies and snapshot_replies must be >= 0, got -1 and 256"),
    ({"snapshot_replies": -2}, "replay_replies and snapshot_replies must be >= 0, got 1024 and -2"),
])
def test_a_bad_journal_config_names_the_setting(kw, message):
    with pytest.raises(InvalidArgument) as e:
        JournalConfig(**kw)
    assert e.value.message == message


def test_state_tree_holds_the_exported_state_but_the_diagnostics_and_what_is_skipped():
    """state_tree's documented content: each pool's exported meta (less the refused/alloc-failure counters and the
    names in skip, also inside the prefix cache's meta) and arrays."""
    from tests.unit.test_kv_events import make_manager, run_workload

    m = make_manager()
    run_workload(m, "p", 6, seed=3)
    st = m.pool_and_lock("p")[0].export_state()
    meta = dict(state_tree(m)["pools"]["p"][0][1])
    assert set(meta) == set(st.meta) - {"refused", "alloc_failures"}
    assert dict(meta["prefix"]) == {k: (tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                        if isinstance(v, list) else v) for k, v in st.meta["prefix"].items()}
    skipped = dict(state_tree(m, skip=frozenset({"hits", "steps"}))["pools"]["p"][0][1])
    assert set(skipped) == set(meta) - {"steps"} and "hits" not in dict(skipped["prefix"])


def test_a_configured_pools_request_asks_for_prefix_caching_only_when_told():
    spec, sizing = CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=512)
    plain = create_request("a", spec, sizing, ())
    assert (plain.name, plain.enable_prefix_caching, plain.model) == ("a", False, "")
    assert create_request("a", spec, sizing, (), prefix_caching=True, model="m").enable_prefix_caching is True


def test_an_entry_digest_covers_each_field_of_the_entry():
    """The journal entry checksum covers its position, method, time and request bytes (its docstring): changing any
    one of them, by one bit or one unit, changes the digest."""
    from kvservice.state.stores import entry_digest

    rng = np.random.default_rng(28)
    for _ in range(20):
        seq, t = int(rng.integers(1, 2**40)), float(rng.random() * 2e9)
        req = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        base = entry_digest(seq, "Step", req, t)
        assert len(base) == 16
        flipped = bytearray(req)
        flipped[int(rng.integers(len(req)))] ^= 1 << int(rng.integers(8))
        others = [entry_digest(seq + 1, "Step", req, t), entry_digest(seq, "StepX", req, t),
                  entry_digest(seq, "Step", bytes(flipped), t), entry_digest(seq, "Step", req, np.nextafter(t, 3e9)),
                  entry_digest(seq, "Ste", b"p" + req, t)]                   # the method/request boundary
        assert base not in others and len(set(others)) == len(others)


def test_a_reused_request_id_is_refused_naming_only_that_id():
    """docs/DURABILITY.md: REQUEST_ID_REUSED and REQUEST_ALREADY_APPLIED name only the id (never another request's
    journal position): the error's metadata is exactly {request_id: the id}."""
    rng = np.random.default_rng(2815)
    j = Journal(BlockManager(), config=JournalConfig(id_window=8, reply_cache_bytes=1))
    setup_pools(j)
    rid = f"rid-{int(rng.integers(1, 2**40)):x}"
    n = int(rng.integers(1, 90))
    run(j, "Step", step_req("a", admit=[7], n=[n], rid=rid))
    with pytest.raises(InvalidArgument) as reused:               # the same id, another request
        run(j, "Step", step_req("a", admit=[8], n=[3], rid=rid))
    assert (reused.value.reason, reused.value.metadata) == ("REQUEST_ID_REUSED", {"request_id": rid})
    with pytest.raises(AlreadyExists) as applied:                # the same request, its reply no longer kept
        run(j, "Step", step_req("a", admit=[7], n=[n], rid=rid))
    assert (applied.value.reason, applied.value.metadata) == ("REQUEST_ALREADY_APPLIED", {"request_id": rid})


def test_continued_lineage_takes_the_found_lineage_or_refuses_another():
    """stores.continued_lineage's documented rule: a state without a lineage (0) takes what it finds (an int or its
    hex); one with a lineage keeps it when it finds the same or none, and a different one is two histories."""
    from kvservice.state.stores import continued_lineage

    rng = np.random.default_rng(2816)
    for _ in range(20):
        cur, other = (int(x) for x in rng.integers(1, 2**62, 2))
        assert continued_lineage(0, other, "w") == other
        assert continued_lineage(0, f"{other:x}", "w") == other
        assert continued_lineage(0, None, "w") == 0
        assert continued_lineage(cur, None, "w") == cur
        assert continued_lineage(cur, cur, "w") == cur
        assert continued_lineage(cur, f"{cur:x}", "w") == cur
        if other != cur:
            for found in (other, f"{other:x}"):
                # lineages as files and messages write them (16 hex digits), and what the mismatch means
                with pytest.raises(StateError, match=rf"^fence 9 belongs to lineage {other:016x}, the state to "
                                   rf"{cur:016x}: parts of two different states \(damaged\)$"):
                    continued_lineage(cur, found, "fence 9")


def test_refusals_of_a_pool_unchanged_since_the_last_snapshot_reach_the_next_one(tmp_path):
    """A refused step changes no state and is not journaled, but it counts (refused, alloc_failures): a pool that
    only refused since the last snapshot still carries its live counters into the next snapshot, so a restart
    from it reads the number of refusals this test made."""
    rng = np.random.default_rng(2817)
    cfg = JournalConfig(sync="normal", compact_every=1000, background_snapshots=False)
    j = Journal.open(tmp_path, config=cfg)
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[1], n=[int(rng.integers(1, 60))]))
    j.snapshot()                                           # pool a captured here; only refusals follow for it
    refusals = int(rng.integers(2, 7))
    for i in range(refusals):                              # 4 sequences of 512 tokens: 128 pages > the 96 slots
        with pytest.raises(ResourceExhausted):
            run(j, "Step", step_req("a", admit=[10 * i + 2, 10 * i + 3, 10 * i + 4, 10 * i + 5], n=[512] * 4))
    run(j, "Step", step_req("b", admit=[1], n=[5]))         # another pool moves the journal on
    j.snapshot()
    crash(j)
    j2 = Journal.open(tmp_path, config=cfg)
    assert j2.seq == j2.snapshot_seq                         # everything came from the second snapshot
    with j2.manager.locked("a") as pool:
        assert (pool.refused, pool.alloc_failures) == (refusals, {"out_of_slots": refusals})
    j2.close()


def test_snapshot_to_another_store_copies_the_state_it_recovers_to():
    """export-state/import-state (docs/HA.md) write a journal's state into another store: recovering from that
    store gives the same state tree, and the same next reply to the same request."""
    rng = np.random.default_rng(2818)
    j = Journal(BlockManager(), config=FAST)
    setup_pools(j)
    workload(j, rng, 30)
    dst = MemoryStore()
    dst.lineage = j.store.lineage
    dst.begin(j.seq)
    j.snapshot_to(dst)
    assert dst.load_snapshot()[0] == j.seq and list(dst.entries_after(0)) == []
    j2 = Journal.recover(dst, config=FAST)
    assert j2.seq == j.seq
    assert state_tree(j2.manager) == state_tree(j.manager)
    req = step_req("a", admit=[999], n=[int(rng.integers(1, 90))])
    assert body(run(j2, "Step", req)) == body(run(j, "Step", req))


def test_the_snapshot_log_line_reports_the_journals_own_figures(tmp_path, caplog):
    """The INFO line of a snapshot gives its position, bytes and encode + write time in ms: the same figures the
    journal exports (snapshot_seq, snapshot_bytes, snapshot_seconds x 1000), not a clock read of its own."""
    import logging

    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=1000, background_snapshots=False))
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[3], n=[int(np.random.default_rng(2818).integers(1, 60))]))
    with caplog.at_level(logging.INFO, logger="kvservice.state.journal"):
        j.snapshot()
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("snapshot at journal position")]
    seq, nbytes, _pause_ms, write_ms = rec.args
    assert (seq, nbytes) == (j.snapshot_seq, j.snapshot_bytes) and seq == j.seq
    assert write_ms == 1e3 * j.snapshot_seconds
    j.close(snapshot=False)
