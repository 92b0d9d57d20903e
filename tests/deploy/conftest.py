"""Fixtures of the deploy tests: real manager and worker processes on loopback (see support.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import TINY_POOLS, Proc, start_process, stop_process


@pytest.fixture
def start_manager(tmp_path: Path) -> Iterator:
    """Factory: start `kvservice serve` on loopback (tiny pool unless pools given); stopped at teardown."""
    procs: list[Proc] = []

    def start(pools: str = TINY_POOLS) -> Proc:
        (tmp_path / "pools.yaml").write_text(pools)
        proc = start_process(["-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "0",
                       "--pools", str(tmp_path / "pools.yaml"), "--log-level", "WARNING"], tmp_path,
                      f"manager{len(procs)}")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc.popen)


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator:
    """Factory: start `kvworker serve --backend cpu` against a manager; stopped at teardown."""
    procs: list[Proc] = []

    def start(manager: Proc, pool: str = "default") -> Proc:
        proc = start_process(["-m", "kvservice.worker.cli", "serve", "--manager", manager.grpc_addr, "--pool", pool,
                       "--backend", "cpu", "--listen", "127.0.0.1:0", "--metrics-port", "0",
                       "--enable-test-hooks", "--log-level", "WARNING"], tmp_path, f"worker{len(procs)}")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc.popen)
