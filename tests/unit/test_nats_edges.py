"""NATS parts the store tests do not reach, against the real nats-server of tests/unit/test_nats_store.py.

- a fence carries ``Kvs-Writer`` (the writer incarnation: the layout in kvservice/state/nats/journal.py's doc),
  the same token as the entries that writer appends after it;
- a snapshot written while entries go on purges the stream only below its own position (the same doc: "the
  stream is purged below its stream sequence"): the entries after it stay and a restart replays them;
- the journal's direct connection reconnects to its preferred server (DirectPublisher.prefer);
- a lease renewal that times out once, after a success, is retried and the lease kept (docs/HA.md);
- a read that gets nothing goes on with a new consumer and logs it (catch_up);
- the link logs a disconnect naming the server; retry_startup backs off 0.2 s doubling to 2 s (injected clock).
"""

from __future__ import annotations

import logging
import re
import threading
import uuid

import numpy as np
import pytest

from kvservice.server.ha import open_sole_writer
from kvservice.state.journal import JournalConfig
from kvservice.state.nats import config as nats_config
from kvservice.state.nats.config import StoreError
from kvservice.state.nats.direct import DirectPublisher
from kvservice.state.nats.journal import NatsConfig, NatsStore
from kvservice.state.nats.leader import Lease, LeaseConfig
from kvservice.state.tree import state_tree

from .test_journal import run, setup_pools, step_req
from .test_nats_store import call, link  # noqa: F401  (fixtures)

CONFIG = JournalConfig(sync="normal", compact_every=100_000, background_snapshots=False)


def _messages(lk, stream):
    info = call(lk, lk.js.stream_info(stream))
    return info.state.first_seq, [call(lk, lk.js.get_msg(stream, s))
                                  for s in range(info.state.first_seq, info.state.last_seq + 1)]


def test_a_fence_and_the_entries_after_it_name_the_writer(link):  # noqa: F811
    c = NatsConfig(link.config.servers, name="w" + uuid.uuid4().hex[:10])
    j = open_sole_writer(c, journal_config=CONFIG)
    setup_pools(j)
    writer = j.store.writer
    assert len(writer) == 16 and int(writer, 16) >= 0
    _, msgs = _messages(link, c.stream)
    fences = [m for m in msgs if m.headers["Kvs-Kind"] == "fence"]
    entries = [m for m in msgs if m.headers["Kvs-Kind"] == "entry"]
    assert fences and len(entries) == 4
    assert [m.headers.get("Kvs-Writer") for m in fences[-1:] + entries] == [writer] * 5
    j.close(snapshot=False)


def test_a_snapshot_written_while_entries_go_on_keeps_the_entries_after_it(link):  # noqa: F811
    c = NatsConfig(link.config.servers, name="p" + uuid.uuid4().hex[:10])
    j = open_sole_writer(c, journal_config=CONFIG)
    setup_pools(j)
    rng = np.random.default_rng(16)
    for i in range(5):
        run(j, "Step", step_req("a", admit=[i + 1], n=[int(rng.integers(1, 40))]))
    with j._lock:                                         # captured as the background snapshot thread does ...
        cap = j._capture_locked(force=True)
    at = j.seq
    for i in range(5, 9):                                 # ... and calls go on before it is written
        run(j, "Step", step_req("a", admit=[i + 1], n=[int(rng.integers(1, 40))]))
    j._write_capture(cap)
    assert j.snapshot_seq == at and j.seq == at + 4
    _, msgs = _messages(link, c.stream)
    assert sorted(int(m.headers["Kvs-Seq"]) for m in msgs if m.headers["Kvs-Kind"] == "entry") == \
        list(range(at + 1, at + 5))
    expected = state_tree(j.manager)
    j.close(snapshot=False)
    again = open_sole_writer(c, journal_config=CONFIG)
    assert again.seq == at + 4 and again.replayed_entries == 4 and state_tree(again.manager) == expected
    again.close(snapshot=False)


def test_the_direct_connection_reconnects_to_its_preferred_server(link):  # noqa: F811
    url = link.config.servers[0]
    d = DirectPublisher((url, url), "t-direct", 2.0)
    try:
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"x", {"X-Test": "1"}, 5.0).no_responders
        name = d.server_name
        assert name and d.connects == 1
        d.close()
        d.prefer(name)
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"y", {"X-Test": "2"}, 5.0).no_responders
        assert d.server_name == name and d.connects == 2
    finally:
        d.close()


class OnceTimingOut:
    """The lease's real KV bucket, but its second update times out (a renewal lost on the way); recovered: a
    fourth update was asked for, so the third renewal (after the failure) went through."""

    def __init__(self, kv) -> None:
        self.kv, self.updates, self.recovered = kv, 0, threading.Event()

    async def update(self, *a, **kw):
        self.updates += 1
        if self.updates >= 4:                  # the renewer went on past the third (counted before it sleeps)
            self.recovered.set()
        if self.updates == 2:
            raise TimeoutError("renewal lost")
        return await self.kv.update(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.kv, name)


def test_a_renewal_that_times_out_after_a_success_is_retried_and_the_lease_kept(link):  # noqa: F811
    lost = []
    lease = Lease(link, LeaseConfig(ttl_seconds=5.0, renew_seconds=0.2, poll_seconds=0.1, margin_seconds=0.1),
                  "node-a")
    assert lease.try_acquire()
    flaky = lease.kv = OnceTimingOut(lease.kv)
    lease.start_renewing(3, lost.append)
    assert flaky.recovered.wait(30.0), "the renewer stopped after a failed renewal"
    assert lease.held and not lost and lease.renew_failures == 1 and lease.renewals >= 2
    lease.release()


def test_a_disconnect_is_logged_naming_the_server(link, caplog):  # noqa: F811
    before = link.disconnects
    with caplog.at_level(logging.WARNING, logger="kvservice.nats"):
        call(link, link._on_disconnect())
    assert link.disconnects == before + 1
    got = [r.getMessage() for r in caplog.records if r.name == "kvservice.nats"]
    assert got == [f"NATS: disconnected from {link.config.url}; reconnecting"]


class FakeTime:
    """time.monotonic / time.sleep on a clock only sleep moves."""

    def __init__(self) -> None:
        self.t, self.sleeps = 500.0, []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def test_retry_startup_backs_off_doubling_from_0_2_to_2_seconds(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(nats_config, "time", clock)
    tries = []

    def attempt():
        tries.append(clock.t)
        if len(tries) < 8:
            raise StoreError("stream leader not elected yet")
        return "ok"
    assert nats_config.retry_startup("creating the stream", attempt, seconds=60.0) == "ok"
    assert clock.sleeps == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    with pytest.raises(StoreError, match="still failing after 3 s"):
        nats_config.retry_startup("creating the stream", lambda: (_ for _ in ()).throw(StoreError("no")), 3.0)


def test_a_read_that_gets_nothing_goes_on_with_a_new_consumer_and_says_so(link, caplog):  # noqa: F811
    """catch_up: a poll that delivers nothing while the stream holds more (the consumer's node restarted under
    it) is logged and the read goes on with a new consumer, reaching every entry."""
    c = NatsConfig(link.config.servers, name="r" + uuid.uuid4().hex[:10])
    j = open_sole_writer(c, journal_config=CONFIG)
    setup_pools(j)
    total = j.seq
    j.close(snapshot=False)
    lk = type(link)(c)
    try:
        reader = NatsStore(lk, readonly=True)
        real, quiet = reader.poll, []

        def poll(wait, *a, **kw):                         # the first poll: a consumer that delivers nothing
            if not quiet:
                quiet.append(wait)
                return []
            return real(wait, *a, **kw)
        reader.poll = poll
        last = reader.stream_last_seq()
        with caplog.at_level(logging.INFO, logger="kvservice.nats"):
            got = [e.seq for e in reader.entries_after(0)]
        assert got == list(range(1, total + 1)) and quiet == [0.2]
        said = [r.getMessage() for r in caplog.records if "nothing delivered" in r.getMessage()]
        assert said == [f"{reader.path}: nothing delivered for 0.2 s at message 0 of {last}; reading on with a new "
                        "consumer"]
    finally:
        lk.close()


def test_renewing_a_lease_not_held_is_refused_by_name(link):  # noqa: F811
    """start_renewing is for the leader only: a lease never acquired raises LeaseLost saying so, and starts no
    renewer (nothing is written to the key)."""
    from kvservice.state.nats.leader import LeaseLost
    lease = Lease(link, LeaseConfig(ttl_seconds=5.0, renew_seconds=0.2, poll_seconds=0.1, margin_seconds=0.1),
                  "node-b")
    with pytest.raises(LeaseLost, match=r"^start_renewing without holding the lease$"):
        lease.start_renewing(4, lambda why: None)
    assert (lease.held, lease.epoch, lease.renewals) == (False, 0, 0)


def test_a_store_names_its_server_and_stream_and_its_link_thread_does_not_hold_the_process(link):  # noqa: F811
    """JournalStore.location ("where the state lives, for messages") of a NATS store is its URL and stream; the
    link's event-loop thread is a daemon, so a process that forgets to close a link still exits."""
    store = NatsStore(link, readonly=True)
    assert store.location == store.path == f"{link.config.url} (stream {link.config.stream})"
    assert link._thread.daemon is True and link._thread.name == "nats-loop"


def test_a_stream_leader_that_cannot_be_read_is_logged_naming_the_request(link, caplog):  # noqa: F811
    """prefer_stream_leader is best effort: when the stream's info cannot be read (here: the stream was deleted
    under the store) it logs which request failed and leaves the route as it was."""
    store = NatsStore(link)
    call(link, link.js.delete_stream(link.config.stream))
    with caplog.at_level(logging.INFO, logger="kvservice.nats"):
        store.prefer_stream_leader()
    said = [r.getMessage() for r in caplog.records if "stream leader not read" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{store.path}: stream leader not read ({store.path}: reading the "
                                                 "stream's leader: ")
    assert said[0].endswith("); appends go through any server")


def test_a_read_the_loop_does_not_answer_in_time_names_the_read(link):  # noqa: F811
    """link.call's own deadline (wait + request_seconds + 1 s for a poll) names the call that ran out. The loop is
    held by a callback waiting on an Event this test sets afterwards, so the deadline passes for sure."""
    import dataclasses

    store = NatsStore(link, readonly=True)
    assert store.poll(0.0) == []                             # subscribed (an empty stream: nothing to read)
    store.config = dataclasses.replace(store.config, request_seconds=0.01)
    held = threading.Event()
    link.loop.call_soon_threadsafe(held.wait)
    try:
        with pytest.raises(StoreError, match=r"^NATS did not answer reading the journal stream within 1\.01 s "):
            store.poll(0.0)
    finally:
        held.set()


class ListingRefused:
    """The snapshot bucket of a store, whose listing fails as a cluster with no JetStream answering does."""

    def __init__(self, obs) -> None:
        self.obs = obs

    async def list(self, *a, **kw):
        import nats.errors
        raise nats.errors.NoRespondersError

    def __getattr__(self, name):
        return getattr(self.obs, name)


def test_a_snapshot_that_cannot_be_listed_is_a_store_error_naming_the_read(link):  # noqa: F811
    """load_snapshot: a NATS error while listing the snapshot bucket is a StoreError naming the store and the read
    (then its error), not a state without snapshots."""
    store = NatsStore(link, readonly=True)
    store._obs = ListingRefused(store._obs)
    with pytest.raises(StoreError, match=rf"^{re.escape(store.path)}: listing and reading the newest snapshot: "
                       r"NoRespondersError: "):
        store.load_snapshot()
