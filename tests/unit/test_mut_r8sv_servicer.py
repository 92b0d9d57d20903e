"""kvservice/server/servicer.py: reads of pool state (GetPool, ListPools, ListSequences, GetStats) go through the
journal's read gate (Journal.read), which stamps their replies with the journal position they saw.

Oracles: the module docstring ("reads of pool state go through it too, so they only see committed state") and
Journal.read's docstring with _stamp: each reply's position is (the journal's incarnation, its seq, its store's
lineage) at the read, here after a random number of journaled changes, so seq is known independently (one per
CreatePool / Step sent).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_m28b_servicer import SPEC, served  # noqa: F401  (served: the in-process server fixture)


@pytest.mark.parametrize(("method", "request_of"), [
    ("GetPool", lambda: pb.GetPoolRequest(pool="q")),
    ("ListPools", lambda: pb.ListPoolsRequest()),
    ("ListSequences", lambda: pb.ListSequencesRequest(pool="q")),
    ("GetStats", lambda: pb.GetStatsRequest(pool="q")),
])
def test_state_reads_go_through_the_journal_read_gate_and_carry_its_position(served, method, request_of) -> None:  # noqa: F811
    running, stub = served
    rng = np.random.default_rng(sum(method.encode()))
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)
    steps = int(rng.integers(2, 6))
    for i in range(steps):
        stub.Step(step_request("q", admit=[100 + i], admit_tokens=[int(rng.integers(1, 40))]), timeout=10)
    journal = running.journal
    assert journal.seq == 1 + steps                       # one entry per change sent
    calls: list[str] = []
    real = journal.read

    def read(request, apply):
        calls.append(type(request).__name__)
        return real(request, apply)
    journal.read = read
    reply = getattr(stub, method)(request_of(), timeout=10)
    assert calls == [type(request_of()).__name__]
    assert (reply.position.incarnation, reply.position.seq, reply.position.lineage) == \
        (journal.incarnation, 1 + steps, journal.store.lineage)
    assert reply.position.seq > 0


def test_a_state_read_refused_by_the_read_gate_is_refused_to_the_client(served) -> None:  # noqa: F811
    """Whatever the gate raises reaches the client: here a JournalUnavailable, UNAVAILABLE with its text."""
    import grpc

    from kvservice.contract.errors import JournalUnavailable

    running, stub = served
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=8)), timeout=10)

    def read(request, apply):
        raise JournalUnavailable("gate closed for the test")
    running.journal.read = read
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPool(pb.GetPoolRequest(pool="q"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == "gate closed for the test"
