"""NatsLink.close when the NATS client's own close fails: the error is logged at debug level as
"NATS close: <error>" and the link still stops its event loop (close never raises)."""

from __future__ import annotations

import logging
import secrets

import nats.errors

from kvservice.state.nats import NATS_SERVER_VERSION
from kvservice.state.nats.config import NatsConfig
from kvservice.state.nats.link import NatsLink

from .test_mut_r3sn_linklog import FakeServer


def test_a_failing_client_close_is_logged_at_debug_and_the_loop_still_stops(caplog):
    """nc.close() closes the client, then raises ConnectionClosedError -> one debug record on kvservice.nats reading
    exactly "NATS close: nats: connection closed", close() returns, and the link's loop is closed."""
    fake = FakeServer(NATS_SERVER_VERSION)
    lk = NatsLink(NatsConfig((fake.url,), name="t" + secrets.token_hex(4)), connect_seconds=5.0)
    real = lk.nc.close

    async def failing_close():
        await real()
        raise nats.errors.ConnectionClosedError

    lk.nc.close = failing_close
    caplog.set_level(logging.DEBUG, logger="kvservice.nats")
    try:
        lk.close()
        got = [r.getMessage() for r in caplog.records if r.name == "kvservice.nats" and r.levelno == logging.DEBUG]
        assert got == [f"NATS close: {nats.errors.ConnectionClosedError()}"]
        assert got == ["NATS close: nats: connection closed"]
        assert lk.loop.is_closed()
    finally:
        fake.close()
