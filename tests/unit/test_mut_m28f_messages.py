"""events/messages.py field by field: each WatchEvents message checked against the proto schema's fields and the
Tensor byte layout (little-endian, 1-D: no shape), built from hand-made random domain events; and the split of a
big batch checked against a plain-Python model of "at most MESSAGE_PAGES pages per message, never splitting an
event"."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.core.cache_events import (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
)
from kvservice.events import messages
from kvservice.events.messages import batch_to_protos, event_to_proto, proto_to_events
from kvservice.manager.event_log import LoggedBatch


def _stored(rng: np.random.Generator, pages: int, block_size: int, group: int, window: int,
            keys: tuple[tuple[str, ...], ...] | None) -> BlockStored:
    hashes = rng.integers(1, 2**63, pages, dtype=np.uint64) * np.uint64(2) + np.uint64(1)   # high bit used too
    tokens = rng.integers(1, 200_000, pages * block_size, dtype=np.int64)
    return BlockStored(group, hashes, int(rng.integers(1, 2**63)) * 2 + 1, tokens, block_size,
                       SLIDING_WINDOW if window else FULL_ATTENTION, window, keys)


def _u64(data: bytes) -> list[int]:
    return [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]


def _i64(data: bytes) -> list[int]:
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _check_stored(msg, e: BlockStored) -> None:
    assert msg.WhichOneof("event") == "block_stored"
    s = msg.block_stored
    assert _u64(s.block_hashes.data) == [int(h) for h in e.block_hashes] and list(s.block_hashes.shape) == []
    assert _i64(s.token_ids.data) == [int(t) for t in e.token_ids] and list(s.token_ids.shape) == []
    assert (s.parent_block_hash, s.block_size, s.group_idx) == (e.parent_block_hash, e.block_size, e.group)
    assert (s.kv_cache_spec_kind, s.kv_cache_spec_sliding_window) == (e.kind, e.sliding_window)
    assert [list(k.keys) for k in s.extra_keys] == [list(k) for k in (e.extra_keys or ())]


def test_each_event_becomes_its_proto_with_every_field():
    """BlockStored: hashes (u64) and tokens (i64) as little-endian bytes, parent, block size, group, the group's
    attention kind and window, one BlockExtraKeys per page; BlockRemoved: hashes and group; AllBlocksCleared: the
    empty marker. Random non-zero data, a sliding-window group and a full-attention one."""
    rng = np.random.default_rng(2028)
    swa = _stored(rng, 3, 16, 1, int(rng.integers(100, 5000)), (("lora-a", "salt-9"), ("lora-a",), ()))
    full = _stored(rng, 2, 4, 0, 0, None)
    removed = BlockRemoved(2, rng.integers(1, 2**64 - 1, 5, dtype=np.uint64))
    _check_stored(event_to_proto(swa), swa)
    assert event_to_proto(swa).block_stored.kv_cache_spec_sliding_window == swa.sliding_window > 0
    _check_stored(event_to_proto(full), full)
    r = event_to_proto(removed)
    assert r.WhichOneof("event") == "block_removed"
    assert _u64(r.block_removed.block_hashes.data) == [int(h) for h in removed.block_hashes]
    assert r.block_removed.group_idx == 2
    c = event_to_proto(AllBlocksCleared())
    assert c.WhichOneof("event") == "all_blocks_cleared"
    with pytest.raises(AssertionError, match="unknown event str"):
        event_to_proto("not an event")


def test_a_round_trip_gives_back_the_same_events():
    """proto_to_events(batch_to_protos(...)) is the identity on the events (arrays compared by value)."""
    rng = np.random.default_rng(7)
    evs = (AllBlocksCleared(), _stored(rng, 4, 8, 1, 777, (("x",), (), ("x", "s"), ("x",))),
           BlockRemoved(1, rng.integers(1, 2**64 - 1, 3, dtype=np.uint64)), _stored(rng, 1, 8, 0, 0, None))
    (msg,) = batch_to_protos(LoggedBatch(Batch(5, evs), 1.5, 0))
    back = proto_to_events(msg)
    assert [type(e) for e in back] == [type(e) for e in evs]
    for got, want in zip(back, evs, strict=True):
        if isinstance(want, BlockStored):
            assert np.array_equal(got.block_hashes, want.block_hashes)
            assert np.array_equal(got.token_ids, want.token_ids)
            assert (got.group, got.parent_block_hash, got.block_size, got.kind, got.sliding_window,
                    got.extra_keys) == (want.group, want.parent_block_hash, want.block_size, want.kind,
                                        want.sliding_window, want.extra_keys)
        elif isinstance(want, BlockRemoved):
            assert got.group == want.group and np.array_equal(got.block_hashes, want.block_hashes)


def _model_split(pages: list[int], cap: int) -> list[list[int]]:
    """Plain model: indexes of events per message; a message takes events while its pages stay <= cap (an
    event bigger than cap alone, never split); AllBlocksCleared counts 0 pages."""
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(pages):
        if out[-1] and used + n > cap:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


@pytest.mark.parametrize("reset", [True, False])
def test_a_batch_is_split_at_the_page_cap_and_every_message_carries_its_header(monkeypatch, reset):
    """Every message of a batch: its sequence, timestamp, reset flag and the reset's reason (the LoggedBatch's
    "reset_reason" encoding; "" when it has none), `more` on all but the last; events split as the model says."""
    cap = 6
    monkeypatch.setattr(messages, "MESSAGE_PAGES", cap)
    rng = np.random.default_rng(99 + reset)
    evs: list[object] = [AllBlocksCleared()] if reset else []
    for _ in range(9):
        n = int(rng.integers(1, 9))
        evs.append(_stored(rng, n, 2, int(rng.integers(0, 3)), 0, None) if rng.random() < 0.6 else
                   BlockRemoved(int(rng.integers(0, 3)), rng.integers(1, 2**63, n, dtype=np.uint64)))
    seq, ts = int(rng.integers(2, 10**9)), float(rng.uniform(1e9, 2e9))
    why = f"reason {rng.integers(1, 1000)}"
    encoded = {"reset_reason": why} if reset else {}
    msgs = batch_to_protos(LoggedBatch(Batch(seq, tuple(evs), reset=reset), ts, 0, encoded))
    pages = [0 if isinstance(e, AllBlocksCleared) else len(e.block_hashes) for e in evs]
    want = _model_split(pages, cap)
    assert len(want) > 2
    assert [len(m.events) for m in msgs] == [len(p) for p in want]
    assert [(m.sequence, m.timestamp, m.reset, m.reset_reason) for m in msgs] == \
        [(seq, ts, reset, why if reset else "")] * len(want)
    assert [m.more for m in msgs] == [True] * (len(want) - 1) + [False]
    flat = [ev for m in msgs for ev in m.events]
    for got, e in zip(flat, evs, strict=True):
        if isinstance(e, BlockStored):
            _check_stored(got, e)
        elif isinstance(e, BlockRemoved):
            assert _u64(got.block_removed.block_hashes.data) == [int(h) for h in e.block_hashes]
            assert got.block_removed.group_idx == e.group
        else:
            assert got.WhichOneof("event") == "all_blocks_cleared"


def test_an_empty_batch_is_one_message():
    (m,) = batch_to_protos(LoggedBatch(Batch(3, ()), 2.0, 0, {"reset_reason": "ahead of the log"}))
    assert (m.sequence, m.timestamp, len(m.events), m.more, m.reset, m.reset_reason) == \
        (3, 2.0, 0, False, False, "ahead of the log")


@pytest.mark.parametrize(("kind", "field"), [("block_stored", "block_hashes"), ("block_stored", "token_ids"),
                                             ("block_removed", "block_hashes")])
def test_a_malformed_array_is_refused_naming_its_field(kind, field):
    """proto_to_events on a message whose array holds 12 bytes of declared uint64 (not a whole item):
    InvalidArgument naming the field."""
    from kvservice.contract.errors import InvalidArgument
    from kvservice.v1 import block_manager_pb2 as pb
    rng = np.random.default_rng(5)
    ev = event_to_proto(_stored(rng, 2, 4, 0, 0, None) if kind == "block_stored" else
                        BlockRemoved(0, rng.integers(1, 2**63, 2, dtype=np.uint64)))
    getattr(getattr(ev, kind), field).data = b"\x01" * 12
    with pytest.raises(InvalidArgument, match=rf"\b{field}\b"):
        proto_to_events(pb.KVEventBatch(sequence=1, events=[ev]))
