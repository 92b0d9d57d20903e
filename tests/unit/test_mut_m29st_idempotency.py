"""IdempotencyWindow (kvservice/state/idempotency.py) against a plain-Python model of its documented rules.

Rules (class and JournalConfig docstrings): ids are remembered oldest first for the last id_window ids and at most
id_window_seconds (an id older than that, by its own time, is dropped when the window is next evicted); replies are
kept while their serialized bytes fit reply_cache_bytes, the oldest dropped first, and go with their id; a retry
(same id, method and fingerprint) gets its stored reply; another method or fingerprint is REQUEST_ID_REUSED; a
known id whose reply is gone is REQUEST_ALREADY_APPLIED. capture() gives every id and the snapshot_replies most
recent replies; load() rebuilds the window from that.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument, StateError
from kvservice.state import snapshot as snap
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal_config import JournalConfig
from kvservice.v1 import block_manager_pb2 as pb


class Model:
    def __init__(self, n: int, seconds: float, cache: int) -> None:
        self.n, self.seconds, self.cache = n, seconds, cache
        self.ids: list[tuple[str, str, bytes, int, float]] = []        # oldest first
        self.replies: list[tuple[str, bytes]] = []                     # (rid, serialized), oldest first

    def remember(self, rid, method, fp, seq, at, reply: bytes | None) -> None:
        self.ids = [x for x in self.ids if x[0] != rid] + [(rid, method, fp, seq, at)]
        if reply is not None:
            self.replies = [r for r in self.replies if r[0] != rid] + [(rid, reply)]
        while self.ids and (len(self.ids) > self.n or self.ids[0][4] < at - self.seconds):
            gone = self.ids.pop(0)[0]
            self.replies = [r for r in self.replies if r[0] != gone]
        while self.replies and sum(len(r[1]) for r in self.replies) > self.cache:
            self.replies.pop(0)


def reply_of(rng) -> pb.StepReply:
    r = pb.StepReply(num_free_slots=int(rng.integers(1, 2**31)))
    r.position.seq = int(rng.integers(1, 2**40))
    r.position.incarnation = int(rng.integers(1, 1000))
    return r


def test_the_window_follows_the_model_over_random_calls():
    rng = np.random.default_rng(2936)
    for n, seconds, cache in ((5, 1e9, 1 << 20), (50, 7.0, 1 << 20), (50, 1e9, 60), (8, 5.0, 90)):
        w = IdempotencyWindow(JournalConfig(id_window=n, id_window_seconds=seconds, reply_cache_bytes=cache))
        model = Model(n, seconds, cache)
        t, seq, known = 1000.0, 0, {}
        for _ in range(300):
            t += float(rng.uniform(0, 1.5))
            if known and rng.random() < 0.4:                       # a retry or a reuse of an id seen before
                rid = list(known)[int(rng.integers(len(known)))]
                method, fp = known[rid]
                if rng.random() < 0.3:
                    fp = bytes(a ^ b for a, b in zip(fp, bytes([0] * 15 + [1]), strict=True))  # one bit
                in_window = {x[0]: x for x in model.ids}.get(rid)
                stored = dict(model.replies).get(rid)
                if in_window is None:
                    assert w.lookup(rid, method, fp) is None
                elif fp != in_window[2]:
                    with pytest.raises(InvalidArgument) as ei:
                        w.lookup(rid, method, fp)
                    assert ei.value.reason == "REQUEST_ID_REUSED"
                elif stored is None:
                    with pytest.raises(AlreadyExists) as ei:
                        w.lookup(rid, method, fp)
                    assert ei.value.reason == "REQUEST_ALREADY_APPLIED"
                else:
                    assert w.lookup(rid, method, fp).SerializeToString() == stored
                continue
            rid = f"r{int(rng.integers(1 << 40)):x}"
            method = ["Step", "CreatePool", "DeletePool"][int(rng.integers(3))]
            fp = rng.bytes(16)
            reply = reply_of(rng) if rng.random() < 0.8 else None
            seq += 1
            known[rid] = (method, fp)
            w.remember(rid, method, fp, seq, t, reply)
            model.remember(rid, method, fp, seq, t, None if reply is None else reply.SerializeToString())
            assert list(w.ids.items()) == [(x[0], x[1:]) for x in model.ids]
            assert [(k, v[0].SerializeToString(), v[1]) for k, v in w.replies.items()] == \
                [(k, b, len(b)) for k, b in model.replies]
            assert w.reply_bytes == sum(len(b) for _, b in model.replies)


def test_a_method_other_than_the_first_is_a_reuse_and_hits_are_counted():
    w = IdempotencyWindow(JournalConfig())
    r = pb.StepReply(num_free_slots=7)
    w.remember("x", "Step", b"f" * 16, 1, 10.0, r)
    with pytest.raises(InvalidArgument) as ei:
        w.lookup("x", "CreatePool", b"f" * 16)
    assert ei.value.message == ("request_id 'x' was already used by a different Step request; use a fresh id per "
                                "request")
    assert w.hits == 0
    assert w.lookup("x", "Step", b"f" * 16) == r and w.lookup("x", "Step", b"f" * 16) == r and w.hits == 2


def test_capture_and_load_round_trip_the_most_recent_replies():
    rng = np.random.default_rng(2937)
    for keep in (0, 1, 3, 50):
        w = IdempotencyWindow(JournalConfig(snapshot_replies=keep))
        rows, replies = [], []
        for k in range(12):
            rid, fp, at = f"id{k}", rng.bytes(16), 100.0 + k
            reply = reply_of(rng) if k % 4 != 1 else None
            w.remember(rid, "Step", fp, k + 1, at, reply)
            rows.append((rid, "Step", fp, k + 1, at))
            if reply is not None:
                replies.append((rid, "Step", reply))
        ids, recent = w.capture()
        assert ids == rows
        assert recent == (replies[-keep:] if keep else [])
        back = IdempotencyWindow(JournalConfig(snapshot_replies=keep))
        back.load(snap.WindowState(ids, [(rid, m, msg.SerializeToString()) for rid, m, msg in recent]))
        assert list(back.ids.items()) == [(r[0], r[1:]) for r in rows]
        assert {k: v[0] for k, v in back.replies.items()} == {rid: msg for rid, _, msg in recent}
        assert back.reply_bytes == sum(msg.ByteSize() for _, _, msg in recent)
        assert [v[1] for v in back.replies.values()] == [msg.ByteSize() for _, _, msg in recent]


@pytest.mark.parametrize(("method", "data"), [("NoSuchMethod", b""), ("Step", b"\xff\xff\xff")])
def test_a_stored_reply_that_cannot_be_read_is_a_state_error(method, data):
    w = IdempotencyWindow(JournalConfig())
    with pytest.raises(StateError) as ei:
        w.load(snap.WindowState([("q", "Step", b"d" * 16, 1, 1.0)], [("q", method, data)]))
    assert ei.value.message.startswith("snapshot: stored reply of 'q' cannot be read (")


def test_an_id_exactly_id_window_seconds_old_is_still_remembered():
    w = IdempotencyWindow(JournalConfig(id_window=100, id_window_seconds=5.0))
    w.remember("old", "Step", b"a" * 16, 1, 100.0, pb.StepReply(num_free_slots=1))
    w.remember("new", "Step", b"b" * 16, 2, 105.0, None)          # "old" is exactly 5 s old: kept
    assert list(w.ids) == ["old", "new"] and list(w.replies) == ["old"]
    w.evict(105.25)
    assert list(w.ids) == ["new"] and not w.replies and w.reply_bytes == 0
