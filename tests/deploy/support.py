"""Helpers of the deploy tests: paths, tool discovery, real manager/worker processes on loopback.

Every external tool (kubectl, promtool, prometheus) is looked up on PATH; a test that needs
a missing one is skipped with the reason and the command that installs it, except under CI
(CI=true), where it fails (tests/ci.py). Nothing else is skipped. `deploy/ci-install.sh`
installs all of them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvservice.tools.launch import wait_for_ports
from tests.ci import need_tool

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "kvservice.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "kvservice.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "kvservice.json"
PROMETHEUS_RULE = DEPLOY / "components" / "prometheus-operator" / "prometheusrule.yaml"
OPERATIONS = REPO / "docs" / "operations.md"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

#: What the services export (docs/DESIGN.md, "Metric names"). Histograms by family name.
MANAGER_METRICS = {
    "kvservice_slots_total": "gauge",
    "kvservice_slots_free": "gauge",
    "kvservice_sequences": "gauge",
    "kvservice_alloc_failures_total": "counter",
    "kvservice_prefix_cache_hits_total": "counter",
    "kvservice_rpc_duration_seconds": "histogram",
    "kvservice_requests_refused_total": "counter",
    # KV events and prefix lookups (kvservice/events/metrics.py)
    "kvservice_prefix_cache_lookup_pages_total": "counter",
    "kvservice_prefix_cache_hit_pages_total": "counter",
    "kvservice_kv_events_published_total": "counter",
    "kvservice_kv_event_batches_sent_total": "counter",
    "kvservice_kv_event_batches_dropped_total": "counter",
    "kvservice_kv_event_resets_total": "counter",
    "kvservice_kv_event_subscribers": "gauge",
    "kvservice_kv_event_subscriber_lag_batches": "gauge",
    "kvservice_kv_event_buffer_batches": "gauge",
    "kvservice_kv_event_sequence": "gauge",
    "kvservice_kv_event_batches_total": "counter",
}
WORKER_METRICS = {
    "kvworker_bounds_violations_total": "counter",
    "kvworker_guard_corruptions_total": "counter",
    "kvworker_kernel_duration_seconds": "histogram",
    "kvworker_cache_bytes": "gauge",
    "kvworker_leader_epoch_refusals_total": "counter",
    "kvworker_state_rollbacks_total": "counter",
    "kvworker_kernels_stopped_total": "counter",
}
#: Exported by a scheduler's client when it is given a prometheus_client registry (kvservice/client/position.py),
#: under the scheduler's own job: nothing here scrapes one.
CLIENT_METRICS = {
    "kvservice_client_state_rollbacks_total": "counter",
    "kvservice_client_lineage_changes_total": "counter",
}
#: Exported only once a pool caches prefixes (the default pool does not) or has KV event subscribers.
COMING = {"kvservice_prefix_cache_hits_total", "kvservice_prefix_cache_lookup_pages_total",
          "kvservice_prefix_cache_hit_pages_total", "kvservice_kv_events_published_total",
          "kvservice_kv_event_batches_sent_total", "kvservice_kv_event_batches_dropped_total",
          "kvservice_kv_event_resets_total", "kvservice_kv_event_subscribers",
          "kvservice_kv_event_subscriber_lag_batches", "kvservice_kv_event_buffer_batches",
          "kvservice_kv_event_sequence", "kvservice_kv_event_batches_total"}


def sample_names(metrics: dict[str, str]) -> set[str]:
    """Series names a scrape carries for these families (histograms: _bucket, _sum, _count)."""
    out: set[str] = set()
    for name, kind in metrics.items():
        out |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return out


#: Exported by a replicated manager (--state nats://..., docs/HA.md) only: the live scrape here runs a
#: single in-memory manager; tests/integration/test_ha.py scrapes a replicated one for these.
REPLICATED_METRICS = {
    "kvservice_leader": "gauge",
    "kvservice_leader_epoch": "gauge",
    "kvservice_lease_remaining_seconds": "gauge",
    "kvservice_lease_renewals_total": "counter",
    "kvservice_lease_renew_failures_total": "counter",
    "kvservice_standby_lag_entries": "gauge",
    "kvservice_standby_applied_total": "counter",
    "kvservice_standby_reloads_total": "counter",
    "kvservice_takeover_seconds": "gauge",
    "kvservice_journal_append_retries_total": "counter",
    "kvservice_nats_disconnects_total": "counter",
    "kvservice_journal_commit_seconds": "histogram",
}
KNOWN_SERIES = (sample_names(MANAGER_METRICS) | sample_names(WORKER_METRICS) | sample_names(REPLICATED_METRICS)
                | sample_names(CLIENT_METRICS) | {"up"})


def need(tool: str) -> str:
    """Path of `tool`, or skip the test saying how to install it (fail under CI)."""
    package = {"promtool": "prometheus", "prometheus": "prometheus"}.get(tool, tool)
    return need_tool(tool, f"apt package {package}; deploy/ci-install.sh installs it")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@dataclass
class Proc:
    popen: subprocess.Popen
    grpc_port: int
    metrics_port: int
    log: Path

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")


def stop_process(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def start_process(args: list[str], workdir: Path, name: str, timeout: float = 30.0) -> Proc:
    port_file = workdir / f"{name}.ports"
    log = workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        p = subprocess.Popen([PYTHON, *args, "--port-file", str(port_file)], cwd=REPO, env=env,
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        grpc_port, metrics_port = wait_for_ports(p, port_file, timeout, log, name)
    except RuntimeError:
        stop_process(p)
        raise
    return Proc(p, grpc_port, metrics_port, log)


#: A pool small enough to run out of slots in two Steps: 16 slots of 16 tokens, 2 tiny layers.
TINY_POOLS = """\
pools:
  - name: default
    page_size: 16
    layout: per_layer
    layers:
      - {count: 2, kv_heads: 1, head_dim: 32, dtype: float16}
    sizing: {num_slots: 16}
    backends: [native]
"""
#: The same pool with prefix caching (the prefix-cache and KV event panels have a pool to show).
TINY_CACHING_POOLS = TINY_POOLS + "    prefix_caching: true\n"
