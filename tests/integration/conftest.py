"""A real `kvservice serve` process on loopback, shared by the integration tests of a module."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.client import BlockManagerClient
from kvservice.tools.launch import wait_for_ports

ROOT = Path(__file__).resolve().parents[2]


class ManagerProcess:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port_file = tmp / "ports"
        self.port_file.unlink(missing_ok=True)            # a stale file from an earlier run in this dir
        self.log = open(tmp / "manager.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "0",
             "--port-file", str(self.port_file), *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        port, metrics = wait_for_ports(self.proc, self.port_file, 30, tmp / "manager.log", "manager")
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    m = ManagerProcess(tmp_path_factory.mktemp("manager"))
    yield m
    m.stop()


@pytest.fixture
def client(manager):
    with BlockManagerClient(manager.target, timeout=10) as c:
        c.wait_ready()
        yield c
