"""A running worker: caches allocated, kernels warmed, gRPC service up, registered and heartbeating.

The worker plans its memory from one incarnation of its pool, registers with it and heartbeats
with it. When the manager answers that the pool was created again (STALE_INCARNATION), or no
longer knows the worker, the heartbeat thread fetches the pool, re-plans the caches if the
geometry changed (kvservice.worker.fencing), and registers again with the new incarnation.
Its manager client checks every reply's journal position (kvservice/client/position.py): a manager
whose state was rolled back is refused (STATE_ROLLED_BACK), logged and counted in
kvworker_state_rollbacks_total, and the worker never re-registers on the strength of such a reply.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from prometheus_client import start_http_server

from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.codec import ClientError
from kvservice.client.ha import LeaderClient
from kvservice.contract.auth import WORKER, ServerTLS, TokenAuthInterceptor, TokenTable, worker_rules
from kvservice.contract.convert import cache_spec_from_proto
from kvservice.contract.errors import KVError
from kvservice.contract.geometry import INT32_MAX
from kvservice.contract.serving import grpc_server
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.service import WorkerServicer
from kvservice.worker.tables import MAX_TABLE_ROWS, MAX_TABLES

log = logging.getLogger("kvworker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def kernel_module(backend: str, cpu_kernels: str = "numpy") -> tuple[ModuleType, Any]:
    """(ops module, array module) of a backend: cuda -> CuPy + raw CUDA; cpu -> NumPy or the emulated .cu."""
    if backend == "cuda":
        import cupy

        from kvservice.worker import kernels_cuda
        return kernels_cuda, cupy
    if backend != "cpu":
        raise ValueError(f"backend must be cuda or cpu, got {backend!r}")
    if cpu_kernels == "emulated":
        from kvservice.worker import kernels_cpu
        return kernels_cpu, np
    from kvservice.worker import ops_numpy
    return ops_numpy, np


def device_info(backend: str) -> tuple[str, int]:
    if backend == "cuda":
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode(), int(props["totalGlobalMem"])
    name = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return name, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class RunningWorker:
    server: grpc.Server
    port: int
    metrics_port: int | None
    servicer: WorkerServicer
    identity: dict[str, Any]
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _http: Any = None

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.server.stop(grace).wait()
        if self._http is not None:
            self._http.shutdown()


def _warm(caches: CacheSet) -> None:
    """Compile/load the kernels and touch every layer once: a one-row validate of the first
    and last slot of the layer's index space must be clean, and a page of every other index
    space of the pool must come back ``wrong_index_space`` (the kernels read the same
    numbering as the manager's geometry)."""
    xp = caches.xp
    geo = caches.geometry
    for layer, layout in caches.layouts.items():
        own = [int(layout.page_index(0)), int(layout.page_index(geo.groups[geo.layers[layer].group].num_slots - 1))]
        other = [s.base + s.offset for s in geo.index_spaces
                 if s.id != geo.layers[layer].index_space and s.base + s.offset <= INT32_MAX]
        indptr = xp.asarray(np.array([0, len(own) + len(other)], dtype=np.int32))
        rec = caches.ops.validate_page_table(indptr, xp.asarray(np.array(own + other, dtype=np.int32)),
                                             xp.asarray(np.array([1], dtype=np.int32)), layout).record
        got = (rec.count, rec.reason)
        want = (len(other), "wrong_index_space") if other else (0, None)
        if got != want or (other and rec.position != len(own)):
            raise RuntimeError(f"layer {layer}: the kernels disagree with the pool geometry: validating pages "
                               f"{own + other} gave {rec}, expected {want[0]} x {want[1]} from position {len(own)}")


def serve_worker(manager: str, pool: str, worker_id: str, layer_begin: int = 0, layer_end: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, backend: str = "cpu", listen: str = "127.0.0.1:0",
                 metrics_port: int | None = None, cpu_kernels: str = "numpy", test_hooks: bool = False,
                 advertise: str | None = None, metrics_addr: str = "127.0.0.1", *,
                 manager_tls: TLSOptions | None = None, manager_token: str | None = None,
                 tls: ServerTLS | None = None, tokens: TokenTable | None = None,
                 max_table_rows: int = MAX_TABLE_ROWS, max_tables: int = MAX_TABLES,
                 table_quota_bytes: int = 0) -> RunningWorker:
    """Allocate, warm, serve, register; then heartbeat in the background until stop().

    manager_tls / manager_token: how to reach a manager that serves TLS / wants a bearer token.
    tls / tokens: this worker's own server (TLS or mutual TLS; pool-scoped bearer tokens).
    max_table_rows / max_tables / table_quota_bytes: bounds of the persistent tables (kvservice.worker.tables).
    """
    # A LeaderClient: `manager` may list several addresses (replicated managers, docs/HA.md), and a reply
    # from a deposed leader (a lower epoch than one already seen) is refused and retried elsewhere.
    metrics = WorkerMetrics(pool)
    client = LeaderClient(manager, timeout=10, tls=manager_tls, token=manager_token)
    client.position.on_rollback = lambda _err: metrics.state_rollbacks.inc()
    client.wait_ready(30)
    info = client.get_pool(pool, timeout=30)        # start-up calls may wait out a failover
    all_layers = not layer_end
    layer_end = layer_end or len(cache_spec_from_proto(info.cache).layers)
    ops, xp = kernel_module(backend, cpu_kernels)
    caches = plan_caches(info, layer_begin, layer_end, ops, xp)
    device_name, device_mem = device_info(backend)
    identity: dict[str, Any] = {"worker_id": worker_id, "pool": pool, "backend": backend,
                                "device_name": device_name, "epoch": 0, "incarnation": info.incarnation,
                                "all_layers": all_layers}
    servicer = WorkerServicer(caches, metrics, identity, test_hooks,
                              leader_epoch=lambda: client.epoch, max_table_rows=max_table_rows,
                              max_tables=max_tables, table_quota_bytes=table_quota_bytes)
    interceptors = [TokenAuthInterceptor(tokens, WORKER, worker_rules(pool))] if tokens is not None else []
    server, port, health_servicer = grpc_server(SERVICE_NAME, servicer, listen, tls, interceptors, max_workers=4)
    server.start()
    http = None
    if metrics_port is not None:
        http, _ = start_http_server(metrics_port, addr=metrics_addr, registry=metrics.registry)
        metrics_port = http.server_port
    address = advertise or f"{listen.rsplit(':', 1)[0]}:{port}"
    request = pb.RegisterWorkerRequest(worker_id=worker_id, pool=pool, layer_begin=layer_begin, layer_end=layer_end,
                                       tp_rank=tp_rank, tp_size=tp_size, backend=backend, device_name=device_name,
                                       device_memory_bytes=device_mem, address=address,
                                       incarnation=info.incarnation)
    reply = client.register_worker(request, timeout=30)
    identity["epoch"] = reply.epoch
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningWorker(server, port, metrics_port, servicer, identity, _http=http)
    t = threading.Thread(target=_heartbeat, args=(client, request, servicer, reply.lease_seconds, running._stop),
                         daemon=True, name="heartbeat")
    t.start()
    running._threads.append(t)
    log.info("worker %s serving layers [%d, %d) of pool %s on port %d (epoch %d, %s, %.1f MiB cache)", worker_id,
             layer_begin, layer_end, pool, port, reply.epoch, backend, caches.cache_bytes / 2**20)
    return running


def group_slots(plan_: pb.PlanReply) -> list[int]:
    """Slots of each layer group of a plan (a manager that predates per-group sizing sends 0: num_slots)."""
    return [g.num_slots or plan_.num_slots for g in plan_.groups]


def plan_caches(info: pb.PoolInfo, layer_begin: int, layer_end: int, ops: ModuleType, xp: Any) -> CacheSet:
    """Allocate and warm the caches of layers [layer_begin, layer_end) of the pool `info` describes."""
    expected = [(la.scale, la.offset, la.upper_bound) for la in info.plan.layers]
    caches = CacheSet(cache_spec_from_proto(info.cache), group_slots(info.plan), layer_begin, layer_end, ops, xp,
                      expected=expected, max_seq_len=info.plan.max_seq_len)
    _warm(caches)
    return caches


def _heartbeat(client: BlockManagerClient, request: pb.RegisterWorkerRequest, servicer: WorkerServicer,
               lease: float, stop: threading.Event) -> None:
    """Renew the lease every lease/3 s; on a lapsed lease, stale epoch or incarnation, or an unknown worker,
    join again (re-planning memory if the pool was created again)."""
    identity = servicer.identity
    while not stop.wait(lease / 3):
        try:
            send_heartbeat(client, identity, lease / 3)
        except ClientError as err:
            if err.reason == "STATE_ROLLED_BACK":
                log.error("heartbeat reply refused (the manager's state was rolled back, logged above): this worker "
                          "keeps its caches and registration and refuses that state until the manager is restored "
                          "or the worker restarted")
            elif err.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                try:
                    rejoin(client, request, servicer, lease / 3)
                    log.warning("re-registered %s with epoch %d (pool incarnation %d) after: %s",
                                identity["worker_id"], identity["epoch"], identity["incarnation"], err.message)
                except (ClientError, KVError, ValueError) as again:
                    log.warning("re-registration failed: %s", getattr(again, "message", again))
            else:
                log.warning("heartbeat failed: %s", err)


def send_heartbeat(client: BlockManagerClient, identity: dict[str, Any], timeout: float) -> None:
    """Heartbeat naming the pool and incarnation. BlockManagerClient.heartbeat sends neither, so the
    request is built here (retried on UNAVAILABLE only, like that method)."""
    req = pb.HeartbeatRequest(worker_id=identity["worker_id"], epoch=identity["epoch"], pool=identity["pool"],
                              incarnation=identity["incarnation"])
    client._call(client._stub.Heartbeat, req, timeout, (grpc.StatusCode.UNAVAILABLE,))


def rejoin(client: BlockManagerClient, request: pb.RegisterWorkerRequest, servicer: WorkerServicer,
           timeout: float) -> None:
    """Fetch the pool; if it is another incarnation, re-plan the caches (kept when the geometry is the same);
    then register with the incarnation the memory is planned for."""
    identity = servicer.identity
    info = client.get_pool(identity["pool"], timeout=timeout)
    if info.incarnation != identity["incarnation"]:
        old = servicer.caches
        spec, plan_ = cache_spec_from_proto(info.cache), info.plan
        same = (spec == old.spec and group_slots(plan_) == list(old.geometry.group_slots)
                and [(la.scale, la.offset, la.upper_bound) for la in plan_.layers]
                == [(v.scale, v.offset, v.upper_bound) for v in old.geometry.layers])
        layer_end = len(spec.layers) if identity.get("all_layers") else old.layer_end
        caches = old if same else plan_caches(info, old.layer_begin, layer_end, old.ops, old.xp)
        servicer.replan(caches, info.incarnation)
        log.warning("pool %r was created again (incarnation %d): %s", identity["pool"], info.incarnation,
                    "same geometry, caches kept" if same else
                    f"caches re-planned, {caches.cache_bytes / 2**20:.1f} MiB")
    request.incarnation, request.layer_end = identity["incarnation"], servicer.caches.layer_end
    identity["epoch"] = client.register_worker(request, timeout=timeout).epoch
