"""DirectPublisher's connection contract against tiny fake NATS servers on 127.0.0.1 (kvservice/state/nats/direct.py,
module doc and docstrings): a server whose INFO asks for TLS is refused with the documented reason (as one asking for
credentials is); a server that closes the connection is reported in the client's own words; prefer() moves the
connection to the named server at once and keeps it when it is already there (or for "": any server); the reply
inbox is _INBOX.kvs + 20 random hex digits (80 bits: no two connections share one)."""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading

import pytest

from kvservice.state.nats.direct import DirectError, DirectPublisher
from tests.unit.test_mut_r3sn_direct import FakeNats

CLOSED = "the NATS server closed the journal's connection"


def _info(**extra) -> dict:
    return {"server_id": "X", "server_name": "fake-" + secrets.token_hex(3), "headers": True,
            "max_payload": 1 << 20, "proto": 1, **extra}


class ClosingServer:
    """Accepts connections; each gets `greeting` (b"": nothing) and a PONG to its PING, and is closed (FIN, no reset)
    once `after` was received (b"": at once)."""

    def __init__(self, greeting: bytes = b"", after: bytes = b"") -> None:
        self.greeting, self.after = greeting, after
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(self.greeting)
                    got, ponged = b"", False
                    while self.after not in got:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                        if b"PING\r\n" in got and not ponged:
                            conn.sendall(b"PONG\r\n")
                            ponged = True
                    conn.shutdown(socket.SHUT_WR)          # the client reads the end of the stream
                    while conn.recv(65536):                 # and closes; nothing left unread (no reset)
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        self.srv.close()


def test_a_server_that_requires_tls_is_refused_naming_the_url_and_why():
    """INFO with tls_required (and headers, no auth) -> DirectError "cannot open the journal's NATS connection:
    <url>: <url> requires TLS or credentials, which --state nats:// does not carry"; nothing stays connected."""
    fake = FakeNats(_info(tls_required=True), answer=b'{"seq":1}')
    d = DirectPublisher((fake.url,), "t-direct-tls", 2.0)
    try:
        with pytest.raises(DirectError) as err:
            d.request("t.any", b"x", {"X-A": "1"}, 3.0)
        assert err.value.message == (f"cannot open the journal's NATS connection: {fake.url}: {fake.url} requires "
                                     "TLS or credentials, which --state nats:// does not carry")
        assert (d.connects, d._sock, d.server_name) == (0, None, "")
    finally:
        d.close()
        fake.close()


def test_a_server_that_closes_before_its_info_is_reported_in_the_clients_words():
    """The server accepts and closes at once -> DirectError naming the URL and "the NATS server closed the
    journal's connection"."""
    srv = ClosingServer()
    d = DirectPublisher((srv.url,), "t-direct-closed", 2.0)
    try:
        with pytest.raises(DirectError) as err:
            d.request("t.any", b"x", {"X-A": "1"}, 3.0)
        assert err.value.message == f"cannot open the journal's NATS connection: {srv.url}: {CLOSED}"
        assert d.connects == 0 and d._sock is None
    finally:
        d.close()
        srv.close()


def test_a_server_that_closes_after_a_publish_raises_connection_reset_and_drops_the_connection():
    """Handshake done, then the server closes on the HPUB -> the request raises ConnectionResetError whose text is
    "the NATS server closed the journal's connection"; the connection is dropped (server_name "")."""
    info = json.dumps(_info()).encode()
    srv = ClosingServer(b"INFO " + info + b"\r\n", after=b"HPUB ")
    d = DirectPublisher((srv.url,), "t-direct-reset", 2.0)
    try:
        with pytest.raises(ConnectionResetError) as err:
            d.request("t.any", b"x", {"X-A": "1"}, 3.0)
        assert str(err.value) == CLOSED
        assert d.connects == 1 and d._sock is None and d.server_name == ""
    finally:
        d.close()
        srv.close()


def test_prefer_moves_to_the_named_server_at_once_and_keeps_a_connection_already_there():
    """Connected to A: prefer("") and prefer(A) keep the connection; prefer(B) drops it (server_name ""), and the
    next request goes to B (connects 2)."""
    a, b = FakeNats(_info(), answer=b'{"seq":1}'), FakeNats(_info(), answer=b'{"seq":2}')
    d = DirectPublisher((a.url, b.url), "t-direct-prefer", 2.0)
    try:
        assert d.request("t.s", b"1", {"X-A": "1"}, 5.0).data == b'{"seq":1}'
        assert d.server_name == a.info["server_name"] and d.connects == 1
        d.prefer("")
        assert d.server_name == a.info["server_name"] and d._sock is not None
        d.prefer(a.info["server_name"])
        assert d.server_name == a.info["server_name"] and d._sock is not None
        d.prefer(b.info["server_name"])
        assert d.server_name == "" and d._sock is None
        assert d.request("t.s", b"2", {"X-A": "2"}, 5.0).data == b'{"seq":2}'
        assert d.server_name == b.info["server_name"] and d.connects == 2
    finally:
        d.close()
        a.close()
        b.close()


def test_the_reply_inbox_is_eighty_random_bits_of_hex_and_differs_per_publisher():
    """SUB _INBOX.kvs<20 hex digits>.* 1 on every connection; two publishers never share the inbox; the socket
    sends without Nagle's delay (TCP_NODELAY: a publish is one small write waiting for its reply)."""
    inboxes = []
    for _ in range(2):
        fake = FakeNats(_info(), answer=b'{"seq":7}')
        d = DirectPublisher((fake.url,), "t-direct-inbox", 5.0)
        try:
            d.request("t.subject", b"x", {"Nats-Msg-Id": "m1"}, 5.0)
            assert d._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1    # no Nagle delay
            sub = bytes(fake.got).split(b"\r\n")[1]
            m = re.fullmatch(rb"SUB (_INBOX\.kvs[0-9a-f]{20})\.\* 1", sub)
            assert m, sub
            inboxes.append(m.group(1))
        finally:
            d.close()
            fake.close()
    assert inboxes[0] != inboxes[1]
