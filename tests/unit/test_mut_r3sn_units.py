"""Small NATS-side parsers checked on hand-written inputs: Holder.parse (the leader key's JSON value: node, address,
epoch, docs in kvservice/state/nats/leader.py) and NatsStore._publish_once's reading of a JetStream publish
acknowledgement ({"stream", "seq", "duplicate"} or {"error"}; anything else is a StoreError quoting at most 80
bytes of the reply)."""

from __future__ import annotations

import json
import secrets
from types import SimpleNamespace

import nats.js.errors
import pytest

from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.direct import Reply
from kvservice.state.nats.journal import NatsStore
from kvservice.state.nats.leader import Holder


def test_holder_parse_reads_every_field_and_falls_back_to_an_unknown_holder():
    """A full value gives its node, address and epoch with the revision given; missing address/epoch give ""/0;
    a value that is not the leader JSON gives Holder("?", "", 0, revision)."""
    epoch, rev = 1 + secrets.randbelow(1000), 1 + secrets.randbelow(1000)
    value = json.dumps({"node": "n-1", "address": "10.0.0.7:50051", "epoch": epoch}).encode()
    assert Holder.parse(value, rev) == Holder("n-1", "10.0.0.7:50051", epoch, rev)
    assert Holder.parse(b'{"node": "n-2"}', rev) == Holder("n-2", "", 0, rev)
    for bad in (b"not json", b'{"address": "x"}', b"[1]", b'{"node": "n", "epoch": "many"}'):
        assert Holder.parse(bad, rev) == Holder("?", "", 0, rev)


class _Direct:
    def __init__(self, reply: Reply) -> None:
        self.reply, self.sent = reply, []

    def request(self, subject, payload, headers, timeout):
        self.sent.append((subject, payload, headers, timeout))
        return self.reply


def _publish(data: bytes, headers: bytes = b""):
    config = NatsConfig(("nats://127.0.0.1:4222",), name="t" + secrets.token_hex(4), request_seconds=1.5)
    direct = _Direct(Reply(headers, data))
    stub = SimpleNamespace(config=config, link=SimpleNamespace(direct=direct))
    return NatsStore._publish_once(stub, b"payload", {"Nats-Msg-Id": "m"}), direct.sent, config


def test_publish_once_reads_the_ack_and_quotes_at_most_80_bytes_of_a_reply_it_cannot_read():
    """{"seq", "duplicate"} -> (seq, duplicate), sent to the journal subject with Nats-Expected-Stream and the
    request timeout; a non-JSON or seq-less reply -> StoreError quoting reply[:80]; an error -> its APIError;
    no responders -> NoStreamResponseError."""
    got, sent, c = _publish(b'{"stream": "S", "seq": 42, "duplicate": true}')
    assert got == (42, True)
    assert sent == [(c.subject, b"payload", {"Nats-Msg-Id": "m", "Nats-Expected-Stream": c.stream}, 1.5)]
    assert _publish(b'{"stream": "S", "seq": 7}')[0] == (7, False)
    junk = b"<" + bytes(range(0x41, 0x41 + 26)) * 4          # 105 bytes, not JSON
    with pytest.raises(StoreError) as caught:
        _publish(junk)
    assert str(caught.value) == "NATS answered a journal publish with " + repr(junk[:80])
    seqless = b'{"stream": "S", "note": "' + b"y" * 90 + b'"}'
    with pytest.raises(StoreError) as caught:
        _publish(seqless)
    assert str(caught.value) == "NATS answered a journal publish without a stream sequence: " + repr(seqless[:80])
    with pytest.raises(nats.js.errors.APIError):
        _publish(b'{"error": {"code": 503, "err_code": 10077, "description": "no leader"}}')
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        _publish(b"", headers=b"NATS/1.0 503\r\n\r\n")
