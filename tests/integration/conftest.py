"""A real `kvservice serve` process on loopback, shared by the integration tests of a module."""

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.worker_client import WorkerClient
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


class WorkerProcess:
    """A real `kvworker serve` process on loopback (CPU backend), with its WorkerClient."""

    def __init__(self, tmp: Path, target: str, pool: str, worker_id: str, layers: str = "", *extra: str) -> None:
        self.worker_id = worker_id
        port_file = tmp / f"{worker_id}.ports"
        port_file.unlink(missing_ok=True)
        self.log = open(tmp / f"{worker_id}.log", "a+")
        cmd = [sys.executable, "-m", "kvservice.worker.cli", "serve", "--manager", target, "--pool", pool, "--listen",
               "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(port_file), "--worker-id", worker_id,
               "--enable-test-hooks", *(["--layers", layers] if layers else []), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        port, metrics = wait_for_ports(self.proc, port_file, 60, tmp / f"{worker_id}.log", f"worker {worker_id}")
        self.address = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.client = WorkerClient(self.address, worker_id, timeout=20)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("kvworker_") and not ln.startswith("#")}

    def stop(self, kill: bool = False) -> None:
        self.client.close()
        self.proc.kill() if kill else self.proc.terminate()
        self.proc.wait(10)
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
