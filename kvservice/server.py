"""A running manager: gRPC server (BlockManager + health + reflection) and the /metrics endpoint."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from .api import ManagerAPI
from .config import PoolConfig
from .manager import BlockManager
from .metrics import ManagerMetrics
from .servicer import BlockManagerServicer, Journal
from .v1 import block_manager_pb2, block_manager_pb2_grpc

log = logging.getLogger("kvservice")

#: Largest request or reply, bytes. A Step for 4096 sequences of 128k tokens carries
#: ~32M int32 indices per index space; raise it for bigger batches.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVICE_NAME = block_manager_pb2.DESCRIPTOR.services_by_name["BlockManager"].full_name


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    metrics_port: int | None
    manager: BlockManager
    metrics: ManagerMetrics
    _http: object | None = None

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]


def serve(listen: str = "127.0.0.1:0", metrics_port: int | None = None, pools: list[PoolConfig] = (),
          manager: BlockManager | None = None, max_workers: int = 8,
          metrics_addr: str = "127.0.0.1", lease_seconds: float = 10.0,
          journal: Journal | None = None) -> RunningServer:
    """Start the manager on `listen` (port 0 picks one); metrics on metrics_port (0 picks, None = off)."""
    manager = manager or BlockManager(lease_seconds)
    for pc in pools:
        manager.create_pool(pc.name, pc.spec, pc.sizing, pc.backends)
    metrics = ManagerMetrics(manager)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(
        BlockManagerServicer(ManagerAPI(manager), metrics, journal), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if metrics_port is not None:
        http, _thread = start_http_server(metrics_port, addr=metrics_addr, registry=metrics.registry)
        metrics_port = http.server_port
    log.info("kvservice listening on port %d, metrics on %s", port, metrics_port)
    return RunningServer(server, port, metrics_port, manager, metrics, http)
