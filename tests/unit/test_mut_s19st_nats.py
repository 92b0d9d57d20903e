"""The NATS parts against a real nats-server (the shared module-scoped ``nats1``), checked on what the NATS client
protocol documents: a DirectPublisher's CONNECT names the connection (docs/HA.md: an operator tells the
connections apart in nats-server's /connz), with its client library and version."""

from __future__ import annotations

import json
import secrets
import threading
import urllib.request
import uuid

from kvservice.state.nats.direct import DirectPublisher
from kvservice.state.nats.journal import NatsStore

from .test_nats_store import link  # noqa: F401  (fixture)


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


def test_relearning_the_stream_leader_runs_one_at_a_time_and_never_holds_up_the_caller(link):  # noqa: F811
    """NatsStore._relearn_stream_leader (after a publish that got through on a retry): while a reading of the
    stream's leader is under way, another call returns at once and starts none (the Step that asked does not
    wait); once none is under way, a call reads it on a thread of its own, which frees the way when done."""
    store = NatsStore(link)
    try:
        assert store._relearning.acquire(blocking=False)          # a reading under way
        try:
            caller = threading.Thread(target=store._relearn_stream_leader, name="t-step")
            caller.start()
            caller.join(30.0)                                     # bound on a hang, not a timing
            assert not caller.is_alive(), "the caller waited for the reading under way"
            assert not [t for t in threading.enumerate() if t.name == "kvs-stream-leader"]
        finally:
            store._relearning.release()
        caller.join(30.0)
        store._relearn_stream_leader()                            # none under way: one starts
        assert store._relearning.acquire(timeout=30.0)            # and frees the way when done
        store._relearning.release()
    finally:
        store.close()
