"""Real nats-server processes on loopback for the replication tests and bench/bench_ha.py.

A NatsCluster is 1 node (JetStream, no clustering) or 3 (a JetStream cluster with routes), every
port chosen free at start, every process stopped by stop() (tests call it from a fixture
finalizer). nats-server comes from the Debian package (deploy/ci-install.sh); without it the
tests skip, except under CI=true where they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NATS_SERVER = shutil.which("nats-server") or (
    "/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None)


def require_nats_server() -> str:
    """The nats-server binary; skips the test without it (fails under CI=true: CI must run these)."""
    from tests.ci import missing
    if NATS_SERVER is None:
        missing("nats-server", "apt-get install nats-server; deploy/ci-install.sh does it")
    assert NATS_SERVER is not None
    return NATS_SERVER


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsNode:
    def __init__(self, binary: str, root: Path, name: str, port: int, cluster_port: int | None,
                 routes: list[int]) -> None:
        self.binary, self.name, self.port, self.cluster_port = binary, name, port, cluster_port
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "nats.conf"
        lines = [f"server_name: {name}", f"listen: 127.0.0.1:{port}", "max_payload: 1MB",
                 "jetstream {", f'  store_dir: "{self.dir / "js"}"', "  max_memory_store: 256MB",
                 "  max_file_store: 4GB", "}"]
        if cluster_port is not None:
            lines += ["cluster {", "  name: kvs", f"  listen: 127.0.0.1:{cluster_port}",
                      "  routes: [" + ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes) + "]", "}"]
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log = open(self.dir / "server.log", "a")
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 (no lame-duck mode, no leadership handover)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


class NatsCluster:
    """size 1: one JetStream server; size 3: a JetStream cluster of three (Raft: survives one loss)."""

    def __init__(self, root: Path, size: int = 3) -> None:
        binary = NATS_SERVER
        if binary is None:
            raise RuntimeError("nats-server is not installed")
        ports = free_ports(2 * size)
        clients, routes = ports[:size], ports[size:]
        self.nodes = [NatsNode(binary, root, f"n{i}", clients[i], routes[i] if size > 1 else None,
                               routes if size > 1 else []) for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, timeout: float = 60.0) -> NatsCluster:
        for n in self.nodes:
            n.start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until JetStream answers through every live node (a cluster has elected its meta leader)."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            if not n.alive():
                continue
            while not asyncio.run(_jetstream_ready(n.url)):
                if not n.alive():
                    raise RuntimeError(f"nats-server {n.name} exited:\n" + (n.dir / "server.log").read_text()[-3000:])
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JetStream on {n.name} not ready in {timeout:g} s:\n"
                                       + (n.dir / "server.log").read_text()[-3000:])
                time.sleep(0.2)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


async def _jetstream_ready(url: str) -> bool:
    import nats
    try:
        async def quiet(_err: Exception) -> None:
            return None
        nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False,
                                error_cb=quiet)
    except Exception:
        return False
    try:
        await nc.jetstream(timeout=1.0).account_info()
        return True
    except Exception:
        return False
    finally:
        await nc.close()
