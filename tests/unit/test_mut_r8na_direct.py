"""DirectPublisher's connection choice and wire reading (kvservice/state/nats/direct.py docstrings, and the NATS
client protocol: INFO / PING / PONG / -ERR / +OK / MSG / HMSG lines), checked against the fake servers and buffered
publishers the other direct tests use:

- with a preferred server whose name is not known yet, every server is tried for it first (a server not known to
  be another is a candidate), so the publish lands on the preferred one even when another comes first in turn.
- _recv refuses a deadline already past without reading; it reads what came otherwise, and names a closed
  connection; _read_message answers "pong" only while the handshake waits for one (None otherwise), answers a PING
  with PONG, raises the server's -ERR text, and returns a message's subject and its header/data split.
"""

from __future__ import annotations

import secrets
import socket
import time
from types import SimpleNamespace

import pytest

from kvservice.state.nats import direct
from kvservice.state.nats.direct import DirectError, DirectPublisher, Reply
from tests.clocks import ManualClock
from tests.unit.test_mut_d5st_direct_publish import publisher
from tests.unit.test_mut_r3sn_direct import FakeNats
from tests.unit.test_mut_r7nats_direct import _info


def test_a_preferred_server_not_known_yet_is_looked_for_among_all_servers_first():
    a, b = FakeNats(_info(), answer=b'{"seq":1}'), FakeNats(_info(), answer=b'{"seq":2}')
    d = DirectPublisher((a.url, b.url), "t-direct-want", 2.0)
    try:
        d.prefer(b.info["server_name"])                    # nothing known of either server yet
        assert d.request("t.s", b"x", {"X-A": "1"}, 5.0).data == b'{"seq":2}'
        assert d.server_name == b.info["server_name"] and d.connects == 1
        assert d._names == {a.url: a.info["server_name"], b.url: b.info["server_name"]}
    finally:
        d.close()
        a.close()
        b.close()


def _paired(timeout_seconds: float = 2.0):
    here, there = socket.socketpair()
    d = DirectPublisher(("nats://127.0.0.1:1",), "t", timeout_seconds)
    d._sock = here
    return d, there


def test_recv_refuses_a_deadline_already_past_without_reading():
    d, there = _paired()
    try:
        there.sendall(b"PONG\r\n")
        with pytest.raises(TimeoutError):
            d._recv(time.monotonic() - 0.001)
        assert d._buf == bytearray()
        d._recv(time.monotonic() + 30.0)
        assert d._buf == bytearray(b"PONG\r\n")
        there.close()
        with pytest.raises(ConnectionResetError, match=r"^the NATS server closed the journal's connection$"):
            d._recv(time.monotonic() + 30.0)
    finally:
        d._sock.close()


def test_read_message_answers_pong_only_while_waiting_for_one():
    d, _ = publisher(b"PONG\r\nPONG\r\n+OK\r\n", [])
    assert d._read_message(0.0) is None and bytes(d._buf) == b"PONG\r\n+OK\r\n"
    assert d._read_message(0.0, until_pong=True) == "pong"
    assert d._read_message(0.0, until_pong=True) is None and bytes(d._buf) == b""


def test_read_message_answers_ping_and_raises_the_servers_error():
    d, _ = publisher(b"PING\r\n-ERR 'Authorization Violation'\r\n", [])
    sent = []
    d._send = sent.append
    assert d._read_message(0.0) is None and sent == [b"PONG\r\n"]
    with pytest.raises(DirectError) as err:
        d._read_message(0.0)
    assert str(err.value) == "NATS: 'Authorization Violation'"


def test_read_message_returns_the_subject_and_splits_headers_from_data():
    data = secrets.token_hex(5).encode()
    hdr = b"NATS/1.0\r\nX-K: v\r\n\r\n"
    body = hdr + data
    d, _ = publisher(b"HMSG _INBOX.a.7 1 %d %d\r\n%s\r\nMSG _INBOX.a.8 1 reply.x %d\r\n%s\r\n" % (
        len(hdr), len(body), body, len(data), data), [])
    d.max_payload = 1 << 20
    assert d._read_message(0.0) == (b"_INBOX.a.7", Reply(hdr, data))
    assert d._read_message(0.0) == (b"_INBOX.a.8", Reply(b"", data))
    assert bytes(d._buf) == b""


def _fake_time(monkeypatch, now: float) -> ManualClock:
    clock = ManualClock(now)
    monkeypatch.setattr(direct, "time", SimpleNamespace(monotonic=clock))
    return clock


def test_recv_at_exactly_the_deadline_is_a_timeout(monkeypatch):
    clock = _fake_time(monkeypatch, 500.0 + secrets.randbelow(100))
    d, there = _paired()
    try:
        there.sendall(b"+OK\r\n")
        with pytest.raises(TimeoutError):
            d._recv(clock.now)
        assert d._buf == bytearray()
    finally:
        d._sock.close()
        there.close()


def test_message_sizes_at_their_bounds_are_taken_and_beyond_them_refused():
    hdr = b"NATS/1.0\r\n\r\n"
    d, _ = publisher(b"HMSG s.1 1 %d %d\r\n%s\r\n" % (len(hdr), len(hdr), hdr), [])
    d.max_payload = 100
    assert d._read_message(0.0) == (b"s.1", Reply(hdr, b""))          # headers only: hlen == total
    big = secrets.token_bytes(100 + (1 << 16))                         # exactly max_payload + 64 KiB
    d._buf = bytearray(b"MSG s.2 1 %d\r\n%s\r\n" % (len(big), big))
    assert d._read_message(0.0) == (b"s.2", Reply(b"", big))
    for line in (b"HMSG s.3 1 9 8", b"MSG s.4 1 %d" % (len(big) + 1), b"HMSG s.5 1 -1 4"):
        d._buf = bytearray(line + b"\r\n")
        with pytest.raises(DirectError) as err:
            d._read_message(0.0)
        assert str(err.value) == f"a NATS message header with impossible sizes: {line!r}"


def test_one_server_ignores_a_preference_for_another():
    a = FakeNats(_info(), answer=b'{"seq":3}')
    d = DirectPublisher((a.url,), "t-direct-one", 1.0)
    try:
        d.prefer("somewhere-else")
        assert d.request("t.s", b"x", {"X-A": "1"}, 5.0).data == b'{"seq":3}'
        assert d.server_name == a.info["server_name"] and d.connects == 1 and d._next == 0
    finally:
        d.close()
        a.close()


def test_no_server_reachable_names_every_try_and_forgets_the_preference():
    ports = []
    for _ in range(2):
        s = socket.create_server(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()                                          # nothing listens there now
    urls = tuple(f"nats://127.0.0.1:{p}" for p in ports)
    d = DirectPublisher(urls, "t-direct-none", 1.0)
    d.prefer("x")
    with pytest.raises(DirectError) as err:
        d.request("t.s", b"x", {}, 2.0)
    text = str(err.value)
    assert text.startswith("cannot open the journal's NATS connection: " + urls[0] + ": ")
    assert [text.count(u + ": ") for u in urls] == [2, 2]  # the preferred pass, then any server
    assert d._preferred is None and d._sock is None


def test_the_next_connection_starts_after_the_server_used_and_max_payload_defaults_to_1_mib():
    info = _info()
    del info["max_payload"]
    a = FakeNats(info, answer=b'{"seq":4}')
    d = DirectPublisher((a.url, "nats://127.0.0.1:1", "nats://127.0.0.1:1"), "t-direct-next", 1.0)
    try:
        assert d.request("t.s", b"x", {}, 5.0).data == b'{"seq":4}'
        assert (d._next, d.max_payload) == (1, 1 << 20)
    finally:
        d.close()
        a.close()


def _ready(monkeypatch, max_payload: int):
    clock = _fake_time(monkeypatch, 1000.0 + secrets.randbelow(100))
    d, there = _paired()
    d.max_payload, d._last_io = max_payload, clock.now
    return d, there, clock


def test_a_publish_exactly_at_max_payload_goes_out_and_one_byte_more_is_refused(monkeypatch):
    hb = b"NATS/1.0\r\nK: v\r\n\r\n"
    payload = secrets.token_bytes(20)
    d, there, clock = _ready(monkeypatch, len(hb) + len(payload))
    try:
        there.sendall(b"MSG %s.1 1 2\r\nok\r\n" % d._inbox.encode())
        clock.now += 3.0
        assert d.request("t.s", payload, {"K": "v"}, 5.0) == Reply(b"", b"ok")
        assert d._last_io == clock.now
        d.max_payload -= 1
        with pytest.raises(DirectError) as err:
            d.request("t.s", payload, {"K": "v"}, 5.0)
        assert str(err.value) == (f"a journal publish of {len(hb) + len(payload)} bytes exceeds the NATS server's "
                                  f"max_payload of {len(hb) + len(payload) - 1} bytes")
    finally:
        d._sock.close()
        there.close()


def test_after_exactly_the_idle_check_period_the_connection_is_checked_first(monkeypatch):
    d, there, clock = _ready(monkeypatch, 1 << 20)
    checked = []

    class Checked(Exception):
        pass

    def check():
        checked.append(clock.now)
        raise Checked
    d._check_open = check
    try:
        clock.now += d.idle_check_seconds - 0.5
        there.sendall(b"MSG %s.1 1 2\r\nok\r\n" % d._inbox.encode())
        assert d.request("t.s", b"p", {}, 5.0).data == b"ok" and checked == []
        clock.now = d._last_io + d.idle_check_seconds
        with pytest.raises(Checked):
            d.request("t.s", b"p", {}, 5.0)
        assert checked == [clock.now]
    finally:
        d._sock.close()
        there.close()


def test_a_send_the_server_does_not_take_in_time_is_a_connection_error():
    d, there = _paired(0.2)
    try:
        with pytest.raises(ConnectionError) as err:
            d._send(b"x" * (32 << 20))                     # nobody reads: the socket buffers fill up
        assert str(err.value) == "the NATS server did not take the journal's data in time"
    finally:
        d._sock.close()
        there.close()
