"""The manager's HTTP port (kvservice/server/http.py) in-process: /metrics, /healthz and /readyz from the gRPC health
servicer, 404 and 405 as its module doc says, and the log line naming the address it listens on."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import pytest
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry, Counter

from kvservice.server.http import MetricsServer, health_probe

SERVICE = "kvservice.v1.BlockManager"


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def served(caplog):
    caplog.set_level(logging.INFO, logger="kvservice")
    reg = CollectorRegistry()
    Counter("kvs_probe_test_total", "a counter of this test", registry=reg).inc(3)
    hs = health.HealthServicer()
    hs.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    srv = MetricsServer(reg, 0, "127.0.0.1", health_probe(hs, ""), health_probe(hs, SERVICE))
    yield srv, hs, f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def test_the_log_names_the_address_and_port_it_listens_on(served, caplog):
    _, _, base = served
    lines = [r.getMessage() for r in caplog.get_records("setup") if r.name == "kvservice"]
    assert f"metrics, /healthz and /readyz on {base}" in lines, lines


def test_readiness_follows_the_block_manager_service_and_liveness_the_server(served):
    _, hs, base = served
    assert _get(base + "/healthz") == (200, "ok: server: SERVING\n")
    assert _get(base + "/readyz") == (503, f"not ready: {SERVICE}: NOT_SERVING\n")
    hs.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert _get(base + "/readyz") == (200, f"ok: {SERVICE}: SERVING\n")
    hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert _get(base + "/healthz") == (503, "not ready: server: NOT_SERVING\n")


def test_metrics_other_paths_and_methods(served):
    _, _, base = served
    status, body = _get(base + "/metrics?x=1")
    assert status == 200 and "kvs_probe_test_total 3.0" in body
    assert _get(base + "/nope")[0] == 404 and "try /metrics, /healthz or /readyz" in _get(base + "/nope")[1]
    assert _get(base + "/metrics", "POST")[0] == 405


def test_a_probe_of_an_unknown_service_is_not_ready():
    hs = health.HealthServicer()
    assert health_probe(hs, "no.such.Service")() == (False, "no.such.Service: unknown")
    assert health_probe(hs, "")() == (True, "server: SERVING")
