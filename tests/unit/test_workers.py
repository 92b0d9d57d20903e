"""Worker registry: epochs, leases, fencing of stale heartbeats."""

import pytest

from kvservice.errors import FailedPrecondition, InvalidArgument, NotFound
from kvservice.geometry import CacheSpec
from kvservice.manager import BlockManager
from kvservice.planner import Sizing
from kvservice.workers import WorkerRegistry


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
    with pytest.raises(FailedPrecondition, match="epoch 1, current epoch is 2"):
        reg.heartbeat("w0", 1)                         # the old process is fenced
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


@pytest.mark.parametrize("name", ["p\n", "p\r\n", "\np", "p\n\n", "", "x" * 65])
def test_pool_names_with_a_newline_or_out_of_range_are_refused(name):
    m = BlockManager()
    with pytest.raises(InvalidArgument, match="pool name"):
        m.create_pool(name, CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))
    assert m.pool_names() == []
    m.create_pool("p.-_9", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))     # the whole alphabet is fine
