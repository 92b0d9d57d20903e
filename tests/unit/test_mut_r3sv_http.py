"""kvservice/server/http.py: a method other than GET and HEAD is refused 405 with the reason "only GET and HEAD"
(the module doc), on every path, in the status line and in the error page's body."""

from __future__ import annotations

import http.client

import pytest
from prometheus_client import CollectorRegistry

from kvservice.server.http import MetricsServer


@pytest.fixture
def port():
    srv = MetricsServer(CollectorRegistry(), 0, "127.0.0.1", lambda: (True, "server: SERVING"),
                        lambda: (True, "kvservice.v1.BlockManager: SERVING"))
    yield srv.server_port
    srv.shutdown()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz", "/nowhere"])
def test_other_methods_are_405_with_the_reason_only_get_and_head(port, method, path) -> None:
    """The status line reads `405 only GET and HEAD`, and the error page names the same reason."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=b"x=1")
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    assert (r.status, r.reason) == (405, "only GET and HEAD")
    assert b"only GET and HEAD" in body
