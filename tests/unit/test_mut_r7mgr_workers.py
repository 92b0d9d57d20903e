"""Workers through the API and the registry, checked whole (kvservice/manager/workers.py's module docstring,
block_manager.proto's RegisterWorker, Heartbeat and ListWorkers): every RegisterWorker field reaches the record and
comes back in ListWorkers (WorkerInfo: each field, seconds since the last heartbeat on the registry's clock, alive
until the lease has lapsed, strictly past lease_seconds), the registering token owns the worker_id; and every
refusal of the registry and the manager has its exact message, reason and metadata."""

import pytest

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.manager.workers import WorkerRecord, WorkerRegistry
from kvservice.v1 import block_manager_pb2 as pb
from tests.clocks import ManualClock

LEASE = 2.5


def _manager(clock):
    m = BlockManager()
    m.workers = WorkerRegistry(LEASE, clock=clock)
    m.create_pool("p", CacheSpec.uniform(6, 1, 64), Sizing(num_slots=8), incarnation=7_777_001)
    m.create_pool("q", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8), incarnation=5_005)
    return m


def _info(w):
    return (w.worker_id, w.pool, w.layer_begin, w.layer_end, w.tp_rank, w.tp_size, w.backend, w.device_name,
            w.device_memory_bytes, w.address, w.epoch, w.alive, w.seconds_since_heartbeat, w.incarnation)


def test_a_registration_through_the_api_keeps_every_field_and_lists_it_whole():
    clock = ManualClock(100.0)
    m = _manager(clock)
    api = ManagerAPI(m, fence=True)
    r = api.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="gpu-3.node:7", pool="p", layer_begin=2, layer_end=5, tp_rank=3, tp_size=4, backend="cuda",
        device_name="NVIDIA H200", device_memory_bytes=150_081_667_072, address="10.2.3.4:50051",
        incarnation=7_777_001, registered_by="tok-a"))
    assert (r.epoch, r.lease_seconds, r.pool.name, r.pool.incarnation) == (1, LEASE, "p", 7_777_001)
    api.RegisterWorker(pb.RegisterWorkerRequest(worker_id="cpu-1", pool="q", backend="cpu", registered_by="tok-b"))
    assert [(w.worker_id, w.owner, w.last_heartbeat) for w in m.workers.workers()] == \
        [("cpu-1", "tok-b", 100.0), ("gpu-3.node:7", "tok-a", 100.0)]
    clock.now = 101.5
    want_gpu = ("gpu-3.node:7", "p", 2, 5, 3, 4, "cuda", "NVIDIA H200", 150_081_667_072, "10.2.3.4:50051", 1, True,
                1.5, 7_777_001)
    want_cpu = ("cpu-1", "q", 0, 4, 0, 1, "cpu", "", 0, "", 1, True, 1.5, 5_005)
    assert [_info(w) for w in api.ListWorkers(pb.ListWorkersRequest()).workers] == [want_cpu, want_gpu]
    assert [_info(w) for w in api.ListWorkers(pb.ListWorkersRequest(pool="p")).workers] == [want_gpu]
    wrongs = (({"pool": "p", "incarnation": 0}, NotFound, "NOT_FOUND"),
              ({"incarnation": 9}, FailedPrecondition, "STALE_INCARNATION"),
              ({"epoch": 2}, FailedPrecondition, "STALE_EPOCH"), ({"worker_id": "cpu-2"}, NotFound, "NOT_FOUND"))
    for wrong, kind, reason in wrongs:
        fields = {"worker_id": "cpu-1", "epoch": 1, "pool": "q", "incarnation": 5_005, **wrong}
        with pytest.raises(kind) as e:
            api.Heartbeat(pb.HeartbeatRequest(**fields))
        assert e.value.reason == reason, wrong
    assert api.Heartbeat(pb.HeartbeatRequest(worker_id="cpu-1", epoch=1, pool="q", incarnation=5_005)) == \
        pb.HeartbeatReply(lease_seconds=LEASE)
    clock.now = 100.0 + LEASE                                  # exactly the lease: still alive
    assert [(w.alive, w.seconds_since_heartbeat) for w in api.ListWorkers(pb.ListWorkersRequest()).workers] == \
        [(True, 1.0), (True, LEASE)]
    clock.now = 100.5 + LEASE
    assert [(w.alive, w.seconds_since_heartbeat) for w in api.ListWorkers(pb.ListWorkersRequest()).workers] == \
        [(True, 1.5), (False, 3.0)]
    with pytest.raises(AlreadyExists) as e:                    # another token, lease held: the id is cpu-1's owner's
        api.RegisterWorker(pb.RegisterWorkerRequest(worker_id="cpu-1", pool="q", backend="cpu",
                                                        registered_by="tok-a"))
    assert e.value.reason == "WORKER_ID_TAKEN"
    again = api.RegisterWorker(pb.RegisterWorkerRequest(worker_id="gpu-3.node:7", pool="p", backend="cuda",
                                                        registered_by="tok-c"))
    assert again.epoch == 2                                    # its lease lapsed: another token may take it over
    assert [w.owner for w in m.workers.workers("p")] == ["tok-c"]


def _refusal(kind, call):
    with pytest.raises(kind) as e:
        call()
    return e.value.message, e.value.reason, e.value.metadata


def test_every_refusal_has_its_exact_message_reason_and_metadata():
    clock = ManualClock(10.0)
    m = _manager(clock)
    reg = m.workers
    assert _refusal(InvalidArgument, lambda: WorkerRegistry(0)) == \
        ("lease_seconds must be > 0, got 0", "INVALID_ARGUMENT", {})
    assert _refusal(InvalidArgument, lambda: reg.register("a b", "p", 4)) == \
        ("worker_id 'a b' must match [A-Za-z0-9_.:-]{1,128}", "INVALID_ARGUMENT", {})
    assert _refusal(InvalidArgument, lambda: reg.register("w", "p", 4, backend="tpu")) == \
        ("backend must be one of cuda, cpu, got 'tpu'", "INVALID_ARGUMENT", {})
    assert _refusal(InvalidArgument, lambda: reg.register("w", "p", 4, layer_begin=3, layer_end=5)) == \
        ("layers [3, 5) are not inside pool 'p''s [0, 4)", "INVALID_ARGUMENT", {})
    assert _refusal(InvalidArgument, lambda: reg.register("w", "p", 4, tp_rank=2, tp_size=2)) == \
        ("tp_rank 2 must be < tp_size 2", "INVALID_ARGUMENT", {})
    assert reg.register("w", "p", 4, owner="t1", incarnation=7_777_001) == \
        WorkerRecord("w", "p", 0, 4, 0, 1, "cpu", "", 0, "", 1, 10.0, True, 7_777_001, "t1")
    taken = "; a worker_id belongs to the pool and token that first registered it: choose another worker_id"
    assert _refusal(AlreadyExists, lambda: reg.register("w", "q", 4, owner="t1")) == \
        ("worker_id 'w' is registered to another pool" + taken, "WORKER_ID_TAKEN", {"worker_id": "w"})
    assert _refusal(AlreadyExists, lambda: reg.register("w", "p", 4, owner="t2")) == \
        ("worker_id 'w' is registered to another token, and its lease has not lapsed" + taken, "WORKER_ID_TAKEN",
         {"worker_id": "w"})
    assert _refusal(NotFound, lambda: reg.heartbeat("x", 1)) == \
        ("worker 'x' is not registered; register first", "NOT_FOUND", {"worker_id": "x"})
    assert _refusal(NotFound, lambda: m.heartbeat("w", 1, "q")) == \
        ("worker 'w' is not registered in pool 'q'; register first", "NOT_FOUND", {"worker_id": "w"})
    assert _refusal(FailedPrecondition, lambda: reg.heartbeat("w", 5)) == \
        ("worker 'w' heartbeat with epoch 5, current epoch is 1: another registration replaced this one",
         "STALE_EPOCH", {"worker_id": "w"})
    assert _refusal(FailedPrecondition, lambda: reg.heartbeat("w", 1, "p", 9)) == \
        ("worker 'w' registered with pool 'p' incarnation 7777001; the pool is now incarnation 9: fetch the pool, "
         "re-plan memory and register again", "STALE_INCARNATION", {"worker_id": "w", "incarnation": "9"})
    stale = ("pool 'p' is incarnation 7777001, not 42: it was deleted and created again since this worker read it; "
             "fetch the pool (GetPool), re-plan the worker's memory and register again", "STALE_INCARNATION",
             {"pool": "p", "incarnation": "7777001", "worker_id": "w"})
    assert _refusal(FailedPrecondition, lambda: m.heartbeat("w", 1, "p", 42)) == stale
    assert _refusal(FailedPrecondition, lambda: m.register_worker("w", "p", incarnation=42, owner="t1")) == stale
    m.heartbeat("w", 1, "p", 7_777_001)
    m.heartbeat("w", 1)                                        # an older worker: its own pool, not checked
    clock.now = 10.0 + LEASE + 0.5
    assert _refusal(FailedPrecondition, lambda: m.heartbeat("w", 1, "p", 7_777_001)) == \
        ("worker 'w' missed its lease of 2.5 s and was marked dead; register again", "LEASE_EXPIRED",
         {"worker_id": "w"})
    assert m.register_worker("w", "p", incarnation=7_777_001, owner="t1").epoch == 2
    assert m.workers.drop_pool("p") == ["w"] and m.workers.drop_pool("p") == []


def test_a_registry_takes_any_lease_above_zero_and_defaults_to_ten_seconds_on_the_monotonic_clock():
    """WorkerRegistry(lease_seconds=10.0, clock=time.monotonic): any lease > 0 (a fraction of a second too), none
    at or below 0; BlockManager's registry gets the same 10 s default."""
    import time

    reg = WorkerRegistry()
    assert (reg.lease_seconds, reg._clock) == (10.0, time.monotonic)
    assert BlockManager().workers.lease_seconds == 10.0
    for ok in (1e-3, 0.5, 1, 1.5):
        assert WorkerRegistry(ok).lease_seconds == ok
    for bad in (0, -0.5):
        assert _refusal(InvalidArgument, lambda b=bad: WorkerRegistry(b)) == \
            (f"lease_seconds must be > 0, got {bad}", "INVALID_ARGUMENT", {})


def test_a_registration_with_only_its_id_pool_and_layers_gets_the_documented_defaults():
    """register(worker_id, pool, num_layers): layers [0, num_layers), tp rank 0 of 1, backend cpu, no device, memory
    or address, epoch 1, the clock's now, alive, incarnation 0 and no owner; a second registration, epoch 2."""
    clock = ManualClock(42.0)
    reg = WorkerRegistry(LEASE, clock=clock)
    assert reg.register("w", "p", 3) == WorkerRecord("w", "p", 0, 3, 0, 1, "cpu", "", 0, "", 1, 42.0, True, 0, "")
    clock.now = 43.0
    assert reg.register("w", "p", 3) == WorkerRecord("w", "p", 0, 3, 0, 1, "cpu", "", 0, "", 2, 43.0, True, 0, "")
