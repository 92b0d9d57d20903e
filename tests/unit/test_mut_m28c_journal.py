"""Journal.execute with the bytes a request arrived as (kvservice/state/stores.py, entry_request's doc): the entry is
those bytes, unchanged, followed by the request_id field as the server set it (tag, length, value: protobuf's
wire format, by hand here); parsing the entry gives the request as applied; a retry with the same id is answered
from the window without a new entry. Journal.stamp sets a reply's position to the journal's now."""

from __future__ import annotations

import secrets

import numpy as np

from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal
from kvservice.v1 import block_manager_pb2 as pb

from .test_journal import FAST, body, setup_pools, step_req

REQUEST_ID_TAG = bytes([9 << 3 | 2])          # StepRequest.request_id is field 9, wire type 2 (length-delimited)


def _length(n: int) -> bytes:
    return bytes([n]) if n < 0x80 else bytes([n & 0x7F | 0x80, n >> 7])     # (every n here < 2**14)


def test_a_step_is_journaled_as_the_bytes_it_arrived_as_then_its_request_id():
    rng = np.random.default_rng(9028)
    j = Journal(BlockManager(), config=FAST)
    setup_pools(j)
    for k, rid in enumerate((f"tenant-a/{secrets.token_hex(4)}", "t/" + secrets.token_hex(70))):
        n = int(rng.integers(1, 90))
        # as a client may send it: its own id, fields out of field-number order (protobuf accepts any order)
        received = (pb.StepRequest(request_id="client-id").SerializeToString()
                    + step_req("", admit=[k + 1], n=[n]).SerializeToString()
                    + pb.StepRequest(pool="a").SerializeToString())
        applied = step_req("a", admit=[k + 1], n=[n], rid=rid)
        assert received != applied.SerializeToString(deterministic=True)
        before = j.seq
        reply = j.execute("Step", applied, j.api.Step, received=received)
        assert j.seq == before + 1
        (entry,) = list(j.store.entries_after(before))
        assert entry.method == "Step" and entry.seq == before + 1
        assert entry.request == received + REQUEST_ID_TAG + _length(len(rid)) + rid.encode()
        assert pb.StepRequest.FromString(entry.request) == applied
        again = j.execute("Step", applied, j.api.Step, received=received)
        assert j.seq == before + 1 and body(again) == body(reply)
        assert list(j.store.entries_after(before)) == [entry]


def test_stamp_sets_a_replys_position_to_the_journals_now():
    j = Journal(BlockManager(), config=FAST)
    setup_pools(j)
    reply = pb.StepReply()
    reply.position.incarnation, reply.position.seq = 777, 999_999    # stale values: overwritten
    assert j.stamp(reply) is reply
    assert (reply.position.incarnation, reply.position.seq) == (j.incarnation, j.seq) and j.seq == 4
    assert j.incarnation >= 1
    other = pb.RegisterWorkerRequest(worker_id="w9", pool="a")             # no position field: unchanged
    assert j.stamp(other) is other and other == pb.RegisterWorkerRequest(worker_id="w9", pool="a")


def test_an_entry_is_checked_for_its_position_checksum_method_and_bytes_each_named():
    """Journal._checked (recovery, a standby): the whole message of each refusal, the request when all hold."""
    import pytest

    from kvservice.contract.errors import StateError
    from kvservice.state.stores import Entry, entry_digest

    rng = np.random.default_rng(1717)
    req = step_req("p", admit=[int(rng.integers(1, 1000))], n=[int(rng.integers(1, 90))],
                   rid="r-" + secrets.token_hex(3))
    data, at = req.SerializeToString(deterministic=True), float(rng.uniform(1e9, 2e9))

    def entry(seq, method="Step", request=data, digest=None):
        return Entry(seq, method, request, at, digest or entry_digest(seq, method, request, at))

    assert Journal._checked(entry(5), 5, "here") == req
    with pytest.raises(StateError) as err:
        Journal._checked(entry(8), 5, "the dir")
    assert err.value.message == "the dir: journal entries 5..7 are missing (after position 4): acknowledged changes " \
                                "are lost"
    with pytest.raises(StateError) as err:
        Journal._checked(entry(5, digest=entry_digest(5, "Step", data, at + 1.0)), 5, "the dir")
    assert err.value.message == "the dir: journal entry 5 fails its checksum (damaged)"
    with pytest.raises(StateError) as err:
        Journal._checked(entry(5, method="Stepp"), 5, "the dir")
    assert err.value.message == "the dir: journal entry 5 has unknown method 'Stepp'"
    with pytest.raises(StateError) as err:
        Journal._checked(entry(5, request=b"\xff\xff\xff"), 5, "the dir")
    assert err.value.message.startswith("the dir: journal entry 5 (Step) cannot be replayed (DecodeError: ")
