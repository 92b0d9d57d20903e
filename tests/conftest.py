"""Shared hooks: the run's coverage summary (tests/run_summary.py), per-test time limits scaled to the load,
and one nats-server per test module."""

import pytest

from tests import run_summary


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    run_summary.write(terminalreporter)


def pytest_sessionfinish(session, exitstatus):
    out = getattr(session.config, "workeroutput", None)      # a pytest-xdist worker: hand the tallies over
    if out is not None:
        out["kvs_summary"] = run_summary.export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker finished; add its tallies to what the summary prints."""
    text = getattr(node, "workeroutput", {}).get("kvs_summary")
    if text:
        run_summary.merge(text)


# ---- per-test time limits scaled to the machine's load ------------------------------------------------
#: The pytest-timeout limits (pyproject's 300 s, and each @pytest.mark.timeout) were set on an idle 2-core
#: machine. They are there to catch hangs, not to time anything; on a loaded machine (CI neighbours, a
#: mutation run beside it) CPU-bound tests take proportionally longer. Each test's limit is multiplied by
#: the load per core when the session starts (at least 1, at most MAX_TIMEOUT_SCALE); KVS_TIMEOUT_SCALE sets
#: the factor instead.
MAX_TIMEOUT_SCALE = 8.0


def timeout_scale() -> float:
    import os

    forced = os.environ.get("KVS_TIMEOUT_SCALE")
    if forced:
        return max(1.0, float(forced))
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:                     # no load average on this platform
        return 1.0
    return min(MAX_TIMEOUT_SCALE, max(1.0, load))


def pytest_collection_modifyitems(session, config, items):
    scale = timeout_scale()
    config._kvs_timeout_scale = scale
    if scale == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        base = float(marker.args[0]) if marker and marker.args else float(marker.kwargs.get("timeout", default)) \
            if marker else default
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * scale), append=False)   # before any decorator's


def pytest_report_header(config):
    return f"per-test time limits x {timeout_scale():.2f} (load per core; KVS_TIMEOUT_SCALE overrides)"


# ---- one nats-server per test module -------------------------------------------------------------------
@pytest.fixture(scope="module")
def nats1(tmp_path_factory):
    """One nats-server (JetStream, sync_interval: always, as deploy/ ships it) for one test module, with its
    monitoring port (``cluster.monitor``: http://127.0.0.1:PORT, for /connz). Skips where no server binary is."""
    from tests.natsutil import NatsCluster, free_ports, require_nats_server

    require_nats_server()
    cluster = NatsCluster(tmp_path_factory.mktemp("nats1"), 1)
    (port,) = free_ports(1)
    node = cluster.nodes[0]
    node.conf.write_text(node.conf.read_text() + f"http: 127.0.0.1:{port}\n")
    cluster.monitor = f"http://127.0.0.1:{port}"
    cluster.start()
    yield cluster
    cluster.stop()
