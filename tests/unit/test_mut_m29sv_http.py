"""The manager's HTTP port (kvservice/server/http.py) read at the byte level with http.client: status line, headers
and body of every route, for GET and HEAD, against its module doc and the Prometheus exposition format.

/healthz and /readyz: 200 "ok: <what>" or 503 "not ready: <what>", one line, text/plain in UTF-8; /metrics: the
registry in Prometheus' text format with its content type; any other path 404 naming the routes; the query string
is not part of the path; HEAD sends the headers of GET (Content-Length of the body GET sends) and no body.
"""

from __future__ import annotations

import http.client
import threading

import numpy as np
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge

from kvservice.server.http import MetricsServer

TEXT = "text/plain; charset=utf-8"


def _fetch(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.fixture
def served():
    rng = np.random.default_rng(61)
    reg = CollectorRegistry()
    value = int(rng.integers(1000, 10**6))
    Gauge("kvs_http_test_value", "a gauge of this test", registry=reg).set(value)
    state = {"healthz": (True, "server: SERVING"), "readyz": (False, "kvservice.v1.BlockManager: NOT_SERVING")}
    srv = MetricsServer(reg, 0, "127.0.0.1", lambda: state["healthz"], lambda: state["readyz"])
    assert srv._thread in threading.enumerate()                 # its serving thread: named, never blocks exit
    assert (srv._thread.name, srv._thread.daemon, srv._server.daemon_threads) == ("metrics-http", True, True)
    yield srv.server_port, state, value
    srv.shutdown()


def test_probes_answer_one_line_of_plain_text_with_its_exact_length(served) -> None:
    port, state, _ = served
    rng = np.random.default_rng(67)
    for _ in range(6):
        for route in ("healthz", "readyz"):
            ok = bool(rng.integers(2))
            what = "svc-" + rng.bytes(4).hex() + " ü"                # non-ASCII: the length is in bytes
            state[route] = (ok, what)
            body = f"{'ok' if ok else 'not ready'}: {what}\n".encode()
            query = "?verbose=1&x=?y" if rng.integers(2) else ""
            for method in ("GET", "HEAD"):
                status, headers, got = _fetch(port, f"/{route}{query}", method)
                assert status == (200 if ok else 503)
                assert headers["Content-Type"] == TEXT
                assert headers["Content-Length"] == str(len(body))
                assert got == (body if method == "GET" else b"")
                assert "None" not in headers


def test_metrics_is_the_prometheus_exposition_with_its_content_type(served) -> None:
    port, _, value = served
    for path in ("/metrics", "/metrics?name[]=kvs_http_test_value"):
        status, headers, body = _fetch(port, path)
        assert status == 200 and headers["Content-Type"] == CONTENT_TYPE_LATEST
        assert headers["Content-Length"] == str(len(body))
        assert f"kvs_http_test_value {float(value)}\n".encode() in body
        assert b"# HELP kvs_http_test_value a gauge of this test\n# TYPE kvs_http_test_value gauge\n" in body
    status, headers, body = _fetch(port, "/metrics", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_other_paths_are_404_in_plain_text_naming_the_routes(served) -> None:
    port, _, _ = served
    for path in ("/", "/health", "/metrics/x", "/readyz/", "/x?/metrics"):
        status, headers, body = _fetch(port, path)
        assert status == 404 and headers["Content-Type"] == TEXT
        assert body == f"not found: {path}; try /metrics, /healthz or /readyz\n".encode()
        assert headers["Content-Length"] == str(len(body))
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert _fetch(port, "/healthz", method)[0] == 405
