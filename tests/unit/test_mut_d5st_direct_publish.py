"""Two NATS journal paths without a server:

- DirectPublisher._peek_line (state/nats/direct.py): the index of the CRLF that ends the buffered protocol line,
  reading more until there is one, consuming nothing; a line that grows past 64 KiB without a CRLF is refused
  with a DirectError that says so (a server speaking something else must not grow the buffer forever).
- NatsStore._publish's answer to a JetStream API error (docs/HA.md: every publish carries the expected last
  sequence): a wrong-last-sequence error is Fenced; a 4xx refusal is a StoreError at once, without a retry;
  a 5xx error (500 server error, 503 unavailable) is retried with the same message id until it is stored.
"""

from __future__ import annotations

from types import SimpleNamespace

import nats.js.errors
import pytest

from kvservice.state.nats.direct import DirectError, DirectPublisher
from kvservice.state.nats.journal import Fenced, NatsStore, StoreError


def publisher(buf: bytes, feed: list[bytes]) -> tuple[DirectPublisher, list[float]]:
    """A DirectPublisher whose buffer holds `buf` and whose socket reads return `feed`'s chunks in turn."""
    d = DirectPublisher(("nats://127.0.0.1:1",), "t")
    d._buf = bytearray(buf)
    asked: list[float] = []

    def recv(deadline):
        asked.append(deadline)
        d._buf += feed.pop(0)
    d._recv = recv
    return d, asked


def test_peek_line_finds_the_crlf_reading_as_needed_and_consumes_nothing():
    d, asked = publisher(b"PONG\r\nMSG", [])
    assert d._peek_line(12.5) == 4 and bytes(d._buf) == b"PONG\r\nMSG" and asked == []
    d, asked = publisher(b"+OK\r\nPING\r\n", [])          # the first CRLF, not the last
    assert d._peek_line(3.0) == 3 and bytes(d._buf) == b"+OK\r\nPING\r\n" and asked == []
    d, asked = publisher(b"\r\nPING\r\n", [])             # an empty line ends at index 0
    assert d._peek_line(3.0) == 0 and asked == []
    d, asked = publisher(b"INFO {", [b'"a":1', b"}\r", b"\nPING"])
    assert d._peek_line(7.0) == len(b'INFO {"a":1}') and asked == [7.0, 7.0, 7.0]
    assert bytes(d._buf) == b'INFO {"a":1}\r\nPING'
    d, _ = publisher(b"x" * (1 << 16), [b"\r\n"])        # exactly 64 KiB buffered: still read on
    assert d._peek_line(1.0) == 1 << 16


def test_peek_line_refuses_a_line_longer_than_64_kib():
    d, asked = publisher(b"y" * ((1 << 16) + 1), [b"\r\n"])
    with pytest.raises(DirectError) as err:
        d._peek_line(1.0)
    assert err.value.message == "a NATS protocol line longer than 64 KiB"
    assert asked == [] and len(d._buf) == (1 << 16) + 1


def store_answering(errors: list[dict | None], append_seconds: float) -> tuple[NatsStore, list[dict]]:
    """A NatsStore (no server) whose publishes answer in turn with JetStream error bodies, None meaning an
    acknowledgement of the next stream sequence; returns it and the headers of every publish."""
    st = NatsStore.__new__(NatsStore)
    st.config = SimpleNamespace(append_seconds=append_seconds)
    st.last_stream_seq = 41
    st.append_retries = 0
    st._check_guard = lambda: None
    st._relearn_stream_leader = lambda: None
    st.link = SimpleNamespace(direct=SimpleNamespace(close=lambda: None))
    sent: list[dict] = []

    def once(payload, headers):
        sent.append(dict(headers))
        err = errors.pop(0)
        if err is not None:
            nats.js.errors.APIError.from_error(err)
        return st.last_stream_seq + 1, False
    st._publish_once = once
    return st, sent


@pytest.mark.parametrize("code", [500, 503])
def test_a_server_side_api_error_is_retried_with_the_same_headers_until_stored(code):
    st, sent = store_answering([{"code": code, "err_code": 10000 + code, "description": "busy"}, None], 60.0)
    st._publish(b"entry", {"Nats-Msg-Id": "m-7"})
    assert st.last_stream_seq == 42 and st.append_retries == 1
    assert sent == [{"Nats-Msg-Id": "m-7", "Nats-Expected-Last-Sequence": "41"}] * 2


@pytest.mark.parametrize("code", [500, 503])
def test_a_server_side_api_error_past_the_append_deadline_names_the_deadline_and_the_error(code):
    st, sent = store_answering([{"code": code, "err_code": 10008, "description": "no quorum"}], 0.01)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-8"})
    assert err.value.message.startswith("NATS did not store the journal entry within 0.01 s (")
    assert "no quorum" in err.value.message and len(sent) == 1 and st.append_retries == 0


@pytest.mark.parametrize("code", [400, 404, 499])
def test_a_client_side_api_error_is_refused_at_once_with_the_servers_words(code):
    st, sent = store_answering([{"code": code, "err_code": 10054, "description": "message size exceeds maximum"}],
                               60.0)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-9"})
    assert err.value.message == "NATS refused the journal entry: message size exceeds maximum"
    assert len(sent) == 1 and st.append_retries == 0 and st.last_stream_seq == 41


@pytest.mark.parametrize("err_code", [10071, 10164])
def test_a_wrong_last_sequence_is_fenced_naming_the_position(err_code):
    st, _ = store_answering([{"code": 400, "err_code": err_code, "description": "wrong last sequence: 44"}], 60.0)
    with pytest.raises(Fenced) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-10"})
    assert err.value.message == ("the journal stream moved past 41 (wrong last sequence: 44): another manager wrote "
                                 "it; this one is no longer the leader")
