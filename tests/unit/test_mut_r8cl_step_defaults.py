"""The step() defaults of both StepStream clients (kvservice/client/stream.py, the module doc and
BlockManagerClient.step's arguments): `tables=True, block_table=False`, so a plain step asks for the page tables
but not the block table (StepRequest.include_block_table false, omit_tables false) and a step(block_table=True)
asks for it. Oracle: the StepRequest proto the stream sent, parsed back from the bytes the transport was handed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from kvservice.client.codec import ClientError, to_tensor
from kvservice.client.stream import AsyncStepStream, StepStream
from kvservice.v1 import block_manager_pb2 as pb

TRACKER = SimpleNamespace(seen=lambda: "seen@0", check=lambda *a: None)


def _reply(seq, free):
    """A StepReply to request `seq` with no tables: the extended sequence 7 at 12 tokens, `free` slots left."""
    return pb.StepReply(stream_seq=seq, num_free_slots=free, seq_ids=to_tensor(np.array([7], np.uint64)),
                        num_tokens=to_tensor(np.array([12], np.int64)),
                        new_token_indptr=to_tensor(np.array([0, 1], np.int64)))


def _client():
    return SimpleNamespace(timeout=30.0, _metadata=None, position=TRACKER)


def _sent_flags(sent):
    reqs = [pb.StepRequest.FromString(d) for d in sent]
    return [(r.include_block_table, r.omit_tables, r.stream_seq, list(r.extend_seq_ids.data) != []) for r in reqs]


def test_an_asyncio_streams_plain_step_asks_for_tables_but_not_the_block_table():
    s = AsyncStepStream(_client(), "p", 4, deltas=False, stream_id="s-d")
    sent = []

    async def roundtrip(data, seq):
        sent.append(data)
        return _reply(seq, 40 + seq)

    s._roundtrip = roundtrip

    async def run():
        a = await s.step(extend=[7, 9])
        b = await s.step(extend=[7, 9], block_table=True)
        c = await s.step(extend=[7, 9], tables=False)
        return a, b, c
    a, b, c = asyncio.run(run())
    assert (a.num_free_slots, b.num_free_slots, c.num_free_slots) == (41, 42, 43)
    assert _sent_flags(sent) == [(False, False, 1, True), (True, False, 2, True), (False, True, 3, True)]


def test_a_sync_streams_plain_step_asks_for_tables_but_not_the_block_table():
    s = StepStream(_client(), "p", page_size=4, deltas=False, stream_id="s-e")
    sent = []

    def roundtrip(data, seq):
        sent.append(data)
        return _reply(seq, 50 + seq)

    s._roundtrip = roundtrip
    try:
        got = [s.step(extend=[3]).num_free_slots, s.step(extend=[3], block_table=True).num_free_slots,
               s.step(extend=[3], tables=False).num_free_slots]
    finally:
        s.close()
    assert got == [51, 52, 53]
    assert _sent_flags(sent) == [(False, False, 1, True), (True, False, 2, True), (False, True, 3, True)]


class Flaky:
    """A stream's _roundtrip: records each (seq, request) and answers with the next scripted outcome (an error
    raised, or a reply to that seq with `free` slots)."""

    def __init__(self, outcomes):
        self.outcomes, self.sent = list(outcomes), []

    def answer(self, data, seq):
        self.sent.append((seq, pb.StepRequest.FromString(data)))
        got = self.outcomes.pop(0)
        if isinstance(got, Exception):
            raise got
        return _reply(seq, got)

    async def aanswer(self, data, seq):
        return self.answer(data, seq)


def _lost():
    return ClientError(grpc.StatusCode.UNAVAILABLE, "no reply")


def test_an_asyncio_stream_keeps_deltas_on_by_default_and_holds_an_unanswered_step_with_its_flags():
    """AsyncStepStream(client, pool, page_size): deltas on (the request asks for delta tables from the mirror's
    seq 0 and accepts tokens_added; no block table is asked of the manager, the mirror has it); an unanswered step
    stays pending with the flags it was asked with; resolve() counts every resend."""
    s = AsyncStepStream(_client(), "p", 4, stream_id="s-f")
    flaky = Flaky([_lost()])
    s._roundtrip = flaky.aanswer

    async def run():
        with pytest.raises(ClientError):
            await s.step(admit=[5], admit_tokens=[9], block_table=True)
    asyncio.run(run())
    assert s.deltas is True
    (seq, req), = flaky.sent
    assert (seq, req.stream_seq, req.delta_tables, req.delta_base, req.accept_tokens_added,
            req.include_block_table, req.omit_tables) == (1, 1, True, 0, True, False, False)
    assert (s.pending.seq, s.pending.tables, s.pending.block_table, s.pending.seen) == (1, True, True, "seen@0")


def test_an_asyncio_streams_resolve_counts_each_resend_of_the_pending_step():
    s = AsyncStepStream(_client(), "p", 4, deltas=False, stream_id="s-g")
    flaky = Flaky([_lost(), _lost(), 61])
    s._roundtrip = flaky.aanswer

    async def run():
        with pytest.raises(ClientError):
            await s.step(extend=[7], tables=False)
        with pytest.raises(ClientError):
            await s.resolve()
        assert (s.resolved, s.pending.seq) == (1, 1)
        got = await s.resolve()
        assert await s.resolve() is None
        return got
    got = asyncio.run(run())
    assert (got.num_free_slots, s.resolved, s.pending, s.seq) == (61, 2, None, 1)
    assert [seq for seq, _ in flaky.sent] == [1, 1, 1]
    assert len({r.SerializeToString() for _, r in flaky.sent}) == 1       # resent unchanged


def test_a_sync_stream_holds_an_unanswered_step_with_its_flags():
    s = StepStream(_client(), "p", page_size=4, stream_id="s-h")
    flaky = Flaky([_lost()])
    s._roundtrip = flaky.answer
    try:
        with pytest.raises(ClientError):
            s.step(admit=[5], block_table=True)
    finally:
        s.close()
    (seq, req), = flaky.sent
    assert seq == 1
    assert (req.stream_seq, req.delta_tables, req.include_block_table) == (1, True, False)
    assert (s.pending.seq, s.pending.tables, s.pending.block_table, s.pending.seen) == (1, True, True, "seen@0")
