"""The NATS parts against a real nats-server (the shared module-scoped ``nats1``), checked on what the NATS client
protocol documents: a DirectPublisher's CONNECT names the connection (docs/HA.md: an operator tells the
connections apart in nats-server's /connz), with its client library and version."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import urllib.request
import uuid

import numpy as np

from kvservice.state.nats.direct import DirectPublisher
from kvservice.state.nats.journal import NatsStore
from kvservice.state.nats.leader import Lease, LeaseConfig

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


def test_a_takeover_logs_who_did_not_renew_which_revision_for_how_long(link, caplog):  # noqa: F811
    """docs/HA.md: a standby takes the leader key once its revision stood still for a whole TTL, and says whose
    lease it took and for how long the revision had not moved (on the standby's clock, injected here)."""
    rng = np.random.default_rng(19_26)
    cfg = LeaseConfig(ttl_seconds=float(rng.uniform(3, 9)), renew_seconds=0.2, poll_seconds=0.1, margin_seconds=0.1)
    now = [float(rng.uniform(100, 1000))]
    a = Lease(link, cfg, "node-a")
    assert a.try_acquire()
    b = Lease(link, cfg, "node-b", clock=lambda: now[0])
    assert not b.try_acquire()                              # first sight of node-a's revision
    seen = b.holder
    assert seen.node == "node-a"
    stood = round(cfg.ttl_seconds + float(rng.uniform(0.01, 4)), 2)       # no .2f rounding tie
    now[0] += stood
    with caplog.at_level(logging.INFO, logger="kvservice.state.nats.leader"):
        assert b.try_acquire() and b.held
    said = [r.getMessage() for r in caplog.records if r.name == "kvservice.state.nats.leader"]
    assert said == [f"leader node-a (epoch {seen.epoch}) did not renew revision {seen.revision} for {stood:.2f} s; "
                    "taking over"]
    b.release()
