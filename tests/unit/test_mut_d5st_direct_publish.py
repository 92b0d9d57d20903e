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
from tests.unit.test_nats_edges import FakeTime


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


ACK, DUP = "ack", "duplicate"


def store_answering(answers: list, append_seconds: float) -> tuple[NatsStore, list, SimpleNamespace]:
    """A NatsStore (no server) whose publishes answer in turn: a dict is a JetStream error body, an exception is
    raised, ACK / DUP acknowledge the next stream sequence (DUP: as a duplicate). Returns the store, every
    publish's (payload, headers), and counters of the direct connection's closes and leader re-learns."""
    st = NatsStore.__new__(NatsStore)
    st.config = SimpleNamespace(append_seconds=append_seconds)
    st.last_stream_seq = 41
    st.append_retries = 0
    seen = SimpleNamespace(closes=0, relearns=0, guards=0)
    st._check_guard = lambda: setattr(seen, "guards", seen.guards + 1)
    st._relearn_stream_leader = lambda: setattr(seen, "relearns", seen.relearns + 1)
    st.link = SimpleNamespace(direct=SimpleNamespace(close=lambda: setattr(seen, "closes", seen.closes + 1)))
    sent: list = []

    def once(payload, headers):
        sent.append((payload, dict(headers)))
        a = answers.pop(0)
        if isinstance(a, dict):
            nats.js.errors.APIError.from_error(a)
        if isinstance(a, BaseException):
            raise a
        return st.last_stream_seq + 1, a == DUP
    st._publish_once = once
    return st, sent, seen


def hdrs(last: int) -> dict:
    return {"Nats-Msg-Id": "m-7", "Nats-Expected-Last-Sequence": str(last)}


def test_a_first_publish_acknowledged_is_stored_without_retry_or_relearning():
    st, sent, seen = store_answering([ACK], 60.0)
    st._publish(b"entry-1", {"Nats-Msg-Id": "m-7"})
    assert st.last_stream_seq == 42 and st.append_retries == 0
    assert sent == [(b"entry-1", hdrs(41))] and (seen.closes, seen.relearns, seen.guards) == (0, 0, 0)


def test_a_first_publish_answered_as_duplicate_is_fenced():
    """docs/HA.md: a duplicate is success only for a retry (the id is this writer's own)."""
    st, _, _ = store_answering([DUP], 60.0)
    with pytest.raises(Fenced) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-7"})
    assert err.value.message.startswith("NATS answered a first publish as a duplicate of stream message 42")
    assert st.last_stream_seq == 41


@pytest.mark.parametrize("code", [500, 503])
def test_a_server_side_api_error_is_retried_with_the_same_message_until_stored(code):
    """Two 5xx answers, then the retry is acknowledged as a duplicate (the first copy got through): stored, two
    retries counted, the guard checked before each, the stream leader re-learnt once, the connection kept."""
    err = {"code": code, "err_code": 10000 + code, "description": "busy"}
    st, sent, seen = store_answering([err, dict(err), DUP], 60.0)
    st._publish(b"entry-2", {"Nats-Msg-Id": "m-7"})
    assert st.last_stream_seq == 42 and st.append_retries == 2
    assert sent == [(b"entry-2", hdrs(41))] * 3
    assert (seen.closes, seen.relearns, seen.guards) == (0, 1, 2)


@pytest.mark.parametrize("code, kind", [(500, "ServerError"), (503, "ServiceUnavailableError")])
def test_a_server_side_api_error_past_the_append_deadline_names_the_deadline_and_the_error(code, kind):
    st, sent, seen = store_answering([{"code": code, "err_code": 10008, "description": "no quorum"}], 0.01)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-8"})
    assert err.value.message == (f"NATS did not store the journal entry within 0.01 s ({kind}: nats: {kind}: "
                                 f"code={code} err_code=10008 description='no quorum')")
    assert len(sent) == 1 and st.append_retries == 0 and seen.closes == 0


def test_a_publish_timeout_closes_the_connection_and_is_retried_then_named_past_the_deadline():
    """A timeout: the connection is closed (the retry goes to the next server) and the publish retried."""
    st, sent, seen = store_answering([nats.errors.TimeoutError(), ACK], 60.0)
    st._publish(b"entry-3", {"Nats-Msg-Id": "m-7"})
    assert (st.last_stream_seq, st.append_retries, seen.closes, seen.relearns, len(sent)) == (42, 1, 1, 1, 2)
    st, sent, seen = store_answering([nats.errors.TimeoutError()], 0.01)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-8"})
    assert err.value.message == "NATS did not store the journal entry within 0.01 s (TimeoutError: nats: timeout)"
    assert seen.closes == 1


@pytest.mark.parametrize("exc", [StoreError("the connection dropped"), ConnectionResetError("reset by peer"),
                                 nats.errors.NoRespondersError()])
def test_a_lost_connection_or_no_responders_is_retried_and_named_past_the_deadline(exc):
    st, sent, seen = store_answering([exc, ACK], 60.0)
    st._publish(b"entry-4", {"Nats-Msg-Id": "m-7"})
    assert (st.last_stream_seq, st.append_retries, seen.closes, len(sent)) == (42, 1, 0, 2)
    st, sent, seen = store_answering([exc], 0.01)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-8"})
    assert err.value.message == f"NATS did not store the journal entry within 0.01 s ({type(exc).__name__}: {exc})"


@pytest.mark.parametrize("code", [400, 404, 499])
def test_a_client_side_api_error_is_refused_at_once_with_the_servers_words(code):
    st, sent, seen = store_answering([{"code": code, "err_code": 10054,
                                       "description": "message size exceeds maximum"}], 60.0)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-9"})
    assert err.value.message == "NATS refused the journal entry: message size exceeds maximum"
    assert len(sent) == 1 and st.append_retries == 0 and st.last_stream_seq == 41 and seen.guards == 0


@pytest.mark.parametrize("err_code", [10071, 10164])
def test_a_wrong_last_sequence_is_fenced_naming_the_position(err_code):
    st, _, _ = store_answering([{"code": 400, "err_code": err_code, "description": "wrong last sequence: 44"}], 60.0)
    with pytest.raises(Fenced) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-10"})
    assert err.value.message == ("the journal stream moved past 41 (wrong last sequence: 44): another manager wrote "
                                 "it; this one is no longer the leader")


def test_retries_wait_50_ms_doubling_to_at_most_half_a_second(monkeypatch):
    """docs/HA.md's retry rule: 0.05 s, doubling, capped at 0.5 s (a standby's election takes seconds; a cap keeps
    the retry within half a second of the new leader)."""
    from kvservice.state.nats import journal

    clock = FakeTime()
    monkeypatch.setattr(journal, "time", clock)
    st, sent, seen = store_answering([nats.errors.TimeoutError()] * 7 + [ACK], 60.0)
    st._publish(b"entry-5", {"Nats-Msg-Id": "m-11"})
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5])
    assert (st.append_retries, seen.guards, len(sent), st.last_stream_seq) == (7, 7, 8, 42)


def test_the_last_retry_is_the_one_whose_wait_would_reach_the_append_deadline(monkeypatch):
    """append_seconds 1.0: waits 0.05+0.1+0.2+0.4 reach 0.75 s; the next wait (0.5 s) would pass the deadline, so
    the entry is refused then, after four retries, without sleeping again."""
    from kvservice.state.nats import journal

    clock = FakeTime()
    monkeypatch.setattr(journal, "time", clock)
    st, sent, _ = store_answering([nats.errors.TimeoutError()] * 9, 1.0)
    with pytest.raises(StoreError) as err:
        st._publish(b"entry", {"Nats-Msg-Id": "m-12"})
    assert err.value.message == "NATS did not store the journal entry within 1 s (TimeoutError: nats: timeout)"
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4]) and st.append_retries == 4 and len(sent) == 5


def test_a_failed_read_of_the_streams_last_sequence_names_the_store_and_the_call():
    st = NatsStore.__new__(NatsStore)
    st.path = "nats://n1:4222/KVJOURNAL"
    st.config = SimpleNamespace(request_seconds=2.5)
    asked = []

    def call(coro, timeout, what):
        coro.close()
        asked.append((timeout, what))
        raise nats.errors.TimeoutError
    st.link = SimpleNamespace(call=call)
    with pytest.raises(StoreError) as err:
        st.stream_last_seq()
    assert err.value.message == "nats://n1:4222/KVJOURNAL: reading the stream's last sequence: TimeoutError: " \
                                "nats: timeout"
    assert asked == [(3.5, "reading the stream's last sequence")]
