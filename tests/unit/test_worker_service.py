"""The worker's gRPC service in process (a server on 127.0.0.1, port 0; NumPy kernels), its metrics from the first
scrape, its start-up warm check and its host facts; then a worker joined to an in-process manager: its layers, its
heartbeat's incarnation and a rejoin after the pool was created again. Worker processes are tests/integration."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.serving import grpc_server
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME, _warm, device_info
from kvservice.worker.service import KERNELS, WorkerServicer

PS, SLOTS, LAYERS = 4, 24, 3


def _caches(layout: str = "per_layer") -> CacheSet:
    return CacheSet(CacheSpec.uniform(LAYERS, 1, 32, page_size=PS, layout=layout), SLOTS, 0, LAYERS, ops_numpy,
                    max_seq_len=64)


def _scrape(metrics: WorkerMetrics) -> tuple[dict, dict]:
    fams = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}
    return {f.name: f.documentation for f in fams}, samples


@pytest.fixture
def worker():
    caches = _caches()
    metrics = WorkerMetrics("p")
    servicer = WorkerServicer(caches, metrics, {"worker_id": "w-1", "pool": "p", "epoch": 1, "incarnation": 0,
                                                "backend": "cpu", "device_name": "cpu"})
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0", max_workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield wpb_grpc.WorkerStub(channel), caches, metrics
    finally:
        channel.close()
        server.stop(None)


def test_every_series_is_there_from_the_first_scrape(worker):
    """The cache size of the pool, and each kernel's duration histogram at 0 calls (dashboards read 0, not "no
    data"), with their HELP lines."""
    _, caches, metrics = worker
    docs, s = _scrape(metrics)
    assert caches.cache_bytes > 0 and s[("kvworker_cache_bytes", (("pool", "p"),))] == caches.cache_bytes
    assert docs["kvworker_cache_bytes"] == "Bytes of KV cache this worker holds."
    assert docs["kvworker_kernel_duration_seconds"] == "Time per kernel call."
    assert docs["kvworker_state_rollbacks"] == (
        "Manager replies (registration, heartbeats, pool reads) this worker refused because the manager's state was "
        "behind what it had already seen in the same lineage (STATE_ROLLED_BACK, docs/DURABILITY.md).")
    assert s[("kvworker_state_rollbacks_total", ())] == 0
    for k in KERNELS:
        assert s[("kvworker_kernel_duration_seconds_count", (("kernel", k),))] == 0


def test_validate_page_table_reports_the_first_violation_by_kernel_layer_and_reason(worker):
    """A table of two rows whose second row's second entry is far past the pool: not ok, one out_of_bounds
    entry, named with its kernel, layer, row, position and value, counted by reason and in the metrics; a
    clean table is ok with no violation."""
    stub, caches, metrics = worker
    layer = 2
    rng = np.random.default_rng(28)
    slots = rng.choice(SLOTS, 5, replace=False)
    pages = np.array([int(caches.layouts[layer].page_index(int(s))) for s in slots], dtype=np.int32)
    bad = 10**6 + int(rng.integers(1, 1000))
    indices = pages.copy()
    indices[3] = bad                                           # row 1 = entries 2..4: position 3
    req = wpb.WorkerValidateRequest(layer=layer, indptr=to_tensor(np.array([0, 2, 5], dtype=np.int32)),
                                    indices=to_tensor(indices), last_page_len=to_tensor(np.array([4, 1], np.int32)))
    reply = stub.ValidatePageTable(req, timeout=60)
    v = reply.violation
    assert not reply.ok
    assert (v.kernel, v.layer, v.count, v.row, v.position, v.value, v.reason) == \
        ("validate_page_table", layer, 1, 1, 3, bad, "out_of_bounds")
    assert dict(v.counts_by_reason) == {"out_of_bounds": 1}
    assert from_tensor(reply.row_status, "row_status").tolist() == [0, 1]          # bit 0: out_of_bounds
    _, s = _scrape(metrics)
    key = ("kvworker_bounds_violations_total",
           (("kernel", "validate_page_table"), ("layer", str(layer)), ("reason", "out_of_bounds")))
    assert s[key] == 1
    req.indices.CopyFrom(to_tensor(pages))
    clean = stub.ValidatePageTable(req, timeout=60)
    assert clean.ok and clean.violation.count == 0 and clean.violation.reason == ""
    req.last_page_len.CopyFrom(to_tensor(np.array([4, 1, 1], np.int32)))
    with pytest.raises(grpc.RpcError) as err:
        stub.ValidatePageTable(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "last_page_len must have shape [B] = [2], got [3]" in err.value.details()
    req.last_page_len.CopyFrom(to_tensor(np.array([4, 1], np.int32)))
    req.indices.CopyFrom(to_tensor(pages.astype(np.int64)))                     # page indices are INT32 [nnz]
    with pytest.raises(grpc.RpcError) as err:
        stub.ValidatePageTable(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "indices must be INT32 [nnz], got INT64"


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_the_warm_check_passes_on_the_pools_own_geometry(layout):
    """_warm validates, per layer, the first and last slot of its own index space (clean) and a page of every
    other space (wrong_index_space each, from the first of them): the kernels agree with the geometry."""
    spec = CacheSpec((LayerSpec(1, 32), LayerSpec(1, 32, sliding_window=8), LayerSpec(2, 64)), PS, layout)
    caches = CacheSet(spec, SLOTS, 0, 3, ops_numpy, max_seq_len=64)
    assert len(caches.geometry.index_spaces) > 1                 # there are other spaces to refuse
    _warm(caches)


def test_a_cpu_workers_device_is_the_machines_cpu_and_memory():
    """device_info("cpu"): /proc/cpuinfo's first "model name" and the machine's memory in bytes, whole pages: at
    least /proc/meminfo's MemTotal (kB; equal to it, unless a container's /proc shows its own limit)."""
    name, memory = device_info("cpu")
    with open("/proc/cpuinfo") as f:
        names = [ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")]
    with open("/proc/meminfo") as f:
        total_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
    assert name == (names[0] if names else "cpu")
    assert memory >= total_kb * 1024 > 0 and memory % 4096 == 0


@pytest.fixture
def joined():
    """A manager (in process, lease 600 s: the worker's own heartbeat thread stays idle) with pool "p", and a
    worker serve_worker started for it with no layers named."""
    from kvservice.client.client import BlockManagerClient
    from kvservice.contract.sizing import Sizing
    from kvservice.server.app import serve
    from kvservice.worker.server import serve_worker

    running = serve(lease_seconds=600)
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=30, retries=0)
    client.create_pool("p", CacheSpec.uniform(LAYERS, 2, 64, "float32", PS), Sizing(num_slots=SLOTS, max_seq_len=64))
    worker = serve_worker(target, "p", "w-9", backend="cpu")
    try:
        yield client, worker
    finally:
        worker.stop()
        client.close()
        running.stop()


def test_a_worker_with_no_layers_named_serves_every_layer_and_heartbeats_its_incarnation(joined):
    """serve_worker without layer_begin / layer_end: layers [0, L) of the pool. Its heartbeat names the pool
    and the incarnation it planned for: once the pool is created again, the manager says STALE_INCARNATION."""
    from kvservice.client.client import ClientError
    from kvservice.contract.sizing import Sizing
    from kvservice.worker.server import send_heartbeat

    client, worker = joined
    caches = worker.servicer.caches
    assert (caches.layer_begin, caches.layer_end) == (0, LAYERS)
    (rec,) = client.workers("p")
    assert (rec.worker_id, rec.layer_begin, rec.layer_end) == ("w-9", 0, LAYERS)
    assert (rec.tp_rank, rec.tp_size) == (0, 1)                  # no tensor parallelism unless asked for
    send_heartbeat(client, worker.identity, 30)                 # the registration it holds: renewed
    client.delete_pool("p", force=True)
    client.create_pool("p", CacheSpec.uniform(LAYERS, 2, 64, "float32", PS), Sizing(num_slots=SLOTS, max_seq_len=64))
    with pytest.raises(ClientError) as err:
        send_heartbeat(client, worker.identity, 30)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "STALE_INCARNATION"


def test_rejoining_a_pool_created_with_another_geometry_replans_and_says_how_much(joined, caplog):
    """rejoin after the pool was created again with twice the slots: the caches are planned anew for the new
    incarnation, registered again, and the log gives their size in MiB (2^20 bytes)."""
    import logging

    from kvservice.contract.sizing import Sizing
    from kvservice.v1 import block_manager_pb2 as pb
    from kvservice.worker.server import rejoin

    client, worker = joined
    old = worker.servicer.caches
    client.delete_pool("p", force=True)
    client.create_pool("p", CacheSpec.uniform(LAYERS, 2, 64, "float32", PS),
                       Sizing(num_slots=2 * SLOTS, max_seq_len=64))
    request = pb.RegisterWorkerRequest(worker_id="w-9", pool="p", backend="cpu", device_name="cpu")
    with caplog.at_level(logging.WARNING, logger="kvworker"):
        rejoin(client, request, worker.servicer, 30)
    new = worker.servicer.caches
    assert new is not old and new.geometry.num_slots == 2 * SLOTS and new.cache_bytes > old.cache_bytes > 0
    assert worker.identity["incarnation"] == client.get_pool("p").incarnation
    assert [w.worker_id for w in client.workers("p")] == ["w-9"]
    mib = f"{new.cache_bytes / 2**20:.1f} MiB"
    assert mib != f"{new.cache_bytes / 2**21:.1f} MiB"
    assert any(f"caches re-planned, {mib}" in r.getMessage() for r in caplog.records), caplog.records


def test_a_failed_re_registration_is_logged_with_the_managers_reason_and_the_heartbeat_goes_on(joined):
    """The pool deleted under a joined worker: its heartbeat is refused, the rejoin's GetPool is refused too
    (NOT_FOUND), and the heartbeat loop logs the manager's message and keeps running (until stopped)."""
    import logging


    client, worker = joined
    client.delete_pool("p", force=True)
    failures = _heartbeat_lines(client, worker, logging.WARNING, "re-registration failed: ")
    assert failures == ["re-registration failed: pool 'p' does not exist"] * 2      # the manager's words


def test_after_a_replan_no_page_counts_as_written_under_any_generation():
    """docs/KERNELS.md, page generations: a re-plan (the pool created again) keeps the memory but none of its
    pages holds K/V of the new incarnation. A page written under generation 1 reads fine before; afterwards
    the same table (generation 1) reads stale_page, and so does a page never written at all."""
    caches = _caches()
    servicer = WorkerServicer(caches, WorkerMetrics("p"), {"worker_id": "w-1", "pool": "p", "epoch": 1,
                                                           "incarnation": 3, "backend": "cpu", "device_name": "cpu"})
    rng = np.random.default_rng(16)
    layer, layout = 1, caches.layouts[1]
    written, never = int(layout.page_index(5)), int(layout.page_index(9))
    k, v = (rng.standard_normal((PS, 1, 32)).astype(np.float16) for _ in range(2))
    one = np.ones(PS, np.uint32)
    rec = ops_numpy.append_kv(caches.cache(layer), layout, k, v, written * PS + np.arange(PS, dtype=np.int64),
                              slot_generations=one, page_gen=caches.page_gen(layer)).record
    assert rec.count == 0

    def read(page: int):
        q = rng.standard_normal((1, 1, 32)).astype(np.float16)
        return ops_numpy.decode_attention(q, servicer.caches.cache(layer), layout, np.array([0, 1], np.int32),
                                          np.array([page], np.int32), np.array([PS], np.int32),
                                          generations=one[:1], page_gen=servicer.caches.page_gen(layer)).record

    assert read(written).count == 0 and read(never).reason == "stale_page"
    servicer.replan(caches, 4)
    assert servicer.identity["incarnation"] == 4 and servicer.caches is caches
    for page in (written, never):
        r = read(page)
        assert (r.count, r.reason) == (1, "stale_page"), (page, r)


def test_a_heartbeat_reply_from_a_rolled_back_manager_is_refused_and_logged(joined):
    """The worker's client saw the manager's journal further on than the heartbeat reply says (the manager's
    state rolled back, docs/DURABILITY.md): the reply is refused and the heartbeat loop logs that this worker
    keeps its caches and registration, and goes on."""
    import logging

    from kvservice.v1 import block_manager_pb2 as pb
    from kvservice.worker.server import send_heartbeat

    client, worker = joined
    send_heartbeat(client, worker.identity, 30)
    t = client.position
    assert t.lineage and t.seq > 0
    ahead = pb.StepReply(position=pb.JournalPosition(lineage=t.lineage, incarnation=t.incarnation,
                                                     seq=t.seq + int(np.random.default_rng(3).integers(5, 500))))
    t.check("Step", ahead, t.seen(), None)                     # a reply seen before the manager lost its journal
    errors = _heartbeat_lines(client, worker, logging.ERROR, "heartbeat reply refused")
    assert errors[0] == ("heartbeat reply refused (the manager's state was rolled back, logged above): this worker "
                         "keeps its caches and registration and refuses that state until the manager is restored "
                         "or the worker restarted")
    client.reset_position()                                    # resynchronised: the manager's state is read again
    assert [(w.worker_id, w.epoch) for w in client.workers("p")] == [("w-9", worker.identity["epoch"])]   # no rejoin


def _heartbeat_lines(client, worker, level: int, prefix: str) -> list[str]:
    """Run a joined worker's heartbeat loop (lease 0.9 s: a 0.3 s period, and each call's deadline: a 0.01 s one
    was missed on a loaded machine) until it has logged two lines at `level` starting with `prefix` (the loop went
    round again after the first), then stop it; those two lines. Fails if the loop died or did not get there within
    240 s (an upper bound, not a timing)."""
    import logging
    import threading

    from kvservice.v1 import block_manager_pb2 as pb
    from kvservice.worker.server import _heartbeat

    stop, lines = threading.Event(), []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == level and record.getMessage().startswith(prefix):
                lines.append(record.getMessage())
                if len(lines) == 2:
                    stop.set()

    catch = Catch(level)
    logger = logging.getLogger("kvworker")
    logger.addHandler(catch)
    request = pb.RegisterWorkerRequest(worker_id="w-9", pool="p", backend="cpu", device_name="cpu")
    beat = threading.Thread(target=_heartbeat, args=(client, request, worker.servicer, 0.9, stop), daemon=True)
    try:
        beat.start()
        beat.join(240)                         # ends once stopped, or when the loop dies
    finally:
        stop.set()
        logger.removeHandler(catch)
    assert not beat.is_alive() and len(lines) == 2, lines
    return lines
