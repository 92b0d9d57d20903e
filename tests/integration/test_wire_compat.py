"""The proto and the wire format did not change with the package layout: the client of the release before
(commit a063a55, tests/fixtures/compat/kvservice-a063a55.zip) against today's server, and today's client
against that release's server, each through one checked scheduler session (tests/compat/wire_scenario.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.tools.launch import wait_for_ports

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests" / "fixtures" / "compat" / "kvservice-a063a55.zip"
SCENARIO = ROOT / "tests" / "compat" / "wire_scenario.py"


def _env(old: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(OLD) if old else os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _serve(tmp: Path, old: bool) -> tuple[subprocess.Popen, str, object]:
    ports, log = tmp / "ports", open(tmp / "manager.log", "w+")
    entry = [str(ROOT / "tests" / "compat" / "old_server.py")] if old else ["-m", "kvservice.server.cli"]
    proc = subprocess.Popen([sys.executable, *entry, "serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                             "--port-file", str(ports)], cwd=tmp, stdout=log, stderr=subprocess.STDOUT, env=_env(old))
    port, _ = wait_for_ports(proc, ports, 60, tmp / "manager.log", "old manager" if old else "manager")
    return proc, f"127.0.0.1:{port}", log


def _run(tmp: Path, server_old: bool, client_old: bool) -> subprocess.CompletedProcess:
    proc, target, log = _serve(tmp, server_old)
    try:
        return subprocess.run([sys.executable, str(SCENARIO), target, *(["--old"] if client_old else [])], cwd=tmp,
                              env=_env(client_old),
                              capture_output=True, text=True, timeout=300)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_the_fixture_is_the_old_layout(tmp_path):
    """The zip really holds the old packages (clients/, a flat kvservice/), not today's."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '')"
            ".startswith('__editable__')]; import kvservice.cli, clients.client, kvservice.pool; "
            "import importlib.util as u; print(clients.client.__file__, u.find_spec('kvservice.client'))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(True), cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "kvservice-a063a55.zip" in out.stdout, out.stderr
    assert out.stdout.split()[-1] == "None", "today's kvservice.client must not be importable beside the old one"


@pytest.mark.parametrize("server_old, client_old", [(False, True), (True, False), (False, False)],
                         ids=["old-client-new-server", "new-client-old-server", "new-client-new-server"])
def test_scenario(tmp_path, server_old, client_old):
    r = _run(tmp_path, server_old, client_old)
    server_log = (tmp_path / "manager.log").read_text()[-3000:]
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n--- server log ---\n{server_log}"
    assert "every answer as the contract says" in r.stdout
