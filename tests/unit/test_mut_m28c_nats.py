"""The NATS parts against a real nats-server, checked on what the NATS client protocol and docs/HA.md document.

- DirectPublisher (kvservice/state/nats/direct.py): replies arrive as ``HMSG`` (headers) or ``MSG`` (none) and the
  reply carries exactly the responder's header block and payload; messages for other reply subjects on the inbox
  (stray or late) are skipped, also when they arrived while the connection was idle; a connection the server
  closed while idle is replaced before the publish; a URL without a host means loopback; a server that wants
  credentials is refused with the reason.
- NatsStore: ``Nats-Expected-Stream`` makes the server refuse a publish that would land in another stream; the
  snapshot object is named ``snap-<seq, 20 digits>`` and newest_snapshot_seq reads the position back;
  its remedy names docs/operations.md's import-state.
- Holder.parse reads the leader key's JSON value (node, address, epoch) and tolerates what it cannot read.
- Lease: two renewals unanswered in a row move the connection to another server, saying so; a release that
  gets no answer in time is logged and returns.
- NatsLink: connecting gives up after its default 10 s (an injected clock).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import select
import socket
import subprocess
import threading
import uuid

import nats.js.errors
import numpy as np
import pytest
from nats.js import api

from kvservice.state.nats import link as link_module
from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.direct import DirectError, DirectPublisher
from kvservice.state.nats.journal import NatsStore
from kvservice.state.nats.leader import KEY, Holder, Lease, LeaseConfig
from kvservice.state.nats.link import NatsLink

from ..natsutil import free_ports, require_nats_server
from .test_nats_store import call, link  # noqa: F401  (fixtures)


def _responder(lk, subject: str, headers: dict[str, str] | None, data: bytes):
    """A subscriber on the link's own (nats-py) connection that answers every request with data (and headers);
    flushed, so the server knows of it before another connection sends to it."""
    async def answer(msg):
        await lk.nc.publish(msg.reply, data, headers=headers)

    async def subscribe():
        sub = await lk.nc.subscribe(subject, cb=answer)
        await lk.nc.flush()
        return sub
    return call(lk, subscribe())


def test_a_reply_is_read_whole_with_or_without_headers(link):  # noqa: F811
    """NATS protocol: a reply without headers comes as ``MSG subject sid reply len`` and one with headers as
    ``HMSG ... hdr_len total_len`` whose header block is ``NATS/1.0`` CRLF, one ``Name: value`` line each, CRLF."""
    rng = np.random.default_rng(28)
    d = DirectPublisher((link.config.servers[0],), "t-direct-replies", 2.0)
    try:
        for size in (1, 700, 70_000):                       # the last spans several socket reads
            plain = rng.integers(1, 256, size, dtype=np.uint8).tobytes()
            subject = f"t.plain.{uuid.uuid4().hex}"
            _responder(link, subject, None, plain)
            got = d.request(subject, b"q", {"X-Q": "1"}, 10.0)
            assert (got.headers, got.data, got.no_responders) == (b"", plain, False)
            tagged = rng.integers(1, 256, size, dtype=np.uint8).tobytes()
            value = secrets.token_hex(6)
            subject = f"t.tagged.{uuid.uuid4().hex}"
            _responder(link, subject, {"Kvs-Test": value}, tagged)
            got = d.request(subject, b"q", {"X-Q": "2"}, 10.0)
            assert got.headers == f"NATS/1.0\r\nKvs-Test: {value}\r\n\r\n".encode()
            assert got.data == tagged and not got.no_responders
        assert d.connects == 1
    finally:
        d.close()


def test_messages_for_other_reply_subjects_are_skipped_also_when_they_came_while_idle(link):  # noqa: F811
    """Everything published to the connection's inbox is delivered to it; only the reply to this request's own
    subject is returned. Those stray messages (one plain, one with headers) arrive while the connection is idle:
    the idle check (idle_check_seconds=0: at every request) reads them first and keeps the connection."""
    d = DirectPublisher((link.config.servers[0],), "t-direct-stray", 2.0, idle_check_seconds=0.0)
    try:
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"a", {"X-A": "1"}, 5.0).no_responders
        assert d.connects == 1
        call(link, link.nc.publish(f"{d._inbox}.999", b"stray, no headers"))
        call(link, link.nc.publish(f"{d._inbox}.998", b"stray with headers", headers={"X-Stray": "1"}))
        call(link, link.nc.flush())
        assert select.select([d._sock], [], [], 10.0)[0], "the stray messages did not arrive"
        answer = secrets.token_bytes(32)
        subject = f"t.answer.{uuid.uuid4().hex}"
        _responder(link, subject, None, answer)
        got = d.request(subject, b"b", {"X-B": "2"}, 10.0)
        assert (got.headers, got.data) == (b"", answer)
        assert d.connects == 1 and d._buf == bytearray()
    finally:
        d.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_publish(link):  # noqa: F811
    d = DirectPublisher((link.config.servers[0],), "t-direct-idle", 2.0, idle_check_seconds=0.0)
    try:
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"a", {"X-A": "1"}, 5.0).no_responders
        d._sock.shutdown(socket.SHUT_RD)                   # reads now see the end of the stream, as after a close
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"b", {"X-B": "1"}, 5.0).no_responders
        assert d.connects == 2
    finally:
        d.close()


def test_a_url_without_a_host_is_loopback(link):  # noqa: F811
    port = int(link.config.servers[0].rsplit(":", 1)[1])
    d = DirectPublisher((f"nats://:{port}",), "t-direct-nohost", 2.0)
    try:
        assert d.request(f"t.nobody.{uuid.uuid4().hex}", b"a", {"X-A": "1"}, 5.0).no_responders
        assert d.connects == 1 and d.server_name
    finally:
        d.close()


def test_a_server_that_wants_credentials_is_refused_with_the_reason(tmp_path):
    """--state nats:// carries no credentials: a server started with --auth announces auth_required in its INFO."""
    binary = require_nats_server()
    port = free_ports(1)[0]
    log = open(tmp_path / "auth.log", "wb")
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "--auth", secrets.token_hex(8)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"nats://127.0.0.1:{port}"
        for _ in range(600):                               # until it listens (each try waits up to 0.05 s)
            try:
                socket.create_connection(("127.0.0.1", port), 0.05).close()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail((tmp_path / "auth.log").read_text())
                select.select([], [], [], 0.05)
        d = DirectPublisher((url,), "t-direct-auth", 2.0)
        with pytest.raises(DirectError) as err:
            d.request("t.any", b"x", {"X-A": "1"}, 5.0)
        assert err.value.message == (f"cannot open the journal's NATS connection: {url}: {url} requires TLS or "
                                     "credentials, which --state nats:// does not carry")
        assert d.connects == 0 and d._sock is None
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


class _ElsewhereConfig(NatsConfig):
    @property
    def stream(self) -> str:                               # type: ignore[override]
        return "KVS_ELSEWHERE"


def test_a_publish_that_would_land_in_another_stream_is_refused(link):  # noqa: F811
    """Every journal publish carries Nats-Expected-Stream (the store's stream): the server refuses one whose subject
    is captured by another stream (JetStream error 10060) and stores nothing."""
    store = NatsStore(link)
    before = call(link, link.js.stream_info(link.config.stream)).state.last_seq
    c = link.config
    store.config = _ElsewhereConfig(c.servers, name=c.name, append_seconds=c.append_seconds)
    assert store.config.subject == c.subject and store.config.stream != c.stream
    with pytest.raises(nats.js.errors.APIError) as err:
        store._publish_once(b"probe", {"Kvs-Kind": "probe"})
    assert err.value.err_code == 10060
    assert call(link, link.js.stream_info(c.stream)).state.last_seq == before


def test_the_remedy_names_the_import_state_command_of_the_operations_doc(link):  # noqa: F811
    store = NatsStore(link, readonly=True)
    assert store.remedy == ("restore the deployment from a backup (kvservice import-state DIR nats://... into a "
                            "fresh --nats-name; docs/operations.md)")


# ---- the leader key ------------------------------------------------------------------------------------------
def test_holder_parse_reads_the_key_value_and_defaults_what_is_missing():
    rng = np.random.default_rng(7)
    for _ in range(20):
        node, addr = secrets.token_hex(5), f"10.0.{int(rng.integers(1, 255))}.{int(rng.integers(1, 255))}:50051"
        epoch, rev = int(rng.integers(1, 1 << 40)), int(rng.integers(1, 1 << 30))
        assert Holder.parse(json.dumps({"node": node, "address": addr, "epoch": epoch}).encode(), rev) == \
            Holder(node, addr, epoch, rev)
        assert Holder.parse(json.dumps({"node": node}).encode(), rev) == Holder(node, "", 0, rev)
        assert Holder.parse(json.dumps({"node": node, "epoch": str(epoch)}).encode(), rev) == \
            Holder(node, "", epoch, rev)
        for bad in (b"", b"{", json.dumps({"address": addr}).encode(),
                    json.dumps({"node": node, "epoch": "x"}).encode(), b"[1, 2]"):
            assert Holder.parse(bad, rev) == Holder("?", "", 0, rev)


class _UpdatesTimingOut:
    """The lease's real KV bucket whose updates number 2 and 3 time out (two renewals in a row lost); recovered:
    a fifth update was asked for after both."""

    def __init__(self, kv) -> None:
        self.kv, self.updates, self.recovered = kv, 0, threading.Event()

    async def update(self, *a, **kw):
        self.updates += 1
        if self.updates >= 5:
            self.recovered.set()
        if self.updates in (2, 3):
            raise TimeoutError("renewal lost")
        return await self.kv.update(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.kv, name)


def test_two_renewals_unanswered_in_a_row_move_to_another_server_saying_so(link, caplog):  # noqa: F811
    lease = Lease(link, LeaseConfig(ttl_seconds=5.0, renew_seconds=0.2, poll_seconds=0.1, margin_seconds=0.1),
                  "node-m")
    assert lease.try_acquire()
    flaky = lease.kv = _UpdatesTimingOut(lease.kv)
    lost: list[str] = []
    with caplog.at_level(logging.WARNING, logger="kvservice.nats"):
        lease.start_renewing(2, lost.append)
        assert flaky.recovered.wait(60.0), "the renewer stopped after two failed renewals"
    netloc = link.config.servers[0].split("://", 1)[1]
    moved = [r.getMessage() for r in caplog.records if "lease renewals unanswered" in r.getMessage()]
    # (a renewal sent while the connection is being replaced may time out too: then it moves again, as it should)
    assert moved and set(moved) == {f"lease renewals unanswered through {netloc}: reconnecting to another NATS server"}
    assert lease.renew_failures >= 2 and lease.held and not lost
    lease.release()


def test_a_release_the_server_does_not_answer_in_time_is_logged_and_returns(link, caplog):  # noqa: F811
    """release waits request_seconds + 1 s for the key's deletion; here the link's loop is held until after it
    (an Event, set only by the test or, if release waited without a limit, a timer 60 s later)."""
    import dataclasses

    lease = Lease(link, LeaseConfig(ttl_seconds=7.0, renew_seconds=1.0, poll_seconds=0.1, margin_seconds=0.1),
                  "node-r")
    assert lease.try_acquire()
    link.config = dataclasses.replace(link.config, request_seconds=0.01)
    held = threading.Event()
    timer = threading.Timer(60.0, held.set)
    timer.start()
    link.loop.call_soon_threadsafe(held.wait)
    try:
        with caplog.at_level(logging.INFO, logger="kvservice.nats"):
            lease.release()
    finally:
        held.set()
        timer.cancel()
    said = [r.getMessage() for r in caplog.records if "leader key" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("could not release the leader key (NATS did not answer releasing "
                                                 "the leader key within 1.01 s ")
    assert said[0].endswith("); it lapses in 7 s") and not lease.held
    # (whether the abandoned deletion still went out once the loop was free is not said: either is correct)


class _JumpingTime:
    """time for kvservice.state.nats.link: monotonic() jumps 9.9 s at each reading (the loop's own clock is real)."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        self.t += 9.9
        return self.t


def test_connecting_gives_up_after_ten_seconds_by_default(monkeypatch):
    port = free_ports(1)[0]
    monkeypatch.setattr(link_module, "time", _JumpingTime())
    with pytest.raises(StoreError, match=re.escape(f"cannot reach NATS at nats://127.0.0.1:{port}: connecting gave "
                                                   "up after 10 s (last: ")):
        NatsLink(NatsConfig((f"nats://127.0.0.1:{port}",), name="closed"))


# ---- the stream and bucket layout (docs/HA.md, "The NATS layout") ----------------------------------------------
def _stream(lk, stream):
    info = call(lk, lk.js.stream_info(stream))
    seqs = range(info.state.first_seq, info.state.last_seq + 1)
    return info.state, [call(lk, lk.js.get_msg(stream, s)) for s in seqs]


def test_the_stream_and_the_snapshot_bucket_hold_what_the_layout_says(link):  # noqa: F811
    """Every message's headers and payload, built by hand from docs/HA.md: a fence (``fence.<epoch>.<token>``, its
    lineage as 16 hex digits, the position before it), entries in parts of at most max_part_bytes
    (``Kvs-Part`` i/n, ``<epoch>.<token>.<position>.<part>``, each expecting the stream sequence before it); then a
    snapshot: object ``snap-<seq, 20 digits>`` whose description is the JSON header (format 2, journal seq, stream
    seq, epoch, lineage, bytes, blake2b digest), the stream purged below it, older snapshots deleted; a reader loads
    it back with its positions."""
    import hashlib
    import io

    from kvservice.server.ha import open_sole_writer
    from kvservice.state.journal import JournalConfig
    from kvservice.state.stores import entry_digest

    from .test_journal import run, setup_pools, step_req

    j = open_sole_writer(link.config, journal_config=JournalConfig(sync="normal", compact_every=100_000,
                                                                     background_snapshots=False))
    store = j.store
    rng = np.random.default_rng(2828)
    try:
        state, msgs = _stream(link, link.config.stream)
        fence = msgs[-1]
        epoch, writer = store.epoch, store.writer
        assert epoch >= 1 and re.fullmatch(r"[0-9a-f]{16}", writer)
        assert fence.data in (b"", None) and {k: v for k, v in fence.headers.items()} == {
            "Kvs-Kind": "fence", "Kvs-Epoch": str(epoch), "Kvs-Seq": "0", "Kvs-Writer": writer,
            "Kvs-Lineage": f"{store.lineage:016x}", "Nats-Msg-Id": f"fence.{epoch}.{writer}",
            "Nats-Expected-Last-Sequence": str(fence.seq - 1), "Nats-Expected-Stream": link.config.stream}
        setup_pools(j)
        store.max_part_bytes = 29
        sent = []
        for i in range(4):
            req = step_req("a", admit=[i + 1], n=[int(rng.integers(1, 60))])
            run(j, "Step", req)
            sent.append(req.SerializeToString(deterministic=True))
        state, msgs = _stream(link, link.config.stream)
        tail = [m for m in msgs if m.headers["Kvs-Kind"] == "entry" and int(m.headers["Kvs-Seq"]) > j.seq - 4]
        prev = tail[0].seq - 1
        for k, data in enumerate(sent):
            seq = j.seq - 3 + k
            n = -(-len(data) // 29)
            parts = [m for m in tail if m.headers["Kvs-Seq"] == str(seq)]
            assert len(parts) == n > 1 and b"".join(m.data for m in parts) == data
            at = float(parts[0].headers["Kvs-At"])
            for i, m in enumerate(parts):
                assert m.seq == prev + 1 and len(m.data) <= 29
                assert m.headers == {
                    "Kvs-Kind": "entry", "Kvs-Seq": str(seq), "Kvs-Method": "Step", "Kvs-At": repr(at),
                    "Kvs-Epoch": str(epoch), "Kvs-Part": f"{i}/{n}", "Kvs-Writer": writer,
                    "Kvs-Digest": entry_digest(seq, "Step", data, at).hex(),
                    "Nats-Msg-Id": f"{epoch}.{writer}.{seq}.{i}", "Nats-Expected-Last-Sequence": str(prev),
                    "Nats-Expected-Stream": link.config.stream}
                prev = m.seq
        assert state.last_seq == prev

        def snapshot():
            with j._lock:
                cap = j._capture_locked(force=True)
            j._write_capture(cap)

        snapshot()
        run(j, "Step", step_req("a", admit=[40], n=[int(rng.integers(1, 60))]))
        last = call(link, link.js.stream_info(link.config.stream)).state.last_seq
        snapshot()
        at = j.seq
        assert store.newest_snapshot_seq() == at
        infos = [i for i in call(store.link, store._obs.list(ignore_deletes=True)) if not i.deleted]
        assert [i.name for i in infos] == [f"snap-{at:020d}"]
        meta = json.loads(infos[0].description)
        out = io.BytesIO()
        call(store.link, store._obs.get(infos[0].name, writeinto=out))
        blob = out.getvalue()
        assert isinstance(meta.pop("at"), float)
        assert meta == {"format": 2, "seq": at, "stream_seq": last, "epoch": epoch, "lineage": f"{store.lineage:016x}",
                        "bytes": len(blob), "digest": hashlib.blake2b(blob, digest_size=16).hexdigest()}
        state = call(link, link.js.stream_info(link.config.stream)).state
        assert (state.first_seq, state.last_seq, state.messages) == (last + 1, last, 0)
        reader = NatsStore(link, readonly=True)
        assert reader.load_snapshot() == (at, blob)
        assert (reader.seq, reader.last_stream_seq, reader.first_stream_seq, reader.max_epoch) == \
            (at, last, last + 1, epoch)
        assert reader.snapshot_where == f"bucket {link.config.snapshot_bucket}, snap-{at:020d}"
    finally:
        j.close(snapshot=False)


def test_a_stream_that_vanishes_during_a_read_is_a_store_error_naming_the_request(link):  # noqa: F811
    """catch_up: when a poll delivers nothing, the stream's first sequence is read (was it compacted away?); if the
    stream itself is gone by then, the StoreError names the store and that request, then NATS's error."""
    from kvservice.server.ha import open_sole_writer
    from kvservice.state.journal import JournalConfig

    from .test_journal import setup_pools

    j = open_sole_writer(link.config, journal_config=JournalConfig(sync="normal", compact_every=100_000,
                                                                     background_snapshots=False))
    setup_pools(j)
    j.close(snapshot=False)
    reader = NatsStore(link, readonly=True)

    def poll(wait, *a, **kw):                              # delivers nothing; meanwhile the stream is deleted
        call(link, link.js.delete_stream(link.config.stream))
        return []
    reader.poll = poll
    with pytest.raises(StoreError) as err:
        list(reader.catch_up())
    assert err.value.message.startswith(f"{reader.path}: reading the stream's first sequence: NotFoundError: ")


def test_a_request_that_times_out_by_itself_says_how_long_it_waited(link):  # noqa: F811
    """link.call: the time a StoreError reports is the time spent in the call: at least the request's own 0.2 s
    deadline, less than the call's 30 s wait (which it did not reach)."""
    sink = f"t.sink.{uuid.uuid4().hex}"
    call(link, link.nc.subscribe(sink))
    with pytest.raises(StoreError) as err:
        link.call(link.nc.request(sink, b"?", timeout=0.2), 30.0, "asking the sink")
    spent = float(re.search(r" after (\d+\.\d\d) s ", err.value.message).group(1))
    assert 0.2 <= spent < 30.0


def test_a_publish_over_the_servers_max_payload_is_refused_before_it_is_sent(link):  # noqa: F811
    """The server's INFO gives max_payload (nats-server's default: 1 MiB); headers and payload together count. One
    byte over is refused naming both figures, nothing is sent and the connection stays; exactly at it goes out."""
    d = DirectPublisher((link.config.servers[0],), "t-direct-max", 2.0)
    try:
        subject = f"t.nobody.{uuid.uuid4().hex}"
        assert d.request(subject, b"a", {"X-A": "1"}, 5.0).no_responders
        assert d.max_payload == 1 << 20
        header = len(b"NATS/1.0\r\nX-A: 1\r\n\r\n")
        fits = secrets.token_bytes(d.max_payload - header)
        with pytest.raises(DirectError) as err:
            d.request(subject, fits + b"!", {"X-A": "1"}, 5.0)
        assert err.value.message == (f"a journal publish of {(1 << 20) + 1} bytes exceeds the NATS server's "
                                     f"max_payload of {1 << 20} bytes")
        assert d.request(subject, fits, {"X-A": "1"}, 5.0).no_responders and d.connects == 1
    finally:
        d.close()


def test_when_no_server_can_be_reached_every_one_is_named_in_turn():
    ports = free_ports(2)
    urls = tuple(f"nats://127.0.0.1:{p}" for p in ports)
    d = DirectPublisher(urls, "t-direct-none", 1.0)
    with pytest.raises(DirectError) as err:
        d.request("t.any", b"x", {"X-A": "1"}, 2.0)
    text = err.value.message
    assert re.fullmatch(rf"cannot open the journal's NATS connection: {re.escape(urls[0])}: .*Connection refused.*; "
                        rf"{re.escape(urls[1])}: .*Connection refused.*", text), text
    assert d.connects == 0 and d._sock is None


def test_the_lease_bucket_and_key_are_as_the_layout_says(link):  # noqa: F811
    """docs/HA.md: bucket KVS_N_leader, TTL = lease + longest lapse (14 s by default), history 1, file storage,
    description 'kvservice leader lease'; key 'leader' holding JSON {node, address, epoch}."""
    assert LeaseConfig().bucket_ttl_seconds == 14.0
    node, address = "node-" + secrets.token_hex(3), f"10.1.2.{secrets.randbelow(250) + 1}:50051"
    lease = Lease(link, LeaseConfig(ttl_seconds=6.0, renew_seconds=0.5, poll_seconds=0.1, margin_seconds=0.1,
                                    lapse_seconds=3.5), node, address)
    assert lease.bucket == f"KVS_{link.config.name}_leader"
    cfg = call(link, link.js.stream_info(f"KV_{lease.bucket}")).config
    assert (cfg.max_age, cfg.max_msgs_per_subject, cfg.description) == (9.5, 1, "kvservice leader lease")
    assert cfg.storage == api.StorageType.FILE and cfg.num_replicas == link.config.replicas
    assert lease.try_acquire()
    entry = call(link, lease.kv.get(KEY))
    assert KEY == "leader" and json.loads(entry.value) == {"node": node, "address": address, "epoch": 0}
    assert entry.revision == lease.revision
    assert lease.current() == Holder(node, address, 0, entry.revision)
    lease.release()
    assert lease.current() is None


def test_a_store_refuses_what_its_role_or_position_does_not_allow_naming_it(link):  # noqa: F811
    """NatsStore's refusals, each by its message: a read-only store neither fences nor appends; an unfenced one
    does not append or snapshot; positions must match; a fence's epoch must be above every one seen."""
    from kvservice.contract.errors import StateError
    from kvservice.state.stores import Entry, entry_digest

    reader = NatsStore(link, readonly=True)
    with pytest.raises(StoreError, match=r"^a read-only store cannot fence$"):
        reader.fence(1)
    entry = Entry(1, "Step", b"\x01", 1.5, entry_digest(1, "Step", b"\x01", 1.5))
    with pytest.raises(StoreError, match=r"^this manager does not write the journal \(read-only or standby\)$"):
        reader.append(entry)
    store = NatsStore(link)
    with pytest.raises(StoreError, match=r"^this manager does not write the journal \(read-only or standby\)$"):
        store.append(entry)
    with pytest.raises(StoreError, match=r"^this manager does not write the journal \(read-only or standby\)$"):
        store.write_snapshot(0, None)
    assert store.begin(0) == 1 and store.incarnation == 1
    with pytest.raises(StoreError, match=r"^recovered position 3, but this store read to 0$"):
        store.begin(3)
    with pytest.raises(StateError, match=rf"^{re.escape(store.path)}: the stream holds entries up to 0, recovery "
                       r"reached 2$") as err:
        store.check_position(2)
    assert err.value.reason == "STATE_ROLLBACK"
    store.check_position(0)
    with pytest.raises(StoreError, match=r"^epoch 0 is not above the highest seen, 0$"):
        store.fence(0)
    store.fence(5)
    assert (store.epoch, store.max_epoch, store.incarnation) == (5, 5, 5)
    with pytest.raises(StoreError, match=r"^epoch 5 is not above the highest seen, 5$"):
        store.fence(5)
    with pytest.raises(StoreError, match=r"^append at journal position 2, but this store is at 0$"):
        store.append(Entry(2, "Step", b"\x01", 1.5, entry_digest(2, "Step", b"\x01", 1.5)))
    with pytest.raises(StoreError, match=rf"^{re.escape(store.path)}: no stream sequence known for journal position "
                       r"7$"):
        store.write_snapshot(7, None)
    with pytest.raises(StateError, match=r"a leader does not re-read the replicated journal"):
        store.load_snapshot()
    with pytest.raises(StoreError, match=r"^a leader does not re-read the replicated journal$"):
        store.restart_reading()
    store.append(entry)
    assert (store.seq, store.appends) == (1, 1)


# ---- reading (kvservice/state/nats/reader.py) ------------------------------------------------------------------
def _writer(link):  # noqa: F811
    from kvservice.server.ha import open_sole_writer
    from kvservice.state.journal import JournalConfig

    return open_sole_writer(link.config, journal_config=JournalConfig(sync="normal", compact_every=100_000,
                                                                        background_snapshots=False))


def test_a_reader_reassembles_every_entry_from_its_parts_and_follows_the_stream(link):  # noqa: F811
    """Entries written in parts (max_part_bytes 23) are read back whole, each as the writer's Entry (position,
    method, request bytes, time, checksum), with the fence's epoch and lineage; entries_after(k) gives those after k;
    poll then gives nothing until the writer appends, then exactly that entry."""
    from kvservice.state.stores import entry_digest

    from .test_journal import run, setup_pools, step_req

    rng = np.random.default_rng(4242)
    j = _writer(link)
    try:
        setup_pools(j)
        j.store.max_part_bytes = 23
        for i in range(5):
            run(j, "Step", step_req("a", admit=[i + 1], n=[int(rng.integers(1, 60))]))
        _, msgs = _stream(link, link.config.stream)
        expected, last_of = [], {}
        for m in msgs:
            h = m.headers
            if h["Kvs-Kind"] != "entry":
                continue
            seq = int(h["Kvs-Seq"])
            last_of[seq] = m.seq
            if h["Kvs-Part"].startswith("0/"):
                expected.append([seq, h["Kvs-Method"], b"", float(h["Kvs-At"])])
            expected[-1][2] += m.data or b""
        expected = [(s, meth, data, at, entry_digest(s, meth, data, at)) for s, meth, data, at in expected]
        assert [e[0] for e in expected] == list(range(1, j.seq + 1)) and j.seq == 9
        reader = NatsStore(link, readonly=True)
        got = [(e.seq, e.method, e.request, e.created, e.digest) for e in reader.entries_after(0)]
        assert got == expected
        assert (reader.seq, reader.last_stream_seq, reader.max_epoch, reader.lineage) == \
            (9, msgs[-1].seq, j.store.epoch, j.store.lineage)
        assert reader._stream_at == last_of and reader.pending == 0
        again = NatsStore(link, readonly=True)
        assert [e.seq for e in again.entries_after(6)] == [7, 8, 9]
        assert reader.poll(0.0) == []
        extra = step_req("b", admit=[77], n=[int(rng.integers(1, 60))])
        run(j, "Step", extra)
        (entry,) = reader.poll(10.0) or reader.poll(10.0)
        assert (entry.seq, entry.method, entry.request) == (10, "Step", extra.SerializeToString(deterministic=True))
        assert entry.digest == entry_digest(10, "Step", entry.request, entry.created) and reader.seq == 10
    finally:
        j.close(snapshot=False)


@pytest.mark.parametrize("headers, message", [
    ({"Kvs-Kind": "other"}, "stream message {n} is not a kvservice journal entry"),
    ({}, "stream message {n} is not a kvservice journal entry"),
    ({"Kvs-Kind": "entry", "Kvs-Seq": "1", "Kvs-Part": "0/1", "Kvs-Method": "Step", "Kvs-At": "1.5",
      "Kvs-Digest": "zz"}, "journal entry 1 (stream {n}) has an unreadable checksum (damaged)"),
])
def test_a_message_that_is_not_a_readable_entry_stops_the_read_naming_it(link, headers, message):  # noqa: F811
    from kvservice.contract.errors import StateError
    from kvservice.state.nats.config import Unrecoverable

    NatsStore(link)                                        # the stream
    for _ in range(2):                                     # two others' messages first: positions matter
        call(link, link.nc.publish(link.config.subject, b"x", headers={"Kvs-Kind": "fence", "Kvs-Epoch": "1"}))
    ack = call(link, link.js.publish(link.config.subject, b"\x07", headers=headers or None))
    reader = NatsStore(link, readonly=True)
    with pytest.raises(StateError if "checksum" in message else Unrecoverable) as err:
        list(reader.entries_after(0))
    assert err.value.message == f"{reader.path}: " + message.format(n=ack.seq)


# ---- the link (kvservice/state/nats/link.py) --------------------------------------------------------------------
def test_a_link_reports_the_servers_version_and_warns_only_when_it_is_not_the_tested_one(nats1, monkeypatch,
                                                                                         caplog):
    from ..natsutil import server_version

    binary = require_nats_server()
    c = NatsConfig(tuple(nats1.urls), name="v" + uuid.uuid4().hex[:10])
    with caplog.at_level(logging.WARNING, logger="kvservice.nats"):
        lk = NatsLink(c)
        lk.close()
    assert lk.server_version == server_version(binary) == link_module.NATS_SERVER_VERSION
    assert not [r for r in caplog.records if "kvservice is tested with" in r.getMessage()]
    monkeypatch.setattr(link_module, "NATS_SERVER_VERSION", "2.0.0")
    with caplog.at_level(logging.WARNING, logger="kvservice.nats"):
        lk = NatsLink(c)
        lk.close()
    said = [r.getMessage() for r in caplog.records if "kvservice is tested with" in r.getMessage()]
    assert said == [f"NATS server {lk.server_version} at {c.url}; kvservice is tested with 2.0.0 (docs/HA.md, 'One "
                    "NATS version'): run that version"]


def test_a_call_from_the_loop_thread_is_refused_and_close_is_idempotent(link):  # noqa: F811
    import asyncio

    async def inner():
        return 1

    async def from_the_loop():
        coro = inner()
        try:
            link.call(coro, 1.0)
        except RuntimeError as err:
            return str(err), coro.cr_frame is None           # closed, never to be awaited
        return None

    assert asyncio.run_coroutine_threadsafe(from_the_loop(), link.loop).result(10.0) == (
        "NatsLink.call from the loop thread would wait on itself; await instead", True)
    assert link.call(inner(), 5.0) == 1
    link.close()
    assert link.closing and link.loop.is_closed() and link.nc.is_closed and not link._thread.is_alive()
    link.close()                                           # again: nothing left to close
    assert link.loop.is_closed()


# ---- publishing (NatsStore._publish) ---------------------------------------------------------------------------
def test_a_stale_writer_is_told_the_stream_moved_in_the_servers_words(link):  # noqa: F811
    from kvservice.state.nats.config import Fenced
    from kvservice.state.stores import Entry

    first = NatsStore(link)
    first.fence(1)
    first.append(Entry.make(1, "Step", secrets.token_bytes(9), 1.5))
    stale = NatsStore(link)
    with pytest.raises(Fenced) as err:
        stale.fence(2)
    assert err.value.message == ("the journal stream moved past 0 (wrong last sequence: 2): another manager wrote "
                                 "it; this one is no longer the leader")
    assert (stale.epoch, stale.writer, stale.last_stream_seq) == (0, "", 0)


def test_a_publish_that_finds_no_stream_is_retried_under_the_guard_until_append_seconds(link):  # noqa: F811
    """No stream answers (deleted here; a cluster electing looks the same): each retry checks the guard first,
    waits 0.05 s doubling, and after append_seconds the entry is refused naming the time and the last error."""
    import dataclasses

    from kvservice.state.stores import Entry

    store = NatsStore(link)
    store.fence(1)
    guarded = []
    store.guard = lambda: guarded.append(store.append_retries)
    store.config = dataclasses.replace(store.config, request_seconds=0.2, append_seconds=0.5)
    call(link, link.js.delete_stream(link.config.stream))
    with pytest.raises(StoreError) as err:
        store.append(Entry.make(1, "Step", secrets.token_bytes(11), 2.5))
    assert err.value.message.startswith("NATS did not store the journal entry within 0.5 s (NoStreamResponseError")
    assert store.append_retries >= 2 and guarded == list(range(store.append_retries + 1))
    assert (store.seq, store.appends) == (0, 0)
