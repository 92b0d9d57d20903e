"""A running worker: caches allocated, kernels warmed, gRPC service up, registered and heartbeating."""

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

from clients.client import BlockManagerClient, TLSOptions
from clients.codec import ClientError
from clients.ha import LeaderClient
from kvservice.auth import WORKER, ServerTLS, TokenAuthInterceptor, TokenTable, worker_rules
from kvservice.convert import cache_spec_from_proto
from kvservice.server import grpc_server
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2
from worker.caches import CacheSet
from worker.metrics import WorkerMetrics
from worker.service import WorkerServicer

log = logging.getLogger("kvworker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def kernel_module(backend: str, cpu_kernels: str = "numpy") -> tuple[ModuleType, Any]:
    """(ops module, array module) of a backend: cuda -> CuPy + raw CUDA; cpu -> NumPy or the emulated .cu."""
    if backend == "cuda":
        import cupy

        from worker import kernels_cuda
        return kernels_cuda, cupy
    if backend != "cpu":
        raise ValueError(f"backend must be cuda or cpu, got {backend!r}")
    if cpu_kernels == "emulated":
        from worker import kernels_cpu
        return kernels_cpu, np
    from worker import ops_numpy
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
    """Compile/load the kernels and touch every layer once (a one-row validate)."""
    xp = caches.xp
    for layer, layout in caches.layouts.items():
        one = xp.asarray(np.array([0, 1], dtype=np.int32))
        caches.ops.validate_page_table(one, xp.asarray(np.array([layout.offset], dtype=np.int32)),
                                       xp.asarray(np.array([1], dtype=np.int32)), layout)
        del layer


def serve_worker(manager: str, pool: str, worker_id: str, layer_begin: int = 0, layer_end: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, backend: str = "cpu", listen: str = "127.0.0.1:0",
                 metrics_port: int | None = None, cpu_kernels: str = "numpy", test_hooks: bool = False,
                 advertise: str | None = None, metrics_addr: str = "127.0.0.1", *,
                 manager_tls: TLSOptions | None = None, manager_token: str | None = None,
                 tls: ServerTLS | None = None, tokens: TokenTable | None = None) -> RunningWorker:
    """Allocate, warm, serve, register; then heartbeat in the background until stop().

    manager_tls / manager_token: how to reach a manager that serves TLS / wants a bearer token.
    tls / tokens: this worker's own server (TLS or mutual TLS; pool-scoped bearer tokens).
    """
    # A LeaderClient: `manager` may list several addresses (replicated managers, docs/HA.md), and a reply
    # from a deposed leader (a lower epoch than one already seen) is refused and retried elsewhere.
    client = LeaderClient(manager, timeout=10, tls=manager_tls, token=manager_token)
    client.wait_ready(30)
    info = client.get_pool(pool)
    spec = cache_spec_from_proto(info.cache)
    layer_end = layer_end or len(spec.layers)
    ops, xp = kernel_module(backend, cpu_kernels)
    expected = [(la.scale, la.offset, la.upper_bound) for la in info.plan.layers]
    caches = CacheSet(spec, info.plan.num_slots, layer_begin, layer_end, ops, xp, expected=expected)
    _warm(caches)
    device_name, device_mem = device_info(backend)
    identity: dict[str, Any] = {"worker_id": worker_id, "pool": pool, "backend": backend,
                                "device_name": device_name, "epoch": 0}
    metrics = WorkerMetrics(pool)
    servicer = WorkerServicer(caches, metrics, identity, test_hooks)
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
                                       device_memory_bytes=device_mem, address=address)
    reply = client.register_worker(request)
    identity["epoch"] = reply.epoch
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningWorker(server, port, metrics_port, servicer, identity, _http=http)
    t = threading.Thread(target=_heartbeat, args=(client, request, identity, reply.lease_seconds, running._stop),
                         daemon=True, name="heartbeat")
    t.start()
    running._threads.append(t)
    log.info("worker %s serving layers [%d, %d) of pool %s on port %d (epoch %d, %s, %.1f MiB cache)", worker_id,
             layer_begin, layer_end, pool, port, reply.epoch, backend, caches.cache_bytes / 2**20)
    return running


def _heartbeat(client: BlockManagerClient, request: pb.RegisterWorkerRequest, identity: dict[str, Any],
               lease: float, stop: threading.Event) -> None:
    """Renew the lease every lease/3 s; on a lapsed lease or stale epoch, register again (new epoch)."""
    while not stop.wait(lease / 3):
        try:
            client.heartbeat(identity["worker_id"], identity["epoch"], timeout=lease / 3)
        except ClientError as err:
            if err.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                try:
                    identity["epoch"] = client.register_worker(request, timeout=lease / 3).epoch
                    log.warning("re-registered %s with epoch %d after: %s", identity["worker_id"],
                                identity["epoch"], err.message)
                except ClientError as again:
                    log.warning("re-registration failed: %s", again)
            else:
                log.warning("heartbeat failed: %s", err)
