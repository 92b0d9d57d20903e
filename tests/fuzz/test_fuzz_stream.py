"""Hostile input on StepStream, over gRPC, against an in-process manager with a durable journal.

Each example sends a few requests on one long-lived stream: valid steps, mutated ones, arbitrary
ones and undecodable bytes, with stream_seq mostly in order but sometimes 0, repeated or skipping
ahead, delta_tables on or off, delta_base right or wrong, and unary Steps of another client mixed
in. Every reply must be OK or a caller-mistake status carried in the reply (never INTERNAL), the
stream must stay open, docs/DESIGN.md's invariants must hold, and every incremental reply applied to a
mirror must give exactly the pool's own tables of that batch.
"""

import queue

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.state.journal import Journal
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from .support import COUNTS, fuzz_settings
from .test_fuzz_manager import (
    FIXED,
    MUTATIONS,
    NAMESPACE_NUMBERED,
    STEP_FIELDS,
    first_difference,
    healthy,
    mgr,
    mutate,
    prefix_view,
    random_steps,
    valid_step,
)

pytestmark = pytest.mark.integration
__all__ = ["mgr"]                 # the manager fixture of the manager fuzz suite (a fresh one for this module)
CALLER = {0, 3, 5, 6, 8, 9}       # google.rpc codes: OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
                                  # RESOURCE_EXHAUSTED, FAILED_PRECONDITION


class Stream:
    """One raw StepStream call and, per pool, the mirror of what this client was sent."""

    def __init__(self, m, stream_id: str) -> None:
        self.q = queue.SimpleQueue()
        method = m.channel.stream_stream("/kvservice.v1.BlockManager/StepStream", request_serializer=None,
                                         response_deserializer=pb.StepReply.FromString)
        self.call = method(iter(self.q.get, None), metadata=((STREAM_ID_KEY, stream_id),))
        self.seq = 0
        self.mirrors: dict[str, PageTableMirror] = {}

    def send(self, data: bytes) -> pb.StepReply:
        self.q.put(data)
        return next(self.call)


@pytest.fixture(scope="module")
def stream(mgr):
    s = Stream(mgr, "fuzz-stream")
    yield s
    s.q.put(None)


def reference_tables(m, pool: str, seq_ids: np.ndarray):
    with m.running.manager.locked(pool) as p:
        return p.tables_for(seq_ids)


@fuzz_settings(150)
@given(st.lists(st.tuples(st.sampled_from(["valid", "valid", "valid", "mutated", "random", "bytes", "foreign"]),
                          st.integers(0, 2**32 - 1), st.sampled_from(FIXED), st.sampled_from(MUTATIONS),
                          st.sampled_from(STEP_FIELDS), st.sampled_from(["next", "next", "next", "zero", "again",
                                                                         "skip"]),
                          st.sampled_from([True, True, True, False]), st.sampled_from(["mirror", "mirror", "mirror",
                                                                                       "zero", "wrong"]),
                          random_steps()),
                min_size=1, max_size=6))
def test_step_stream(mgr, stream, ops):
    for mode, seed, pool, kind, field, order, delta, base, random_request in ops:
        rng = np.random.default_rng(seed)
        if mode == "bytes":
            reply = stream.send(rng.bytes(int(rng.integers(1, 40))))
            COUNTS[("BlockManager", "StepStream (bytes)")][f"code {reply.error.code}"] += 1
            assert reply.error.code in CALLER
            continue
        request = random_request if mode == "random" else valid_step(rng, mgr, pool, "")
        if mode == "mutated":
            mutate(rng, request, kind, field)
        if mode == "foreign":             # another client's unary Step on the same pools
            try:
                mgr.stub.Step(request, timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.INTERNAL
            continue
        request.request_id = ""
        seq = {"next": stream.seq + 1, "zero": 0, "again": max(stream.seq, 1), "skip": stream.seq + 3}[order]
        mirror = stream.mirrors.setdefault(request.pool, PageTableMirror(4 if request.pool == "fzp" else 16))
        request.stream_seq = seq
        if delta and mode == "valid":     # a scheduler asking for deltas sends neither flag
            request.omit_tables = request.include_block_table = False
        request.delta_tables = delta and not (request.omit_tables or request.include_block_table)
        request.delta_base = {"mirror": mirror.seq, "zero": 0, "wrong": mirror.seq + 7}[base]
        reply = stream.send(request.SerializeToString())
        code = reply.error.code if reply.HasField("error") else 0
        COUNTS[("BlockManager", "StepStream")][f"code {code}"] += 1
        assert code in CALLER, (code, reply.error.message)
        assert code == 0 or reply.error.message
        if order == "next" or (order == "skip" and code == 0):
            stream.seq = max(stream.seq, seq)
        answered = stream.__dict__.setdefault("answered", set())
        if code or (order == "again" and seq in answered):
            continue                      # a refused request, or an earlier reply resent (journal)
        # An "again" whose first try was refused was never journaled: the server runs it now, as new.
        answered.add(seq)
        assert not (reply.HasField("delta") and base != "mirror"), "a delta relative to a base the client lacks"
        COUNTS[("BlockManager", "StepStream")]["applied " + ("delta" if reply.HasField("delta") else "full")] += 1
        try:
            mirror.apply(reply)
        except MirrorError as err:
            raise AssertionError(f"a reply did not apply to the mirror that asked for it: {err}") from None
        if mirror.seq and len(mirror.seq_ids):
            for st_ref in reference_tables(mgr, request.pool, mirror.seq_ids):
                t = mirror.page_table(st_ref.space.id)
                assert np.array_equal(t.indptr, st_ref.table.indptr) and np.array_equal(t.indices, st_ref.table.indices)
                assert np.array_equal(t.last_page_len, st_ref.table.last_page_len)
    healthy(mgr)


def test_zz_journal_replay_rebuilds_the_streamed_state(mgr, stream):
    """Stream requests are journaled like unary Steps: a restart would rebuild exactly this state."""
    live = state_tree(mgr.running.manager, NAMESPACE_NUMBERED)
    recovered = Journal.open(mgr.state, lease_seconds=3600, readonly=True)
    try:
        again = state_tree(recovered.manager, NAMESPACE_NUMBERED)
        assert prefix_view(recovered.manager) == prefix_view(mgr.running.manager)
    finally:
        recovered.close(snapshot=False)
    for name in live["pools"]:
        assert again["pools"][name] == live["pools"][name], \
            f"pool {name!r} differs after replay at {first_difference(again['pools'][name], live['pools'][name])}"
    assert stream.seq > 10
