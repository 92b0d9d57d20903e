"""Worker registry: epochs, leases, fencing of stale heartbeats."""

import pytest

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.manager.workers import WorkerRegistry


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_register_heartbeat_lapse_and_reregister():
    clock = Clock()
    reg = WorkerRegistry(lease_seconds=5, clock=clock)
    w = reg.register("w0", "p", 8, 0, 4, backend="cpu", address="127.0.0.1:1")
    assert (w.epoch, w.layer_begin, w.layer_end, w.alive) == (1, 0, 4, True)
    clock.t += 4
    reg.heartbeat("w0", 1)
    clock.t += 4.5
    assert reg.workers()[0].alive                      # renewed 4.5 s ago
    clock.t += 1
    assert not reg.workers()[0].alive                  # 5.5 s silent: dead
    with pytest.raises(FailedPrecondition, match="marked dead; register again"):
        reg.heartbeat("w0", 1)
    w2 = reg.register("w0", "p", 8, 4, 8)
    assert w2.epoch == 2 and w2.alive
    with pytest.raises(FailedPrecondition, match="epoch 1, current epoch is 2: another registration replaced this "
                       "one") as exc:
        reg.heartbeat("w0", 1)                         # the old process is fenced, and told why
    assert exc.value.reason == "STALE_EPOCH" and exc.value.metadata == {"worker_id": "w0"}
    reg.heartbeat("w0", 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"worker_id": "bad id"}, "worker_id"),
    ({"worker_id": "w0\n"}, "worker_id"),                 # `$` matched before a final newline
    ({"worker_id": "\nw0"}, "worker_id"),
    ({"layer_begin": 6, "layer_end": 4}, "not inside"),
    ({"layer_end": 9}, "not inside"),
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank 2"),
    ({"backend": "rocm"}, "backend"),
])
def test_bad_registrations(kwargs, match):
    args = {"worker_id": "w", "pool": "p", "num_layers": 8} | kwargs
    with pytest.raises(InvalidArgument, match=match):
        WorkerRegistry().register(**args)


def test_unknown_worker_and_pool():
    with pytest.raises(NotFound):
        WorkerRegistry().heartbeat("ghost", 1)
    m = BlockManager()
    with pytest.raises(NotFound, match="pool 'nope' does not exist"):
        m.register_worker("w", "nope")
    m.create_pool("p", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8))
    assert m.register_worker("w", "p").layer_end == 4


# ---- fencing (issue #11 item 6) -------------------------------------------------------------------
def test_a_worker_id_belongs_to_its_pool_and_token():
    clock = Clock()
    reg = WorkerRegistry(lease_seconds=5, clock=clock)
    reg.register("w", "tenant-b", 4, owner="tb", incarnation=7)
    with pytest.raises(AlreadyExists) as exc:
        reg.register("w", "tenant-a", 4, owner="ta")
    assert exc.value.reason == "WORKER_ID_TAKEN" and "tenant-b" not in exc.value.message
    with pytest.raises(AlreadyExists, match="another token"):
        reg.register("w", "tenant-b", 4, owner="tb2")              # same pool, another token, lease holds
    (rec,) = reg.workers()
    assert (rec.pool, rec.owner, rec.epoch, rec.incarnation, rec.alive) == ("tenant-b", "tb", 1, 7, True)
    reg.heartbeat("w", 1, "tenant-b", 7)
    with pytest.raises(NotFound) as exc:                           # named in another pool: as if unknown
        reg.heartbeat("w", 1, "tenant-a")
    assert "not registered in pool 'tenant-a'" in exc.value.message and "tenant-b" not in exc.value.message
    clock.t += 6                                                   # lease lapsed: the same tenant's other token
    assert reg.register("w", "tenant-b", 4, owner="tb2").epoch == 2
    with pytest.raises(AlreadyExists):                             # ... but never another pool
        reg.register("w", "tenant-a", 4, owner="tb2")
    assert reg.register("w", "tenant-a", 4, owner="ta", enforce=False).pool == "tenant-a"    # a journal replay
    assert reg.drop_pool("tenant-a") == ["w"] and not reg.workers()


def test_recreated_pool_gets_a_new_incarnation_and_fences_its_old_workers():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8))
    first = m.incarnation("p")
    rec = m.register_worker("w", "p", incarnation=first, owner="t")
    assert rec.incarnation == first and 0 < first < 2**63
    m.heartbeat("w", 1, "p", first)
    m.heartbeat("w", 1)                                            # an older worker: no pool, no incarnation
    m.delete_pool("p", force=True)
    assert not m.workers.workers()                                 # its workers went with it
    m.create_pool("p", CacheSpec.uniform(6, 2, 64, layout="interleaved"), Sizing(num_slots=16))
    second = m.incarnation("p")
    assert second != first
    with pytest.raises(FailedPrecondition) as exc:
        m.heartbeat("w", 1, "p", first)
    assert exc.value.reason == "STALE_INCARNATION" and "re-plan" in exc.value.message
    assert {k: exc.value.metadata[k] for k in ("pool", "incarnation", "worker_id")} == \
        {"pool": "p", "incarnation": str(second), "worker_id": "w"}              # which worker, which pool, now
    with pytest.raises(FailedPrecondition, match="not " + str(first)):
        m.register_worker("w", "p", incarnation=first)
    assert m.register_worker("w", "p", incarnation=second).epoch == 1
    assert m.register_worker("w", "p", incarnation=first, enforce=False).incarnation == second   # replay


def test_missing_pools_are_not_listed_and_snapshots_without_incarnations_adopt_their_workers():
    m = BlockManager()
    m.create_pool("secret-tenant-pool", CacheSpec.uniform(2, 1, 64), Sizing(num_slots=8), incarnation=42)
    with pytest.raises(NotFound) as exc:
        m.incarnation("nope")
    assert exc.value.message == "pool 'nope' does not exist"
    assert exc.value.reason == "NOT_FOUND" and exc.value.metadata == {"pool": "nope"}   # ErrorInfo names the pool
    m.register_worker("w", "secret-tenant-pool", incarnation=42)
    del m._incarnations["secret-tenant-pool"]       # as a snapshot loader that predates incarnations leaves it
    assert m.incarnation("secret-tenant-pool") == 42
    m.restore_incarnation("secret-tenant-pool", 43)
    assert m.incarnations() == {"secret-tenant-pool": 43}
    with pytest.raises(InvalidArgument):
        m.restore_incarnation("secret-tenant-pool", 0)


@pytest.mark.parametrize("name", ["p\n", "p\r\n", "\np", "p\n\n", "", "x" * 65])
def test_pool_names_with_a_newline_or_out_of_range_are_refused(name):
    m = BlockManager()
    with pytest.raises(InvalidArgument, match="pool name"):
        m.create_pool(name, CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))
    assert m.pool_names() == []
    m.create_pool("p.-_9", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))     # the whole alphabet is fine


@pytest.mark.parametrize("lease", [7.5, 42.0])
def test_the_servers_api_fences_stale_registrations_and_replies_with_the_lease(lease):
    """ManagerAPI(fence=True) (the server's) refuses a worker that planned for an earlier incarnation and
    tells a registered worker its epoch and the registry's lease; fence=False (journal replay) accepts the
    registration as it was made."""
    from kvservice.manager.api import ManagerAPI
    from kvservice.v1 import block_manager_pb2 as pb

    m = BlockManager()
    m.workers.lease_seconds = lease
    m.create_pool("p", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8))
    first = m.incarnation("p")
    m.delete_pool("p", force=True)
    m.create_pool("p", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8))
    stale = pb.RegisterWorkerRequest(worker_id="w", pool="p", incarnation=first, layer_end=4,
                                     backend="cpu")
    with pytest.raises(FailedPrecondition) as exc:
        ManagerAPI(m, fence=True).RegisterWorker(stale)
    assert exc.value.reason == "STALE_INCARNATION" and not m.workers.workers()
    reply = ManagerAPI(m).RegisterWorker(stale)                                  # a replay: accepted
    assert (reply.epoch, reply.lease_seconds, reply.pool.name, reply.pool.incarnation) == \
        (1, lease, "p", m.incarnation("p"))


def test_a_registration_is_logged_with_the_workers_address(caplog):
    """The manager's log line for a registration names the worker, its pool, layers, epoch and address."""
    import logging

    from kvservice.manager.api import ManagerAPI
    from kvservice.v1 import block_manager_pb2 as pb

    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(4, 1, 64), Sizing(num_slots=8))
    caplog.set_level(logging.INFO, logger="kvservice")
    ManagerAPI(m).RegisterWorker(pb.RegisterWorkerRequest(worker_id="w7", pool="p", layer_begin=1, layer_end=3,
                                                          backend="cpu", address="10.1.2.3:4567"))
    lines = [r.getMessage() for r in caplog.records if "registered" in r.getMessage()]
    assert lines == [f"worker w7 registered for pool p (incarnation {m.incarnation('p')}) layers [1, 3) epoch 1 "
                     "at 10.1.2.3:4567"]
