"""DirectPublisher against a tiny fake NATS server on 127.0.0.1 that records the bytes it receives, checked on the
NATS client protocol as the module doc of kvservice/state/nats/direct.py describes it: the server's INFO first, then
CONNECT (verbose and pedantic off, headers and no-responders on), SUB <inbox>.* 1, PING; HPUB; replies as MSG."""

from __future__ import annotations

import json
import secrets
import socket
import threading

from kvservice.state.nats.direct import DirectPublisher


class FakeNats:
    """Accepts one connection: sends `info`, answers the first PING with PONG and the first HPUB with a MSG to its
    reply subject carrying `answer`; everything received is kept in `got`."""

    def __init__(self, info: dict, answer: bytes) -> None:
        self.info, self.answer, self.got = info, answer, bytearray()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.srv.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _until(self, conn, marker: bytes, start: int = 0) -> int:
        while (i := self.got.find(marker, start)) < 0:
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError("client went away")
            self.got += chunk
        return i

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            conn.sendall(b"INFO " + json.dumps(self.info).encode() + b"\r\n")
            try:
                self._until(conn, b"PING\r\n")
                conn.sendall(b"PONG\r\n")
                i = self._until(conn, b"HPUB ")
                end = self._until(conn, b"\r\n", i)
                _, _, reply, _, total = bytes(self.got[i:end]).split()
                self._until(conn, b"\r\n", end + 2 + int(total))
                conn.sendall(b"MSG %s 1 %d\r\n%s\r\n" % (reply, len(self.answer), self.answer))
                conn.recv(65536)
            except (ConnectionError, OSError):
                pass

    def close(self) -> None:
        self.srv.close()


def test_the_handshake_sends_exactly_the_documented_connect_and_learns_max_payload_from_info():
    """INFO with headers and a max_payload of its own -> the client sends CONNECT with exactly the documented fields
    (verbose/pedantic off, headers/no_responders on, protocol 1, its name, lang and version), SUB <inbox>.* 1 and
    PING; then an HPUB to the subject, and the MSG reply comes back; max_payload is the INFO's."""
    payload_limit = 4096 + secrets.randbelow(1 << 16)
    fake = FakeNats({"server_id": "X", "server_name": "fake-" + secrets.token_hex(3), "headers": True,
                     "max_payload": payload_limit, "proto": 1}, answer=b'{"seq":7}')
    name = "t-direct-" + secrets.token_hex(4)
    d = DirectPublisher((fake.url,), name, 5.0)
    try:
        data = secrets.token_bytes(16)
        reply = d.request("t.subject", data, {"Nats-Msg-Id": "m1"}, 5.0)
        assert (reply.headers, reply.data) == (b"", b'{"seq":7}')
        assert d.max_payload == payload_limit
        assert d.server_name == fake.info["server_name"]
        lines = bytes(fake.got).split(b"\r\n")
        assert lines[0].startswith(b"CONNECT ")
        assert json.loads(lines[0][len(b"CONNECT "):]) == {
            "verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
            "name": name, "lang": "python-kvservice-direct", "version": "1"}
        sub = lines[1].split()
        assert sub[0] == b"SUB" and sub[1].startswith(b"_INBOX.") and sub[1].endswith(b".*") and sub[2] == b"1"
        assert len(sub) == 3 and lines[2] == b"PING"
        hdr = b"NATS/1.0\r\nNats-Msg-Id: m1\r\n\r\n"
        hpub = lines[3].split()
        assert hpub[0] == b"HPUB" and hpub[1] == b"t.subject" and hpub[2].startswith(sub[1][:-1])
        assert (int(hpub[3]), int(hpub[4])) == (len(hdr), len(hdr) + len(data))
        assert bytes(fake.got).endswith(lines[3] + b"\r\n" + hdr + data + b"\r\n")
    finally:
        d.close()
        fake.close()
