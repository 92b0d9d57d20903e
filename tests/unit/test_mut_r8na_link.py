"""NatsLink.call names a call it is not told about "a request" (kvservice/state/nats/link.py, call's signature and
docstring: both timeout messages say which call and after how long), on a link whose nats.connect is a recorder."""

from __future__ import annotations

import asyncio
import re
import secrets

import pytest

import kvservice.state.nats.link as link_module
from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.link import NatsLink
from tests.unit.test_mut_r7nats_link import FakeNC


def test_an_unnamed_call_is_called_a_request_in_both_timeout_messages(monkeypatch):
    nc = FakeNC("2.10.22")

    async def connect(**kw):
        return nc
    monkeypatch.setattr(link_module.nats, "connect", connect)
    config = NatsConfig(("nats://127.0.0.1:1",), name="t" + secrets.token_hex(4), request_seconds=1.0,
                        append_seconds=30.0)
    lk = NatsLink(config, client_name="c", connect_seconds=5.0)
    try:
        async def times_out_itself():
            raise TimeoutError

        with pytest.raises(StoreError) as err:
            lk.call(times_out_itself(), 30.0)
        assert re.fullmatch(r"NATS timed out a request after \d+\.\d\d s \(TimeoutError; " + re.escape(config.url)
                            + r"\)", err.value.message), err.value.message
        never = asyncio.Event()
        with pytest.raises(StoreError) as err:
            lk.call(never.wait(), 0.05)
        assert err.value.message == f"NATS did not answer a request within 0.05 s ({config.url})"
    finally:
        lk.close()
