"""The manager's HTTP port: /metrics (Prometheus), /healthz (liveness), /readyz (readiness); 404 otherwise.

/healthz answers 200 while the process serves at all (the gRPC health of the whole server, "", is
SERVING: it turns NOT_SERVING when the journal failed and the process is about to exit), else 503.
/readyz answers 200 while this manager serves the BlockManager API (health of
``kvservice.v1.BlockManager`` SERVING): always for a single manager once it started, only the
leader for replicated managers (a standby answers 503, as its gRPC readiness does, docs/HA.md).
Both bodies say the state in one line. Any other path is 404; methods other than GET and HEAD 405.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("kvservice")

#: (ok, what) of a probe.
Probe = Callable[[], tuple[bool, str]]


def health_probe(health: object, service: str) -> Probe:
    """A probe reading a grpc_health HealthServicer's status of `service` through its Check method."""
    from grpc_health.v1 import health_pb2

    class _Context:                     # what Check needs of a ServicerContext when the service is unknown
        code = None

        def set_code(self, code: object) -> None:
            self.code = code

    def probe() -> tuple[bool, str]:
        ctx = _Context()
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), ctx)   # type: ignore[attr-defined]
        if ctx.code is not None:
            return False, f"{service or 'server'}: unknown"
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{service or 'server'}: {name}"
    return probe


class MetricsServer:
    """A threaded HTTP server on (addr, port) (port 0 picks one); `server_port` is the bound one."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str, healthz: Probe, readyz: Probe) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: _probe(healthz),
            "/readyz": lambda: _probe(readyz),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype = 404, "text/plain; charset=utf-8"
                    body = f"not found: {self.path}; try /metrics, /healthz or /readyz\n".encode()
                else:
                    status, ctype, body = route()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_GET

            def do_POST(self) -> None:
                self.send_error(405, "only GET and HEAD")

            do_PUT = do_DELETE = do_PATCH = do_POST

            def log_message(self, fmt: str, *args: object) -> None:     # scrapes every second: not logged
                pass

        self._server = ThreadingHTTPServer((addr, port), Handler)
        self._server.daemon_threads = True
        self.server_port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics, /healthz and /readyz on http://%s:%d", addr, self.server_port)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _probe(probe: Probe) -> tuple[int, str, bytes]:
    ok, what = probe()
    return (200 if ok else 503), "text/plain; charset=utf-8", f"{'ok' if ok else 'not ready'}: {what}\n".encode()


__all__ = ["MetricsServer", "health_probe"]
