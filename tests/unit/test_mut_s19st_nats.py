"""The NATS parts against a real nats-server (the shared module-scoped ``nats1``), checked on what the NATS client
protocol documents: a DirectPublisher's CONNECT names the connection (docs/HA.md: an operator tells the
connections apart in nats-server's /connz), with its client library and version."""

from __future__ import annotations

import json
import secrets
import urllib.request
import uuid

from kvservice.state.nats.direct import DirectPublisher


def _connz(nats1) -> list[dict]:
    with urllib.request.urlopen(f"{nats1.monitor}/connz?limit=1024", timeout=10) as r:
        return json.load(r)["connections"] or []


def test_a_direct_publishers_connection_shows_its_name_library_and_version_in_connz(nats1):
    name = "t-direct-" + secrets.token_hex(6)
    d = DirectPublisher((nats1.urls[0],), name, 2.0)
    try:
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"x", {"X-A": "1"}, 5.0).no_responders
        mine = [c for c in _connz(nats1) if c.get("name") == name]
        assert len(mine) == 1, _connz(nats1)
        assert (mine[0]["lang"], mine[0]["version"]) == ("python-kvservice-direct", "1")
        assert mine[0]["subscriptions"] == 1                # its inbox, nothing else
    finally:
        d.close()
