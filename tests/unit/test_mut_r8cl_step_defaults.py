"""The step() defaults of both StepStream clients (kvservice/client/stream.py, the module doc and
BlockManagerClient.step's arguments): `tables=True, block_table=False`, so a plain step asks for the page tables
but not the block table (StepRequest.include_block_table false, omit_tables false) and a step(block_table=True)
asks for it. Oracle: the StepRequest proto the stream sent, parsed back from the bytes the transport was handed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from kvservice.client.codec import to_tensor
from kvservice.client.stream import AsyncStepStream, StepStream
from kvservice.v1 import block_manager_pb2 as pb

TRACKER = SimpleNamespace(seen=lambda: None, check=lambda *a: None)


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
