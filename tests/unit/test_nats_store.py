"""The replicated state's NATS parts, one at a time, against one real nats-server on loopback.

What docs/HA.md ("The NATS layout", "Writing: why two writers are impossible", the lease) and the NATS
protocol promise, checked against what the server itself answers: a stale writer is refused by the
server, a request the server refuses is not retried, a fence voids the old writer's unfinished entry,
the direct connection reads NATS's no-responders status, errors carry the server's own words, and the
lease is taken, deposed and waited on as its module doc says (an injected clock where time matters).

The server is the pinned nats-server (tests/natsutil.py): the test skips without it, fails under CI=true.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import nats.js.errors
import numpy as np
import pytest
from nats.js import api

from kvservice.state.nats.assets import ensure_assets, reason
from kvservice.state.nats.config import Fenced, NatsConfig, StoreError
from kvservice.state.nats.journal import NatsStore
from kvservice.state.nats.leader import KEY, Holder, Lease, LeaseConfig, LeaseLapsed
from kvservice.state.nats.link import NatsLink
from kvservice.state.stores import Entry, entry_digest

from ..natsutil import free_ports


@pytest.fixture
def link(nats1):
    """A link to a deployment name of this test's own."""
    lk = NatsLink(NatsConfig(tuple(nats1.urls), name="t" + uuid.uuid4().hex[:10], append_seconds=3.0))
    yield lk
    lk.close()


def call(lk, coro):
    return lk.call(coro, 10.0)


# ---- errors in the server's words --------------------------------------------------------------------------
def test_reason_gives_the_servers_description_and_error_code():
    """A JetStream API error as nats-py builds it from the server's JSON ({code, err_code, description})."""
    rng = np.random.default_rng(2820)
    for _ in range(5):
        err_code = int(rng.integers(10000, 10999))
        words = f"refused {int(rng.integers(1, 2**31)):x}"
        err = nats.js.errors.APIError(code=400, err_code=err_code, description=words)
        assert reason(err) == f"{words} (err_code {err_code})"
    bare = nats.js.errors.NotFoundError()                        # no description: its type and text
    assert reason(bare) == f"NotFoundError: {bare}"


def test_a_refused_stream_creation_names_the_servers_reason(link):
    """Another stream already takes the journal's subject: the server refuses the creation (400) and nobody made
    the stream meanwhile, so the StoreError quotes the server's description and error code."""
    c = link.config
    call(link, link.js.add_stream(api.StreamConfig(name=c.stream + "_squatter", subjects=[c.subject])))
    with pytest.raises(StoreError) as err:
        call(link, ensure_assets(link.js, c, "the-path", True))
    text = err.value.message
    assert text.startswith(f"the-path: creating the journal stream ({c.replicas} replicas) was refused: ")
    assert re.search(r"refused: [a-z].*overlap.* \(err_code 1\d{4}\)$", text), text



class SlowAnswers:
    """A TCP proxy to one server that holds every chunk the server sends for `delay` seconds (0: passes it on)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.delay = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self._socks += [down, up]
            held: queue.Queue = queue.Queue()
            threading.Thread(target=self._pump, args=(down, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, held), daemon=True).start()
            threading.Thread(target=self._release, args=(held, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, held: queue.Queue | None) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if held is not None:
                held.put((time.monotonic() + self.delay, data))
            elif data:
                try:
                    dst.sendall(data)
                except OSError:
                    return
            if not data:
                return

    @staticmethod
    def _release(held: queue.Queue, dst: socket.socket) -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))     # the network's latency, not a synchronisation
            if not data:
                dst.close()
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


def test_opening_a_store_gives_its_several_requests_more_than_one_requests_time(nats1):
    """Opening the journal stream and the snapshot bucket takes four JetStream requests (stream info, create, bucket
    info, create). Over a network whose every answer takes 40% of request_seconds, each request is in time; the
    opening as a whole, allowed max(10, 3 x request_seconds) (an election may be under way), succeeds too."""
    proxy = SlowAnswers(urlsplit(nats1.urls[0]).port)
    lk = NatsLink(NatsConfig((f"nats://127.0.0.1:{proxy.port}",), name="s" + uuid.uuid4().hex[:10],
                             request_seconds=3.0, append_seconds=3.0))
    try:
        proxy.delay = 1.2
        store = NatsStore(lk)
        proxy.delay = 0.0
        assert store._obs is not None
        info = call(lk, lk.js.stream_info(lk.config.stream))
        assert (info.config.name, info.config.subjects) == (lk.config.stream, [lk.config.subject])
        assert call(lk, lk.js.object_store(lk.config.snapshot_bucket)) is not None
    finally:
        lk.close()
        proxy.close()

# ---- the server fences a stale writer ------------------------------------------------------------------------
def test_a_writer_with_a_stale_view_of_the_stream_is_refused_by_the_server(link):
    """docs/HA.md: every publish carries Nats-Expected-Last-Sequence, so a writer that did not read what another
    one wrote is refused by the server itself (Fenced), and the stream keeps only the first writer's messages."""
    first = NatsStore(link)
    first.fence(1)
    first.append(Entry.make(1, "Step", b"\x01\x02", 1.5))
    stale = NatsStore(link)                       # has read nothing: its expected last sequence is 0
    with pytest.raises(Fenced):
        stale.fence(2)
    assert first.stream_last_seq() == 2           # the first writer's fence and entry, nothing of the other
    with pytest.raises(Fenced):
        stale._publish(b"x", {"Kvs-Kind": "entry"})


def test_a_publish_the_server_refuses_is_not_retried(link):
    """A 4xx JetStream answer (here: the entry is larger than the stream's max_msg_size, err 10054) is a refusal a
    retry cannot change: append raises StoreError with the server's words at once, without a retry."""
    c = link.config
    store = NatsStore(link)
    store.fence(1)
    call(link, link.js.update_stream(api.StreamConfig(
        name=c.stream, subjects=[c.subject], storage=api.StorageType.FILE, retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.NEW, duplicate_window=120.0, max_msg_size=64)))
    data = np.random.default_rng(2821).integers(1, 256, 300, dtype=np.uint8).tobytes()
    with pytest.raises(StoreError) as err:
        store.append(Entry.make(1, "Step", data, 2.0))
    assert err.value.message.startswith("NATS refused the journal entry: ")
    assert "maximum" in err.value.message
    assert store.append_retries == 0 and store.appends == 0


# ---- reading: a fence voids the old writer's unfinished entry --------------------------------------------------
def test_a_fence_voids_the_unfinished_entry_of_the_writer_before_it(link):
    """A writer died between the parts of an entry; the next writer fenced and wrote its own entry 1. A reader
    drops the old writer's parts, before and after the fence (docs/HA.md), and reads only the new entry."""
    rng = np.random.default_rng(2822)
    c = link.config
    lineage = f"{int(rng.integers(1, 2**62)):x}"
    old = rng.integers(0, 256, 40, dtype=np.uint8).tobytes()
    new = rng.integers(0, 256, 25, dtype=np.uint8).tobytes()

    def entry_headers(data, part, epoch, at):
        return {"Kvs-Kind": "entry", "Kvs-Seq": "1", "Kvs-Method": "Step", "Kvs-At": repr(at),
                "Kvs-Epoch": str(epoch), "Kvs-Part": part, "Kvs-Digest": entry_digest(1, "Step", data, at).hex()}

    msgs = [(b"", {"Kvs-Kind": "fence", "Kvs-Epoch": "1", "Kvs-Seq": "0", "Kvs-Lineage": lineage}),
            (old[:20], entry_headers(old, "0/2", 1, 3.25)),
            (b"", {"Kvs-Kind": "fence", "Kvs-Epoch": "2", "Kvs-Seq": "0", "Kvs-Lineage": lineage}),
            (old[20:], entry_headers(old, "1/2", 1, 3.25)),          # the old writer's last part, published late
            (new, entry_headers(new, "0/1", 2, 4.5))]
    NatsStore(link)                                                   # makes the stream
    for data, headers in msgs:
        call(link, link.js.publish(c.subject, data, stream=c.stream, headers=headers))
    reader = NatsStore(link, readonly=True)
    entries = list(reader.entries_after(0))
    assert [(e.seq, e.method, e.request, e.created) for e in entries] == [(1, "Step", new, 4.5)]
    assert entries[0].checksum == entry_digest(1, "Step", new, 4.5)
    assert (reader.max_epoch, reader.lineage, reader.last_stream_seq) == (2, int(lineage, 16), 5)


# ---- the link and the direct connection ----------------------------------------------------------------------
def test_a_request_that_times_out_by_itself_is_named_with_nats_words(link, nats1):
    """A NATS request inside link.call whose own deadline passes (nobody answers it) is told apart from the call's
    wait running out: the StoreError says what timed out and quotes nats-py's 'nats: timeout'."""
    sink = f"t.sink.{uuid.uuid4().hex}"
    call(link, link.nc.subscribe(sink))                    # listens, never answers
    with pytest.raises(StoreError) as err:
        link.call(link.nc.request(sink, b"?", timeout=0.2), 30.0, "asking the sink")
    text = err.value.message
    assert re.fullmatch(r"NATS timed out asking the sink after \d+\.\d\d s \(TimeoutError: nats: timeout; "
                        + re.escape(link.config.url) + r"\)", text), text


def test_connecting_to_a_closed_port_names_the_refusal():
    """Nothing listens on the port: connecting gives up after its time, naming the last error NATS reported
    (the refused TCP connection), not only that the time ran out."""
    port = free_ports(1)[0]
    with pytest.raises(StoreError) as err:
        NatsLink(NatsConfig((f"nats://127.0.0.1:{port}",), name="closed"), connect_seconds=1.0)
    text = err.value.message
    assert text.startswith(f"cannot reach NATS at nats://127.0.0.1:{port}: connecting gave up after 1 s (last: ")
    assert "ConnectionRefusedError" in text, text


def test_the_direct_connection_reads_a_no_responders_status(link):
    """NATS protocol: with no_responders on, a request to a subject nobody listens on is answered by an HMSG whose
    header block is 'NATS/1.0 503' and whose payload is empty."""
    reply = link.direct.request(f"t.nobody.{uuid.uuid4().hex}", b"hello", {"X-Test": "1"}, 5.0)
    assert reply.no_responders
    assert reply.headers.startswith(b"NATS/1.0 503") and reply.headers.endswith(b"\r\n\r\n")
    assert reply.data == b""


# ---- the leader lease ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_lease_takes_a_free_key_in_its_bucket(link):
    """docs/HA.md: the bucket KVS_N_leader (TTL = lease + longest lapse, history 1, file storage), key `leader`,
    whose value names the holder: a free key is created, and the writer's bound is taken at send + ttl - margin."""
    clock = Clock()
    cfg = LeaseConfig(ttl_seconds=3.0, renew_seconds=1.0, margin_seconds=0.2, lapse_seconds=5.0)
    lease = Lease(link, cfg, "node-a", "10.0.0.1:50051", clock=clock)
    assert lease.bucket == f"KVS_{link.config.name}_leader"
    info = call(link, link.js.stream_info(f"KV_{lease.bucket}"))          # a KV bucket is stream KV_<bucket>
    assert (info.config.max_age, info.config.max_msgs_per_subject, info.config.storage) == \
        (8.0, 1, api.StorageType.FILE)
    assert info.config.description == "kvservice leader lease"
    assert lease.try_acquire() and lease.held
    assert lease.valid_until == 1000.0 + 3.0 - 0.2
    holder = lease.current()
    assert holder == Holder("node-a", "10.0.0.1:50051", 0, lease.revision)
    lease.release()


def test_a_renewal_refused_because_another_manager_wrote_the_key_deposes_the_leader(link):
    """The lease's module doc: a renewal the server refuses (the revision moved: someone else took the key)
    deposes the leader at once, saying so."""
    lost = []
    gone = threading.Event()
    lease = Lease(link, LeaseConfig(ttl_seconds=3.0, renew_seconds=0.2, poll_seconds=0.1, margin_seconds=0.1),
                  "node-a")
    assert lease.try_acquire()
    lease.start_renewing(7, lambda why: (lost.append(why), gone.set()))
    kv = call(link, link.js.key_value(lease.bucket))
    call(link, kv.put(KEY, json.dumps({"node": "node-b", "address": "", "epoch": 8}).encode()))
    assert gone.wait(60.0), "the renewer never noticed the key was taken"
    assert lost == [lease.lost] and not lease.held
    assert lost[0].startswith("another manager holds the leader key (renewal refused")
    lease.release()


def test_wait_valid_gives_up_on_a_lapse_after_its_timeout(link):
    """wait_valid waits through a lapse for at most `timeout` seconds, then raises LeaseLapsed (nobody renews here:
    the injected clock is past the lease's bound and stays there)."""
    clock = Clock()
    lease = Lease(link, LeaseConfig(), "node-a", clock=clock)
    assert lease.try_acquire()
    lease.wait_valid(0.0)                                    # valid now: returns at once
    clock.t += 60.0                                          # far past valid_until, never renewed
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            lease.wait_valid(0.3)
        except BaseException as err:                         # handed to the test thread
            raised.append(err)
    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(30.0)                                             # a bound on a hang, not a timing assertion
    assert not t.is_alive(), "wait_valid kept waiting past its timeout"
    assert len(raised) == 1 and isinstance(raised[0], LeaseLapsed)
    lease.release()

