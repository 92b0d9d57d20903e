"""NatsLink's operator-facing log lines against a fake NATS server on 127.0.0.1 (INFO, then PONG to every PING):
the warning for a server version other than the one kvservice is tested with (docs/HA.md, 'One NATS version'),
and the warning naming the server after nats-py reconnected."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading

from kvservice.state.nats import NATS_SERVER_VERSION
from kvservice.state.nats.config import NatsConfig
from kvservice.state.nats.link import NatsLink
from tests.clocks import until


class FakeServer:
    """Accepts connections until closed; each gets INFO (version `version`) and a PONG for every PING; cut() ends
    the connections open now (the client then reconnects)."""

    def __init__(self, version: str) -> None:
        self.version, self.open = version, []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def cut(self) -> None:
        for conn in self.open:
            conn.shutdown(socket.SHUT_RDWR)
        self.open = []

    def _serve(self, conn: socket.socket) -> None:
        info = {"server_id": "FAKE", "server_name": "fake", "version": self.version, "proto": 1, "headers": True,
                "max_payload": 1 << 20, "host": "127.0.0.1", "port": self.port}
        buf = b""
        with conn:
            try:
                conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
                while chunk := conn.recv(65536):
                    buf += chunk
                    while b"\r\n" in buf:
                        line, buf = buf.split(b"\r\n", 1)
                        if line.upper().startswith(b"PING"):
                            conn.sendall(b"PONG\r\n")
            except OSError:
                return

    def close(self) -> None:
        self.srv.close()


def _warnings(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


def test_a_server_of_another_version_is_named_in_a_warning_with_the_tested_version(caplog):
    """Connecting to a server reporting version 9.8.7 -> exactly the documented warning, naming that version, the
    URL and NATS_SERVER_VERSION."""
    fake = FakeServer("9.8.7")
    caplog.set_level(logging.WARNING, logger="kvservice.nats")
    lk = NatsLink(NatsConfig((fake.url,), name="t" + secrets.token_hex(4)), connect_seconds=5.0)
    try:
        assert lk.server_version == "9.8.7"
        assert _warnings(caplog, "kvservice.nats") == [
            f"NATS server 9.8.7 at {fake.url}; kvservice is tested with {NATS_SERVER_VERSION} "
            "(docs/HA.md, 'One NATS version'): run that version"]
    finally:
        lk.close()
        fake.close()


def test_a_reconnection_is_logged_naming_the_server_reached(caplog):
    """The server cuts the first connection; nats-py reconnects -> "NATS: disconnected from <url>; reconnecting"
    then "NATS: reconnected to 127.0.0.1:<port>"."""
    fake = FakeServer(NATS_SERVER_VERSION)
    caplog.set_level(logging.WARNING, logger="kvservice.nats")
    lk = NatsLink(NatsConfig((fake.url,), name="t" + secrets.token_hex(4)), connect_seconds=5.0)
    try:
        assert _warnings(caplog, "kvservice.nats") == []
        fake.cut()
        want = f"NATS: reconnected to 127.0.0.1:{fake.port}"
        assert until(lambda: want in _warnings(caplog, "kvservice.nats"), 20.0), _warnings(caplog, "kvservice.nats")
        assert _warnings(caplog, "kvservice.nats")[:2] == [f"NATS: disconnected from {fake.url}; reconnecting", want]
    finally:
        lk.close()
        fake.close()
