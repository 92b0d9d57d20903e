"""A worker started by serve_worker against an in-process manager that leads a replicated deployment (its real
LeaderGate, promoted to a random epoch: every reply stamped as docs/HA.md says): what it registers (checked against
the machine's own facts and the address it really answers on), the line it logs, its leader-epoch fence and metrics
port, its test hooks, its heartbeat's request and deadline (seen by the manager's server), and its heartbeat loop
when the pool comes back with fewer layers than the worker serves."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.client.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import EPOCH_METADATA
from kvservice.contract.wire import to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

PS, SLOTS, LAYERS, HEADS, DIM = 4, 200, 3, 2, 64


def _loopback_host() -> str:
    """[::1] where IPv6 loopback works (the advertised address must keep a host that holds colons), else 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return "[::1]"
    except OSError:
        return "127.0.0.1"


HOST = _loopback_host()


class HeartbeatTap(grpc.ServerInterceptor):
    """Records each Heartbeat request the manager's server receives and the deadline it has left."""

    def __init__(self) -> None:
        self.seen: list[tuple[pb.HeartbeatRequest, float | None]] = []

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Heartbeat"):
            return handler
        inner = handler.unary_unary

        def tapped(request, context):
            self.seen.append((request, context.time_remaining()))
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(tapped, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


@pytest.fixture
def led(caplog):
    """(manager client, worker, leader epoch, heartbeat tap, caplog): a manager (lease 600 s: the worker's own
    heartbeat thread stays idle) leading at a random epoch, pool "p" of 3 layers, and a worker of layers [1, 3)
    listening on IPv6 loopback with a metrics port and test hooks."""
    from kvservice.server.app import serve
    from kvservice.server.leader_gate import LeaderGate
    from kvservice.worker.server import serve_worker

    epoch = int(np.random.default_rng().integers(2, 10**6))
    gate, tap = LeaderGate(), HeartbeatTap()
    gate.promote(epoch)
    running = serve(lease_seconds=600, interceptors=[gate, tap])
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=60, retries=0)
    client.create_pool("p", CacheSpec.uniform(LAYERS, HEADS, DIM, "float32", PS),
                       Sizing(num_slots=SLOTS, max_seq_len=64))
    with caplog.at_level(logging.INFO, logger="kvworker"):
        worker = serve_worker(target, "p", "w-3", layer_begin=1, layer_end=3, listen=f"{HOST}:0", metrics_port=0,
                              test_hooks=True)
    try:
        yield client, worker, epoch, tap, caplog
    finally:
        worker.stop()
        client.close()
        running.stop()


def test_a_worker_registers_what_it_serves_where_it_answers_and_logs_it(led):
    """The manager's record of the worker: its id, layers, no tensor parallelism, backend, this machine's CPU name
    and memory (/proc/cpuinfo, /proc/meminfo), the pool's incarnation, the epoch it was given, and an address
    built from the IPv6 listen host and the bound port on which the worker really answers; the start line gives
    the same facts and the cache size hand-computed (2 layers x slots x K and V float32 pages) in MiB."""
    client, worker, _, _, caplog = led
    (rec,) = client.workers("p")
    with open("/proc/cpuinfo") as f:
        names = [ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")]
    with open("/proc/meminfo") as f:
        total_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
    assert (rec.worker_id, rec.pool, rec.layer_begin, rec.layer_end, rec.tp_rank, rec.tp_size, rec.backend) == \
        ("w-3", "p", 1, 3, 0, 1, "cpu")
    assert rec.device_name == (names[0] if names else "cpu")
    assert rec.device_memory_bytes >= total_kb * 1024 > 0 and rec.device_memory_bytes % 4096 == 0
    assert rec.incarnation == client.get_pool("p").incarnation == worker.identity["incarnation"]
    assert rec.epoch == worker.identity["epoch"] > 0
    assert rec.address == f"{HOST}:{worker.port}"
    with grpc.insecure_channel(rec.address) as ch:
        info = wpb_grpc.WorkerStub(ch).Info(wpb.WorkerInfoRequest(), timeout=30)
    cache_bytes = 2 * SLOTS * (2 * PS * HEADS * DIM * 4)
    assert (info.worker_id, info.layer_begin, info.layer_end, info.cache_bytes) == ("w-3", 1, 3, cache_bytes)
    lines = [r.getMessage() for r in caplog.get_records("setup") if r.name == "kvworker" and r.levelno == logging.INFO]
    assert f"worker w-3 serving layers [1, 3) of pool p on port {worker.port} (epoch {rec.epoch}, cpu, " \
           f"{cache_bytes / 2**20:.1f} MiB cache)" in lines, lines
    assert f"{cache_bytes / 2**20:.1f}" != f"{cache_bytes / 2**21:.1f}"


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_worker_of_a_leading_manager_fences_its_kernel_calls_and_counts_them_on_its_metrics_port(led):
    """The worker learned the leader epoch from its own manager client: an AppendKV without a stamp is refused
    LEADER_EPOCH_REQUIRED, one stamped below it STALE_LEADER_EPOCH, nothing written; stamped with it, or above
    it, the call writes (no violation). The worker's /metrics (the port serve_worker opened) counts the two
    refusals by reason and the two calls that ran."""
    _, worker, epoch, _, _ = led
    rng = np.random.default_rng(epoch)
    layout = worker.servicer.caches.layouts[2]
    slots = rng.choice(SLOTS, 3, replace=False)
    sm = np.array([int(layout.page_index(int(s))) * PS + int(rng.integers(PS)) for s in slots], np.int64)
    k, v = (rng.standard_normal((3, HEADS, DIM)).astype(np.float32) + 1 for _ in range(2))
    req = wpb.AppendKVRequest(layer=2, slot_mapping=to_tensor(sm), k=to_tensor(k), v=to_tensor(v))
    with grpc.insecure_channel(f"{HOST}:{worker.port}") as ch:
        stub = wpb_grpc.WorkerStub(ch)
        for md, words in (([], f"(leader epoch {epoch}) and this call names no leader epoch"),
                          ([(EPOCH_METADATA, str(epoch - 1))],
                           f"has seen leader epoch {epoch}, but this call's tables come from epoch {epoch - 1}")):
            with pytest.raises(grpc.RpcError) as err:
                stub.AppendKV(req, metadata=md, timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and words in err.value.details()
        for stamp in (epoch, epoch + int(rng.integers(1, 100))):
            reply = stub.AppendKV(req, metadata=[(EPOCH_METADATA, str(stamp))], timeout=30)
            assert not reply.violations
    s = _scrape(worker.metrics_port)
    assert {r: s[("kvworker_leader_epoch_refusals_total", (("reason", r),))]
            for r in ("STALE_LEADER_EPOCH", "LEADER_EPOCH_REQUIRED")} == {"STALE_LEADER_EPOCH": 1,
                                                                         "LEADER_EPOCH_REQUIRED": 1}
    assert s[("kvworker_kernel_duration_seconds_count", (("kernel", "append_kv"),))] == 2


def test_a_worker_started_with_test_hooks_lets_a_guard_byte_be_flipped_and_finds_it(led):
    """test_hooks=True reaches the service: CorruptGuard flips one byte of the back guard zone of layer 1's buffer,
    and CheckGuards names that buffer, 1 byte, at offset guard + payload + the offset asked (docs/DESIGN.md:
    guard bytes on both sides); every other buffer clean."""
    _, worker, _, _, _ = led
    g = worker.servicer.caches.guard_bytes
    at = int(np.random.default_rng().integers(0, g))
    payload = SLOTS * 2 * PS * HEADS * DIM * 4
    with grpc.insecure_channel(f"{HOST}:{worker.port}") as ch:
        stub = wpb_grpc.WorkerStub(ch)
        stub.CorruptGuard(wpb.CorruptGuardRequest(buffer="layer1", offset=at, after=True), timeout=30)
        reply = stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=30)
    assert not reply.ok
    assert [(b.buffer, b.corrupted_bytes, b.first_offset) for b in reply.buffers] == \
        [("layer1", 1, g + payload + at), ("layer2", 0, -1)]


def test_a_heartbeat_names_the_worker_and_carries_its_own_deadline(led):
    """send_heartbeat(client, identity, timeout): the manager receives the worker's id, epoch, pool and the
    incarnation it planned for, under the deadline given (5 to 15 s; not the client's 60 s one)."""
    from kvservice.worker.server import send_heartbeat

    client, worker, _, tap, _ = led
    timeout = float(np.random.default_rng().uniform(5, 15))
    send_heartbeat(client, worker.identity, timeout)
    ((req, left),) = tap.seen
    ident = worker.identity
    assert (req.worker_id, req.epoch, req.pool, req.incarnation) == \
        ("w-3", ident["epoch"], "p", ident["incarnation"])
    assert left is not None and 0 < left <= timeout + 1          # the wire's deadline is rounded up, a little


def _heartbeat_lines(client, worker, level: int, prefix: str, want: int = 2) -> list[str]:
    """Run the worker's heartbeat loop (lease 0.9 s: a 0.3 s period, and each call's deadline) until it logged
    `want` lines at `level` starting with `prefix` (two: it went round again after the first), then stop it; those
    lines. Fails if the loop died first or had not got there within 240 s (a bound, not a timing: a loaded machine
    once missed 60 s, and once a 0.01 s deadline of the loop's own GetPool)."""
    from kvservice.worker.server import _heartbeat

    stop, lines = threading.Event(), []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == level and record.getMessage().startswith(prefix):
                lines.append(record.getMessage())
                if len(lines) == want:
                    stop.set()

    catch = Catch(level)
    logger = logging.getLogger("kvworker")
    logger.addHandler(catch)
    request = pb.RegisterWorkerRequest(worker_id="w-3", pool="p", layer_begin=1, layer_end=3, backend="cpu")
    beat = threading.Thread(target=_heartbeat, args=(client, request, worker.servicer, 0.9, stop), daemon=True)
    try:
        beat.start()
        beat.join(240)
    finally:
        stop.set()
        logger.removeHandler(catch)
    assert not beat.is_alive() and len(lines) == want, lines
    return lines


def test_a_pool_created_again_with_fewer_layers_than_served_is_logged_and_the_heartbeat_goes_on(led):
    """A worker of layers [1, 3) whose pool comes back with 2 layers cannot plan its layer 2: the rejoin fails
    with that reason in words (not an IndexError that ended the heartbeat thread, as it did), the heartbeat
    loop goes on, and the worker keeps its caches and incarnation."""
    client, worker, _, _, _ = led
    old, incarnation = worker.servicer.caches, worker.identity["incarnation"]
    client.delete_pool("p", force=True)
    client.create_pool("p", CacheSpec.uniform(2, HEADS, DIM, "float32", PS), Sizing(num_slots=SLOTS, max_seq_len=64))
    lines = _heartbeat_lines(client, worker, logging.WARNING, "re-registration failed: ")
    assert lines == ["re-registration failed: layers [1, 3) are not a range of this pool's 2 layers: serve layers "
                     "[b, e) with 0 <= b <= e <= the pool's layer count"] * 2
    assert worker.servicer.caches is old and worker.identity["incarnation"] == incarnation


def test_kernel_modules_and_group_slots_of_a_plan():
    """backend cpu runs the NumPy kernels or, asked for, the emulated .cu ones, both on NumPy arrays; any other
    backend than cuda or cpu is refused by name. A plan group's slots are its own, or the plan's num_slots when
    the manager sent 0 (one that predates per-group sizing)."""
    from kvservice.worker import kernels_cpu, ops_numpy
    from kvservice.worker.server import group_slots, kernel_module

    assert kernel_module("cpu") == (ops_numpy, np) and kernel_module("cpu", "numpy") == (ops_numpy, np)
    assert kernel_module("cpu", "emulated") == (kernels_cpu, np)
    with pytest.raises(ValueError, match=r"^backend must be cuda or cpu, got 'tpu'$"):
        kernel_module("tpu")
    rng = np.random.default_rng(8)
    n, own = (int(x) for x in rng.integers(1, 1000, 2))
    plan = pb.PlanReply(num_slots=n, groups=[pb.GroupPlan(num_slots=0), pb.GroupPlan(num_slots=own)])
    assert group_slots(plan) == [n, own]


def test_plan_caches_follows_the_managers_plan_and_refuses_one_it_does_not_rebuild(led):
    """plan_caches: the caches of the layers asked for, with the pool's max_seq_len (not what the slots could
    hold); a plan whose layer lattice differs from the geometry rebuilt here is refused naming the first layer."""
    from kvservice.worker import ops_numpy
    from kvservice.worker.server import plan_caches

    client, _, _, _, _ = led
    info = client.get_pool("p")
    caches = plan_caches(info, 0, 2, ops_numpy, np)
    assert (caches.layer_begin, caches.layer_end, caches.max_seq_len) == (0, 2, 64) and 64 != SLOTS * PS
    info.plan.layers[1].offset += 1
    with pytest.raises(ValueError, match=r"differs from the manager's plan \(first at layer 1:"):
        plan_caches(info, 0, 2, ops_numpy, np)


def test_a_worker_reports_serving_for_both_health_names(led):
    """Once registered, the worker's health service says SERVING for the server ("") and kvservice.v1.Worker."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, worker, _, _, _ = led
    with grpc.insecure_channel(f"{HOST}:{worker.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvservice.v1.Worker"):
            got = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=30).status
            assert got == health_pb2.HealthCheckResponse.SERVING, name


def test_rejoining_the_same_incarnation_registers_again_with_the_next_epoch(led):
    """rejoin when the pool was not created again: the caches stay, and the worker registers again (epoch + 1,
    docs: a registration bumps the epoch) and heartbeats with the new epoch."""
    from kvservice.worker.server import rejoin, send_heartbeat

    client, worker, _, _, _ = led
    old, epoch = worker.servicer.caches, worker.identity["epoch"]
    request = pb.RegisterWorkerRequest(worker_id="w-3", pool="p", layer_begin=1, layer_end=3, backend="cpu")
    rejoin(client, request, worker.servicer, 30)
    (rec,) = client.workers("p")
    assert worker.servicer.caches is old and worker.identity["epoch"] == rec.epoch == epoch + 1
    send_heartbeat(client, worker.identity, 30)


def test_a_pool_created_again_with_the_same_geometry_keeps_the_caches_but_forgets_their_pages(led, caplog):
    """Same spec and sizing, new incarnation: the caches are kept (logged so), no page counts as written under
    any generation any more, and the worker is registered under the new incarnation. The heartbeat loop does it
    on its own and logs the re-registration with the manager's words."""
    client, worker, _, _, _ = led
    old = worker.servicer.caches
    old.page_gen(1)[:] = np.random.default_rng(3).integers(1, 2**32, old.page_gen(1).shape[0], dtype=np.uint32)
    client.delete_pool("p", force=True)
    client.create_pool("p", CacheSpec.uniform(LAYERS, HEADS, DIM, "float32", PS),
                       Sizing(num_slots=SLOTS, max_seq_len=64))
    new = client.get_pool("p").incarnation
    with caplog.at_level(logging.WARNING, logger="kvworker"):
        (line,) = _heartbeat_lines(client, worker, logging.WARNING, "re-registered ", want=1)
    (rec,) = client.workers("p")
    assert worker.servicer.caches is old and not old.page_gen(1).any() and not old.page_gen(2).any()
    assert worker.identity["incarnation"] == rec.incarnation == new
    assert line.startswith(f"re-registered w-3 with epoch {rec.epoch} (pool incarnation {new}) after: ")
    assert f"pool 'p' was created again (incarnation {new}): same geometry, caches kept" in \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("named", [True, False])
def test_a_pool_created_again_with_more_layers(named, caplog):
    """A worker that named its layers keeps serving them; one that named none (all layers) takes every layer of
    the new pool, and registers the layers it now serves."""
    from kvservice.server.app import serve
    from kvservice.worker.server import rejoin, serve_worker

    running = serve(lease_seconds=600)
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=60, retries=0)
    client.create_pool("p", CacheSpec.uniform(LAYERS, HEADS, DIM, "float32", PS), Sizing(num_slots=SLOTS,
                                                                                         max_seq_len=64))
    worker = serve_worker(target, "p", "w-4", layer_begin=0, layer_end=2 if named else 0)
    try:
        client.delete_pool("p", force=True)
        client.create_pool("p", CacheSpec.uniform(LAYERS + 2, HEADS, DIM, "float32", PS),
                           Sizing(num_slots=SLOTS, max_seq_len=64))
        request = pb.RegisterWorkerRequest(worker_id="w-4", pool="p", layer_begin=0, layer_end=2 if named else LAYERS,
                                           backend="cpu")
        rejoin(client, request, worker.servicer, 30)
        want = 2 if named else LAYERS + 2
        caches = worker.servicer.caches
        (rec,) = client.workers("p")
        assert (caches.layer_begin, caches.layer_end) == (0, want) == (rec.layer_begin, rec.layer_end)
    finally:
        worker.stop()
        client.close()
        running.stop()
