"""The ZeroMQ publisher of one pool, in process (inproc:// sockets, no thread started: each turn of its loop is
called by the test), and configure_events applying --kv-events-* settings to a manager's event hub.

The payloads are decoded by vLLM's own structs (tests/vllm_ref.py); the sockets over tcp:// and the flags are
tests/integration/test_kv_events_access.py and tests/unit/test_kv_event_flags.py."""

from __future__ import annotations

import itertools
import logging

import msgspec
import numpy as np
import pytest
import zmq

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.publish import configure_events
from kvservice.events.zmq import ZmqConfig, ZmqPublisher
from kvservice.manager.event_log import EventsConfig
from kvservice.manager.pools import BlockManager
from tests.vllm_ref import module

PS = 4
_names = itertools.count()


def _manager(name: str = "p") -> BlockManager:
    m = BlockManager()
    m.create_pool(name, CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=32, max_seq_len=64),
                  prefix_caching=True)
    return m


def _admit(m: BlockManager, seq_id: int, tokens: np.ndarray, name: str = "p") -> None:
    pool, lock = m.pool_and_lock(name)
    with lock:
        pool.step(admit_ids=[seq_id], admit_tokens=[len(tokens)], admit_token_ids=tokens)
        m.events.after_step(pool, [len(tokens)], True)


def _config(**kw: object) -> ZmqConfig:
    n = next(_names)
    return ZmqConfig("p", f"inproc://kv-pub-test-{n}", **kw)      # inproc: bound (vLLM's rule), same process


def _sub(pub: ZmqPublisher) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(pub.bound_endpoint)
    return s


def _close(pub: ZmqPublisher) -> None:
    """ZmqPublisher.stop without its thread (never started here): the subscription and the sockets."""
    if pub._sub is not None:
        pub._sub.close()
    pub._close_sockets()


def test_each_turn_publishes_the_committed_batches_and_a_deleted_pool_is_waited_for():
    """A turn subscribes (from the next batch on), then sends each committed batch as (topic, 8-byte big-endian
    seq, payload) and counts it; an empty turn sends nothing; the pool's deletion ends the subscription and the
    next turn waits for a new pool, whose batches are then published."""
    m = _manager()
    pub = ZmqPublisher(m.events, _config(topic="kv@{pool}"))
    sub = _sub(pub)
    try:
        pub._step()                                             # subscribes; nothing committed yet
        assert pub._sub is not None and pub.published == 0
        tokens = np.random.default_rng(9).integers(1, 30_000, 3 * PS + 1)
        _admit(m, 1, tokens)
        pub._step()
        assert pub.published == 1
        assert sub.poll(10_000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@p" and seq == (1).to_bytes(8, "big")
        kv = module("0.33.0", "vllm.distributed.kv_events")
        batch = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
        (stored,) = batch.events
        assert stored.token_ids == tokens[:3 * PS].tolist() and stored.parent_block_hash is None
        pub._step()                                             # nothing new
        assert pub.published == 1 and not sub.poll(0)
        m.delete_pool("p", force=True)
        pub._step()                                             # reads the AllBlocksCleared batch
        assert pub.published == 2
        pub._step()                                             # the log is closed and read: unsubscribed
        assert pub._sub is None
        m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=32, max_seq_len=64),
                      prefix_caching=True)
        pub._step()                                             # the new pool, from its next batch
        _admit(m, 1, tokens)
        pub._step()
        assert pub.published == 3
    finally:
        sub.close(linger=0)
        _close(pub)


def test_a_failing_turn_is_logged_with_the_pool_and_the_loop_goes_on(caplog):
    """_run keeps publishing after an exception: it logs it (with the traceback) naming the pool, then retries."""
    m = _manager()
    pub = ZmqPublisher(m.events, _config())
    turns = []

    def broken_turn() -> None:
        turns.append(1)
        if len(turns) == 2:
            pub._stop.set()                                     # the second turn is the last: stop the loop
        raise RuntimeError("a broken batch")

    pub._step = broken_turn
    try:
        with caplog.at_level(logging.ERROR, logger="kvservice.events"):
            pub._run()
        assert len(turns) == 2
        # (only this publisher's records: in a whole run, threads of earlier tests may log at ERROR meanwhile)
        msgs = [(r.levelno, r.getMessage(), r.exc_info[0] if r.exc_info else None) for r in caplog.records
                if r.getMessage().startswith("kv events publisher of pool")]
        assert msgs == [(logging.ERROR, "kv events publisher of pool 'p' failed; retrying", RuntimeError)] * 2
    finally:
        _close(pub)


@pytest.mark.parametrize("token_ids", [True, False])
def test_the_sockets_are_logged_with_their_access(caplog, token_ids):
    """The start-up lines name what each socket is bound to and who may read it, as the operator configured."""
    cfg = _config(replay_endpoint=f"inproc://kv-replay-test-{next(_names)}", token_ids=token_ids,
                  replay_rate=7.5, replay_burst=13, topic="t")
    with caplog.at_level(logging.INFO, logger="kvservice.events"):
        pub = ZmqPublisher(_manager().events, cfg)
    try:
        access = "plaintext" if token_ids else "plaintext, hashes only (no token ids)"
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv events of pool")] == [
            f"kv events of pool 'p' (vllm-0.33): PUB bound to {cfg.endpoint}, topic 't', {access}",
            f"kv events of pool 'p': replay ROUTER bound to {cfg.replay_endpoint} ({access}; 7.5 requests/s per "
            "peer, bursts of 13)"]
    finally:
        _close(pub)


@pytest.mark.parametrize(("watchers", "per_tenant", "cap"), [(6, 0, 3), (7, 0, 3), (1, 0, 1), (8, 2, 2)])
def test_configure_events_applies_the_watcher_limits(watchers, per_tenant, cap):
    """--kv-events-max-watchers-per-tenant, 0 = half of --kv-events-max-watchers, at least 1 (EventsConfig):
    after configure_events a named tenant gets exactly `cap` streams, and the ring bounds are the config's."""
    m = _manager()
    started = configure_events(m, EventsConfig(ring_batches=7, ring_bytes=4096, max_watchers=watchers,
                                               max_watchers_per_tenant=per_tenant))
    assert started == [] and m.events.deferred
    subs = [m.events.subscribe("p", None, "grpc", tenant="alice") for _ in range(cap)]
    limit = f"its limit per tenant \\(--kv-events-max-watchers-per-tenant {cap}\\)"
    with pytest.raises(ResourceExhausted, match=limit):
        m.events.subscribe("p", None, "grpc", tenant="alice")
    if cap < watchers:
        subs.append(m.events.subscribe("p", None, "grpc", tenant="bob"))   # another tenant is not held to it
    for s in subs:
        s.close()
    assert (m.events.ring_batches, m.events.ring_bytes, m.events.max_subscribers) == (7, 4096, watchers)


def test_configure_events_starts_one_publisher_per_zmq_config_and_stops_them_on_a_failure():
    """Each EventsConfig.zmq entry becomes a started publisher bound to that entry's endpoint; when a later one
    cannot start (its endpoint already bound), the error reaches the caller, naming the pool and the endpoint."""
    m = _manager()
    m.create_pool("q", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=32, max_seq_len=64),
                  prefix_caching=True)
    a = _config(topic="kv@{pool}")
    b = ZmqConfig("q", f"inproc://kv-pub-test-{next(_names)}")
    started = configure_events(m, EventsConfig(zmq=(a, b)))
    try:
        assert [(p.config.pool, p.bound_endpoint, p.topic) for p in started] == [
            ("p", a.endpoint, b"kv@p"), ("q", b.endpoint, b"")]
    finally:
        for p in started:
            p.stop()
    m2 = _manager()
    first = _config()
    blocker = zmq.Context.instance().socket(zmq.PUB)
    clash = ZmqConfig("p", f"inproc://kv-pub-test-{next(_names)}")
    blocker.bind(clash.endpoint)
    try:
        with pytest.raises(OSError, match=rf"pool 'p': cannot open {clash.endpoint} / -: Address already in use"):
            configure_events(m2, EventsConfig(zmq=(first, clash)))
    finally:
        blocker.close()


def test_configure_events_starts_a_publisher_on_the_managers_own_hub():
    """--kv-events-zmq POOL=ENDPOINT: configure_events starts one publisher per entry, reading this manager's hub:
    a prompt admitted (and made durable: the transaction) reaches a subscriber of the bound endpoint, decoded by
    vLLM's own structs as a BlockStored of the prompt's full pages."""
    m = _manager()
    (pub,) = configure_events(m, EventsConfig(zmq=(_config(),)))
    s = _sub(pub)
    rng = np.random.default_rng(41)
    try:
        got, sent = None, []
        for seq_id in range(1, 60):                     # a SUB may miss what came before it joined: admit again
            tokens = rng.integers(1, 30_000, 3 * PS + 1).astype(np.int64)
            sent.append(tokens[:3 * PS].tolist())
            with m.events.transaction():
                _admit(m, seq_id, tokens)
            if s.poll(1000):
                got = s.recv_multipart()
                break
        assert got is not None
        _topic, _seq, payload = got
        kv = module("0.33.0", "vllm.distributed.kv_events")
        (stored,) = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload).events
        assert stored.token_ids in sent
        assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
    finally:
        s.close()
        pub.stop()
