"""The worker's heartbeat loop and rejoin, driven step by step with a scripted manager client and a stop event that
counts its waits (no threads, no sleeps): the period and deadline (docs/ARCHITECTURE.md, docs/HA.md: heartbeats
every lease/3), what each refusal leads to and the exact line it logs, the deadline of the rejoin's GetPool and
RegisterWorker; and device_info's CUDA branch (a stand-in cupy module) and its CPU memory figure."""

from __future__ import annotations

import logging
import sys
import types

import grpc
import numpy as np
import pytest

from kvservice.client.codec import ClientError
from kvservice.contract.errors import InvalidArgument
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.worker import server

ROLLED_BACK = ("heartbeat reply refused (the manager's state was rolled back, logged above): this worker keeps its "
               "caches and registration and refuses that state until the manager is restored or the worker "
               "restarted")


class Stop:
    """A stop event whose wait(t) is recorded and says "not stopped" `rounds` times, then "stopped"."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.waits = rounds, []

    def wait(self, timeout):
        self.waits.append(timeout)
        return len(self.waits) > self.rounds


class Manager:
    """A manager client scripted per heartbeat: each entry of `beats` is None (renewed) or the ClientError the
    heartbeat raises; each entry of `pools` is what GetPool returns (a PoolInfo) or raises; each entry of
    `epochs` the epoch a RegisterWorker grants or the exception it raises. Every call is recorded."""

    def __init__(self, beats, pools=(), epochs=()) -> None:
        self.beats, self.pools, self.epochs = list(beats), list(pools), list(epochs)
        self.calls: list[tuple] = []
        self._stub = types.SimpleNamespace(Heartbeat=object())

    def _call(self, method, request, timeout, codes):
        assert method is self._stub.Heartbeat
        self.calls.append(("Heartbeat", (request.worker_id, request.epoch, request.pool, request.incarnation),
                           timeout, codes))
        outcome = self.beats.pop(0)
        if outcome is not None:
            raise outcome
        return pb.HeartbeatReply()

    def get_pool(self, name, timeout=None):
        self.calls.append(("GetPool", name, timeout))
        outcome = self.pools.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def register_worker(self, request, timeout=None):
        self.calls.append(("RegisterWorker", (request.worker_id, request.incarnation, request.layer_end), timeout))
        outcome = self.epochs.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return pb.RegisterWorkerReply(epoch=outcome)


def _servicer(rng):
    """A stand-in servicer: the identity serve_worker builds (random epoch and incarnation) and caches that serve
    layers [1, layer_end). rejoin only reads these while the pool's incarnation is unchanged."""
    identity = {"worker_id": "w-7", "pool": "p", "backend": "cpu", "device_name": "cpu", "all_layers": False,
                "epoch": int(rng.integers(1, 1000)), "incarnation": int(rng.integers(1, 1000))}
    caches = types.SimpleNamespace(layer_begin=1, layer_end=int(rng.integers(2, 50)))

    def replan(*_):
        raise AssertionError("the pool's incarnation did not change: nothing to re-plan")

    return types.SimpleNamespace(identity=identity, caches=caches, replan=replan)


def test_the_heartbeat_loop_renews_rejoins_or_logs_each_refusal_with_its_own_line(caplog):
    """_heartbeat(client, request, servicer, lease, stop), one round per stop.wait(lease/3) that is not stopped:
    renewed -> nothing logged; FAILED_PRECONDITION (stale incarnation/epoch) or NOT_FOUND (unknown worker) ->
    rejoin: GetPool and RegisterWorker under a lease/3 deadline, the request re-sent with the incarnation and
    layer_end served, the new epoch kept and the next heartbeat sent with it, logged "re-registered <id> with epoch
    <e> (pool incarnation <i>) after: <the manager's message>"; a rejoin refused (ClientError or KVError: its
    message; ValueError: its text) logs "re-registration failed: ..." and the loop goes on; STATE_ROLLED_BACK
    (whatever its code) logs the rolled-back line at ERROR and does not rejoin; any other refusal logs
    "heartbeat failed: <CODE>: <message>". Each heartbeat names the worker, its epoch, pool and incarnation, has
    deadline lease/3 and is retried on UNAVAILABLE only. The loop ends when stop is set."""
    rng = np.random.default_rng()
    lease = float(rng.uniform(3, 30))
    servicer = _servicer(rng)
    ident = servicer.identity
    epoch0, inc = ident["epoch"], ident["incarnation"]
    e1 = epoch0 + int(rng.integers(1, 100))
    fp, nf = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND
    same_pool = pb.PoolInfo(name="p", incarnation=inc)
    beats = [None,
             ClientError(fp, "worker 'w-7' holds epoch 3, not 2", "STALE_EPOCH"),
             ClientError(nf, "worker 'w-7' is not registered", "UNKNOWN_WORKER"),
             ClientError(nf, "worker 'w-7' is not registered"),
             ClientError(fp, "lease lapsed"),
             ClientError(fp, "the manager's journal is behind", "STATE_ROLLED_BACK"),
             ClientError(grpc.StatusCode.UNAVAILABLE, "connection refused", "STATE_ROLLED_BACK"),
             ClientError(grpc.StatusCode.UNAVAILABLE, "connection refused"),
             ClientError(grpc.StatusCode.PERMISSION_DENIED, "token not valid for pool 'p'", "FORBIDDEN"),
             None]
    pools = [same_pool, ClientError(nf, "pool 'p' does not exist", "POOL_NOT_FOUND"), same_pool, same_pool]
    epochs = [e1, ValueError("layers [1, 9) are not a range"),
              InvalidArgument("worker 'w-7' serves layers past the pool's end", "BAD_LAYERS")]
    client = Manager(beats, pools, epochs)
    request = pb.RegisterWorkerRequest(worker_id="w-7", pool="p", layer_begin=1, layer_end=1, backend="cpu")
    stop = Stop(len(beats))
    with caplog.at_level(logging.DEBUG, logger="kvworker"):
        server._heartbeat(client, request, servicer, lease, stop)
    third = lease / 3
    assert stop.waits == [third] * (len(beats) + 1)
    hb = [c for c in client.calls if c[0] == "Heartbeat"]
    epochs_sent = [epoch0, epoch0, e1, e1, e1, e1, e1, e1, e1, e1]
    assert hb == [("Heartbeat", ("w-7", e, "p", inc), third, (grpc.StatusCode.UNAVAILABLE,)) for e in epochs_sent]
    served = ("w-7", inc, servicer.caches.layer_end)
    assert [c for c in client.calls if c[0] != "Heartbeat"] == [
        ("GetPool", "p", third), ("RegisterWorker", served, third),
        ("GetPool", "p", third),
        ("GetPool", "p", third), ("RegisterWorker", served, third),
        ("GetPool", "p", third), ("RegisterWorker", served, third)]
    assert ident["epoch"] == e1 and ident["incarnation"] == inc
    assert (request.incarnation, request.layer_end) == (inc, servicer.caches.layer_end)
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvworker"]
    assert got == [
        (logging.WARNING, f"re-registered w-7 with epoch {e1} (pool incarnation {inc}) after: worker 'w-7' holds "
                          "epoch 3, not 2"),
        (logging.WARNING, "re-registration failed: pool 'p' does not exist"),
        (logging.WARNING, "re-registration failed: layers [1, 9) are not a range"),
        (logging.WARNING, "re-registration failed: worker 'w-7' serves layers past the pool's end"),
        (logging.ERROR, ROLLED_BACK),
        (logging.ERROR, ROLLED_BACK),
        (logging.WARNING, "heartbeat failed: UNAVAILABLE: connection refused"),
        (logging.WARNING, "heartbeat failed: PERMISSION_DENIED: token not valid for pool 'p'"),
    ], got
    assert not client.beats and not client.pools and not client.epochs


def test_a_heartbeat_loop_already_stopped_sends_nothing():
    """stop set before the first period ends: the loop waits once (lease/3) and returns without a heartbeat."""
    client = Manager([])
    stop = Stop(0)
    server._heartbeat(client, pb.RegisterWorkerRequest(), _servicer(np.random.default_rng()), 9.0, stop)
    assert stop.waits == [3.0] and client.calls == []


def test_rejoin_of_the_same_incarnation_uses_the_deadline_it_is_given_for_both_calls():
    """rejoin(client, request, servicer, timeout), the pool not created again: GetPool(pool) and RegisterWorker
    each under `timeout` (not the client's default), the request carrying the incarnation and layer_end served,
    the caches untouched and the granted epoch kept."""
    rng = np.random.default_rng()
    servicer = _servicer(rng)
    inc, timeout, epoch = servicer.identity["incarnation"], float(rng.uniform(1, 100)), int(rng.integers(1, 10**6))
    client = Manager([], [pb.PoolInfo(name="p", incarnation=inc)], [epoch])
    caches = servicer.caches
    request = pb.RegisterWorkerRequest(worker_id="w-7", pool="p", layer_begin=1, layer_end=0, incarnation=0)
    server.rejoin(client, request, servicer, timeout)
    assert client.calls == [("GetPool", "p", timeout),
                            ("RegisterWorker", ("w-7", inc, caches.layer_end), timeout)]
    assert servicer.caches is caches and servicer.identity["epoch"] == epoch


def test_a_cuda_devices_name_and_memory_come_from_the_current_devices_properties(monkeypatch):
    """device_info("cuda"): the CUDA runtime's properties of the current device (cupy.cuda.Device().id), its
    name (bytes, as cudaDeviceProp holds it) decoded to str and totalGlobalMem as an int; /proc/cpuinfo is not
    read. A stand-in cupy module records the device asked for."""
    rng = np.random.default_rng()
    dev, mem = int(rng.integers(1, 8)), int(rng.integers(2**33, 2**38))
    asked = []

    def props(device):
        asked.append(device)
        return {"name": b"NVIDIA H200", "totalGlobalMem": np.uint64(mem), "major": 9}

    cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=dev),
                                 runtime=types.SimpleNamespace(getDeviceProperties=props))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))

    def no_open(*_a, **_k):
        raise AssertionError("a CUDA device's facts do not come from /proc/cpuinfo")

    monkeypatch.setattr(server, "open", no_open, raising=False)
    name, memory = server.device_info("cuda")
    assert asked == [dev]
    assert (name, memory) == ("NVIDIA H200", mem) and type(name) is str and type(memory) is int


def test_a_cpu_devices_memory_is_page_size_times_physical_pages(monkeypatch):
    """device_info("cpu")'s memory is sysconf(SC_PAGE_SIZE) x sysconf(SC_PHYS_PAGES), exactly (random figures
    from a stand-in os module)."""
    rng = np.random.default_rng()
    figures = {"SC_PAGE_SIZE": int(rng.choice([4096, 16384, 65536])), "SC_PHYS_PAGES": int(rng.integers(2, 10**8))}
    monkeypatch.setattr(server, "os", types.SimpleNamespace(sysconf=figures.__getitem__))
    _, memory = server.device_info("cpu")
    assert memory == figures["SC_PAGE_SIZE"] * figures["SC_PHYS_PAGES"]


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_any_backend_but_cuda_reads_the_cpu(monkeypatch, backend):
    """Only backend "cuda" asks CUDA: any other name (kernel_module refuses those before serve_worker gets here)
    never imports cupy (here an import of it would fail) and names the CPU and the machine's memory."""
    monkeypatch.setitem(sys.modules, "cupy", None)       # importing cupy would fail
    name, memory = server.device_info(backend)
    assert isinstance(name, str) and name and memory > 0
