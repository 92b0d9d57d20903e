"""The ZeroMQ publisher's replay ROUTER, in process (inproc:// sockets, the publisher's loop turned by the test):
the wire exchange of events/zmq.py's docstring, ``(identity, b"", start as 8 bytes big-endian)`` answered with
``(identity, b"", seq, payload)`` per retained batch >= start then ``(identity, b"", -1 as 8 signed bytes, b"")``,
payloads decoded with vLLM's own structs (tests/vllm_ref.py) and compared with the tokens the test admitted."""

from __future__ import annotations

import itertools
import logging

import msgspec
import numpy as np
import pytest
import zmq

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.zmq import REFUSED, ZmqConfig, ZmqPublisher
from kvservice.manager.pools import BlockManager
from tests.vllm_ref import module

PS = 4
END = b"\xff" * 8                               # -1 as 8 signed big-endian bytes
_names = itertools.count()


def _manager() -> BlockManager:
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=64, max_seq_len=64),
                  prefix_caching=True)
    return m


def _admit(m: BlockManager, seq_id: int, tokens: np.ndarray) -> None:
    pool, lock = m.pool_and_lock("p")
    with lock:
        pool.step(admit_ids=[seq_id], admit_tokens=[len(tokens)], admit_token_ids=tokens)
        m.events.after_step(pool, [len(tokens)], True)


def _publisher(m: BlockManager, **kw: object) -> tuple[ZmqPublisher, zmq.Socket]:
    n = next(_names)
    pub = ZmqPublisher(m.events, ZmqConfig("p", f"inproc://kv-pub-m28f-{n}",
                                           replay_endpoint=f"inproc://kv-replay-m28f-{n}", **kw))
    pub._replay.setsockopt(zmq.RCVTIMEO, 3000)            # a turn never blocks the test for good
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(pub.bound_replay_endpoint)
    return pub, dealer


def _close(pub: ZmqPublisher, dealer: zmq.Socket) -> None:
    dealer.close(linger=0)
    if pub._sub is not None:
        pub._sub.close()
    pub._close_sockets()


def _ask(pub: ZmqPublisher, dealer: zmq.Socket, *frames: bytes) -> None:
    dealer.send_multipart([b"", *frames])
    assert pub._replay.poll(3000)                           # arrived: the next turn serves it
    pub._step()


def _answer(dealer: zmq.Socket) -> list[tuple[bytes, bytes]]:
    """(seq bytes, payload) of each reply up to and with the end marker."""
    out = []
    while True:
        assert dealer.poll(3000), f"no end marker after {out}"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        out.append((seq, payload))
        if seq == END:
            return out


def _admitted(m: BlockManager, n: int) -> list[list[int]]:
    """n batches, each one prompt of random tokens; the tokens of the full pages of each (what BlockStored names)."""
    rng = np.random.default_rng(2804)
    want = []
    for i in range(n):
        tokens = rng.integers(1, 30_000, int(rng.integers(2, 5)) * PS + 1)
        _admit(m, i + 1, tokens)
        want.append(tokens[:len(tokens) // PS * PS].tolist())
    return want


def _tokens(payload: bytes) -> list[int]:
    kv = module("0.33.0", "vllm.distributed.kv_events")
    (stored,) = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload).events
    assert stored.medium == "GPU" and stored.parent_block_hash is None
    return stored.token_ids


def test_a_replay_sends_every_retained_batch_from_start_then_the_end_marker():
    """From 2: batches 2 and 3 (their 8-byte big-endian sequence, vLLM's payload), then the end marker; from 0
    (vLLM's first sequence): all of them; past the head: the end marker alone. Each request is one replay
    subscription of transport "zmq-replay", closed when answered."""
    m = _manager()
    pub, dealer = _publisher(m)
    try:
        pub._step()                                             # the live subscription, from the next batch on
        want = _admitted(m, 3)
        _ask(pub, dealer, (2).to_bytes(8, "big"))
        got = _answer(dealer)
        assert [s for s, _ in got] == [(2).to_bytes(8, "big"), (3).to_bytes(8, "big"), END]
        assert [_tokens(p) for _, p in got[:-1]] == want[1:] and got[-1][1] == b""
        _ask(pub, dealer, (0).to_bytes(8, "big"))
        got = _answer(dealer)
        assert [int.from_bytes(s, "big") for s, _ in got[:-1]] == [1, 2, 3] and got[-1] == (END, b"")
        assert [_tokens(p) for _, p in got[:-1]] == want
        _ask(pub, dealer, (4).to_bytes(8, "big"))
        assert _answer(dealer) == [(END, b"")]
        assert pub.replays == 3 and pub.limiter.allowed == 3
        lg = m.events.logs["p"]
        assert lg.counters["zmq-replay"].sent == 2 + 3 and None not in lg.counters
        assert sorted(s.transport for s in lg.subscribers) == ["zmq"]      # every replay subscription closed
        pub._step()                                             # the live stream still gets its batches
        assert pub.published == 3
    finally:
        _close(pub, dealer)


def test_a_replay_is_not_held_to_the_watcher_limit():
    """Replay subscriptions are not WatchEvents watchers: with every watcher slot taken, a replay is served."""
    m = _manager()
    m.events.max_subscribers = 1
    watcher = m.events.subscribe("p", None, "grpc")
    pub, dealer = _publisher(m)
    try:
        want = _admitted(m, 2)
        _ask(pub, dealer, (1).to_bytes(8, "big"))
        got = _answer(dealer)
        assert [_tokens(p) for _, p in got[:-1]] == want and got[-1] == (END, b"")
    finally:
        watcher.close()
        _close(pub, dealer)


def test_requests_queued_together_are_all_served_in_one_turn():
    m = _manager()
    pub, dealer = _publisher(m)
    try:
        want = _admitted(m, 2)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        _ask(pub, dealer, (1).to_bytes(8, "big"))
        assert [_tokens(p) for _, p in _answer(dealer)[:-1]] == want[1:]
        assert [_tokens(p) for _, p in _answer(dealer)[:-1]] == want
        assert pub.replays == 2
    finally:
        _close(pub, dealer)


@pytest.mark.parametrize("frames", [[b"\x00" * 4], [(1).to_bytes(8, "big"), b"x"], [b"\x00" * 9], []])
def test_a_malformed_request_is_ignored_and_logged(caplog, frames):
    """Not (identity, empty, 8-byte start): no answer, nothing counted, a warning with the frame count; the next
    well-formed request is answered."""
    m = _manager()
    pub, dealer = _publisher(m)
    try:
        _admitted(m, 1)
        with caplog.at_level(logging.WARNING, logger="kvservice.events"):
            _ask(pub, dealer, *frames)
        assert not dealer.poll(50)
        assert (pub.replays, pub.limiter.allowed, pub.limiter.refused) == (0, 0, 0)
        assert [r.getMessage() for r in caplog.records if "replay request" in r.getMessage()] == [
            f"ignored a replay request of {2 + len(frames)} frames (want identity, empty, 8-byte start)"]
        _ask(pub, dealer, (1).to_bytes(8, "big"))
        assert [int.from_bytes(s, "big", signed=True) for s, _ in _answer(dealer)] == [1, -1]
    finally:
        _close(pub, dealer)


def test_a_request_past_the_rate_gets_the_end_marker_with_the_reason(caplog):
    """Rate 0, burst 2: two replays served, the third answered at once with (END, REFUSED) and logged."""
    m = _manager()
    pub, dealer = _publisher(m, replay_rate=0.0, replay_burst=2)
    try:
        _admitted(m, 1)
        for _ in range(2):
            _ask(pub, dealer, (1).to_bytes(8, "big"))
            assert len(_answer(dealer)) == 2
        with caplog.at_level(logging.WARNING, logger="kvservice.events"):
            _ask(pub, dealer, (1).to_bytes(8, "big"))
        assert _answer(dealer) == [(END, REFUSED)]
        assert (pub.replays, pub.limiter.allowed, pub.limiter.refused) == (2, 2, 1)
        assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
            "kv events of pool 'p': replay request refused (over --kv-events-replay-rate; 1 refused so far)"]
    finally:
        _close(pub, dealer)


def test_a_replay_of_a_deleted_pool_is_the_end_marker_alone():
    m = _manager()
    pub, dealer = _publisher(m)
    try:
        _admitted(m, 1)
        m.delete_pool("p", force=True)
        _ask(pub, dealer, (1).to_bytes(8, "big"))
        assert _answer(dealer) == [(END, b"")]
        assert pub.replays == 1
    finally:
        _close(pub, dealer)


def test_the_loop_thread_is_a_daemon_named_after_the_pool():
    """The publisher's thread must not keep the process alive at exit (a daemon), and is named for the pool."""
    m = _manager()
    pub, dealer = _publisher(m)
    dealer.close(linger=0)
    assert pub._thread.daemon is True and pub._thread.name == "kv-events-zmq-p"
    pub.start()
    pub.stop()
    assert not pub._thread.is_alive()


@pytest.mark.parametrize("token_ids", [True, False])
def test_a_replay_from_before_the_ring_starts_with_a_reset_of_the_whole_cache(token_ids):
    """Asked for batches the ring no longer holds, the replay answers one reset batch labelled with the head's
    sequence: AllBlocksCleared, then BlockStored naming every cached page (its tokens, or none with token_ids
    False), then the end marker."""
    m = _manager()
    m.events.ring_batches = 2
    pub, dealer = _publisher(m, token_ids=token_ids)
    try:
        want = _admitted(m, 4)
        _ask(pub, dealer, (1).to_bytes(8, "big"))
        got = _answer(dealer)
        assert [s for s, _ in got] == [(4).to_bytes(8, "big"), END] and got[-1][1] == b""
        kv = module("0.33.0", "vllm.distributed.kv_events")
        first, *stored = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(got[0][1]).events
        assert type(first).__name__ == "AllBlocksCleared" and stored
        assert {type(e).__name__ for e in stored} == {"BlockStored"}
        assert sum(len(e.block_hashes) for e in stored) == sum(len(t) // PS for t in want)
        if token_ids:
            pages = {tuple(e.token_ids[i:i + PS]) for e in stored for i in range(0, len(e.token_ids), PS)}
            assert pages == {tuple(t[i:i + PS]) for t in want for i in range(0, len(t), PS)}
        else:
            assert all(e.token_ids == [] for e in stored)
        assert m.events.logs["p"].counters["zmq-replay"].resets == 1
    finally:
        _close(pub, dealer)


def test_each_peer_has_its_own_replay_bucket():
    """Burst 1, rate 0: a peer's second request is refused, another peer's (another routing id over inproc) is
    still served."""
    m = _manager()
    pub, a = _publisher(m, replay_rate=0.0, replay_burst=1)
    b = zmq.Context.instance().socket(zmq.DEALER)
    b.setsockopt(zmq.RCVTIMEO, 3000)
    b.connect(pub.bound_replay_endpoint)
    try:
        _admitted(m, 1)
        for dealer, want in ((a, [1, -1]), (a, [-1]), (b, [1, -1])):
            _ask(pub, dealer, (1).to_bytes(8, "big"))
            assert [int.from_bytes(s, "big", signed=True) for s, _ in _answer(dealer)] == want
        assert (pub.limiter.allowed, pub.limiter.refused) == (2, 1)
    finally:
        b.close(linger=0)
        _close(pub, a)


def test_one_turn_serves_at_most_64_queued_requests():
    """REPLAYS_PER_TURN (64): with 70 requests queued, a turn answers 64 (the live stream is not starved), the
    next turn the other 6."""
    m = _manager()
    pub, dealer = _publisher(m, replay_burst=1000)
    try:
        for _ in range(69):
            dealer.send_multipart([b"", (5).to_bytes(8, "big")])           # past the head: the end marker alone
        _ask(pub, dealer, (5).to_bytes(8, "big"))
        assert pub.replays == 64
        pub._step()
        assert pub.replays == 70
        assert [_answer(dealer) for _ in range(70)] == [[(END, b"")]] * 70
        assert not dealer.poll(0)
    finally:
        _close(pub, dealer)


def test_refusals_are_logged_once_per_hundred(caplog):
    """Rate 0, burst 1: the 1st and 101st refusals are logged (with the count so far), the others are not."""
    m = _manager()
    pub, dealer = _publisher(m, replay_rate=0.0, replay_burst=1)
    try:
        with caplog.at_level(logging.WARNING, logger="kvservice.events"):
            for _ in range(102):
                dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            _ask(pub, dealer, (1).to_bytes(8, "big"))
            pub._step()
        assert (pub.replays, pub.limiter.refused) == (1, 102)
        assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
            f"kv events of pool 'p': replay request refused (over --kv-events-replay-rate; {n} refused so far)"
            for n in (1, 101)]
    finally:
        _close(pub, dealer)
