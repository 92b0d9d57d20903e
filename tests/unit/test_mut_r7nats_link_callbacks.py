"""NatsLink's nats-py callbacks on a stand-in link (kvservice/state/nats/link.py): an error is kept as last_error
(what a failed connect reports) and logged at DEBUG; a disconnection is counted and logged as a WARNING naming the
configured URL, except while the link closes (then neither); a reconnection is logged naming the server reached, or
"?" when nats-py does not say."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from urllib.parse import urlparse

from kvservice.state.nats.link import NatsLink


def _link(closing=False, url=None):
    return SimpleNamespace(closing=closing, disconnects=3, last_error=None,
                           config=SimpleNamespace(url="nats://a:1,nats://b:2"), nc=SimpleNamespace(connected_url=url))


def _said(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvservice.nats"]


def test_an_error_is_kept_and_logged_at_debug(caplog):
    lk, err = _link(), ConnectionRefusedError("refused here")
    with caplog.at_level(logging.DEBUG, logger="kvservice.nats"):
        asyncio.run(NatsLink._on_error(lk, err))
    assert lk.last_error is err
    assert _said(caplog) == [(logging.DEBUG, "NATS: ConnectionRefusedError: refused here")]


def test_a_disconnection_is_counted_and_logged_unless_the_link_is_closing(caplog):
    lk, closing = _link(), _link(closing=True)
    with caplog.at_level(logging.DEBUG, logger="kvservice.nats"):
        asyncio.run(NatsLink._on_disconnect(closing))
        assert closing.disconnects == 3 and _said(caplog) == []
        asyncio.run(NatsLink._on_disconnect(lk))
    assert lk.disconnects == 4
    assert _said(caplog) == [(logging.WARNING, "NATS: disconnected from nats://a:1,nats://b:2; reconnecting")]


def test_a_reconnection_names_the_server_reached_or_a_question_mark(caplog):
    with caplog.at_level(logging.DEBUG, logger="kvservice.nats"):
        asyncio.run(NatsLink._on_reconnect(_link(url=urlparse("nats://10.1.2.3:4223"))))
        asyncio.run(NatsLink._on_reconnect(_link(url=None)))
    assert _said(caplog) == [(logging.WARNING, "NATS: reconnected to 10.1.2.3:4223"),
                             (logging.WARNING, "NATS: reconnected to ?")]
