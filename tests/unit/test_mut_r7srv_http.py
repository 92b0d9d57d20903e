"""kvservice/server/http.py: what a HEAD request gets on the wire (the headers GET would send, then nothing: RFC 9110
9.3.2, and the module doc), read from a raw socket so that a body sent after the headers cannot hide; and
health_probe's answer for a service the health servicer does not know ("<service or 'server'>: unknown", not
ready).
"""

from __future__ import annotations

import socket

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Gauge

from kvservice.server.http import MetricsServer, health_probe


def _raw(port: int, request: bytes) -> bytes:
    """Everything the server sends for one HTTP/1.0 request, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/elsewhere"])
def test_head_sends_the_headers_of_get_and_no_body(path) -> None:
    reg = CollectorRegistry()
    Gauge("kvs_r7_head_value", "a gauge of this test", registry=reg).set(31)
    srv = MetricsServer(reg, 0, "127.0.0.1", lambda: (True, "server: SERVING"),
                        lambda: (False, "kvservice.v1.BlockManager: NOT_SERVING"))
    try:
        got = _raw(srv.server_port, f"GET {path} HTTP/1.0\r\n\r\n".encode())
        head = _raw(srv.server_port, f"HEAD {path} HTTP/1.0\r\n\r\n".encode())
    finally:
        srv.shutdown()
    get_head, _, body = got.partition(b"\r\n\r\n")
    assert body and head.endswith(b"\r\n\r\n") and head.count(b"\r\n\r\n") == 1
    assert _undated(head[:-4]) == _undated(get_head)
    assert f"Content-Length: {len(body)}\r\n".encode() in head


def _undated(head: bytes) -> list[bytes]:
    """The status line and headers, less Date (the second may turn between the two requests)."""
    return [line for line in head.split(b"\r\n") if not line.startswith(b"Date: ")]


class _Unknown:
    """A health servicer that knows no service: Check sets NOT_FOUND on the context, as grpc_health's does."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def Check(self, request, context):
        self.asked.append(request.service)
        context.set_code("NOT_FOUND")
        return health_pb2.HealthCheckResponse()


@pytest.mark.parametrize("service, what", [("", "server: unknown"),
                                           ("kvservice.v1.BlockManager", "kvservice.v1.BlockManager: unknown")])
def test_a_service_the_health_servicer_does_not_know_is_not_ready_and_says_unknown(service, what) -> None:
    health = _Unknown()
    assert health_probe(health, service)() == (False, what)
    assert health.asked == [service]
