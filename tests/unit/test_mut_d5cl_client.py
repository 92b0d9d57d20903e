"""Client contracts the seed-41 draw showed unpinned (kvservice/client), checked at the stub or on hand-built values:

- BlockManagerClient.step / validate: the request each sends (hand-built protos and little-endian bytes), under
  the call's own timeout else the client's (the class docstring); validate asks for 100 violations by default (the
  proto: "0 = 100"), and its reply comes back as a ValidationReport.
- EventStream: a broken WatchEvents stream raises ClientError with the call's code and details (its docstring).
- client_policy / RetryPolicy: `failover` replaces the policy's; the old name `deadline` becomes `failover`.
- codec.score_request: INT32 only when every id fits in int32, else INT64 (its docstring).
- LeaderEventStream: a reply below the highest epoch seen is refused and the stream resumes on the next address
  from the same sequence (docs/HA.md); a higher epoch is recorded.
"""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from kvservice.client.client import BlockManagerClient, EventStream
from kvservice.client.codec import ClientError, score_request
from kvservice.client.deadline import RetryPolicy, client_policy
from kvservice.client.ha import LeaderClient, LeaderEventStream
from kvservice.contract.pagetable import PageTable, ValidationReport, Violation
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.support_client import RpcErr
from tests.unit.test_mut_s21a_client import DEAD, Stub, _le


def test_step_sends_its_request_under_the_calls_own_deadline_else_the_clients():
    reply = pb.StepReply(seq_ids=cpb.Tensor(dtype=cpb.UINT64, shape=[2], data=_le("Q", [7, 9])),
                         num_tokens=cpb.Tensor(dtype=cpb.INT64, shape=[2], data=_le("q", [1, 1])),
                         new_token_indptr=cpb.Tensor(dtype=cpb.INT64, shape=[3], data=_le("q", [0, 1, 2])),
                         num_free_slots=11)
    with BlockManagerClient(DEAD, timeout=300.0, token="t0") as c:
        c._stub = stub = Stub(Step=reply)
        got = c.step("p", extend=np.array([7, 9], dtype=np.uint64), timeout=4.5, request_id="r-1")
        c.step("p", extend=np.array([7], dtype=np.uint64))
    assert got.seq_ids.tolist() == [7, 9] and got.num_tokens.tolist() == [1, 1] and got.num_free_slots == 11
    (m1, r1, t1, md1), (m2, r2, t2, md2) = stub.calls
    assert (m1, m2) == ("Step", "Step") and md1 == md2 == (("authorization", "Bearer t0"),)
    assert (r1.pool, r1.request_id) == ("p", "r-1") and r2.request_id not in ("", "r-1")
    assert (r1.extend_seq_ids.dtype, r1.extend_seq_ids.data) == (cpb.INT32, _le("i", [7, 9]))   # ids that fit: INT32
    assert 0 < t1 <= 4.5 and 4.5 < t2 <= 300.0           # its own timeout, else the client's (no elapsed-time bound)


def test_validate_sends_the_table_asks_for_100_reports_by_default_and_returns_the_report():
    rng = np.random.default_rng(4141)
    indices = rng.integers(1, 2**20, 5).astype(np.int32)
    table = PageTable(np.array([0, 2, 5], dtype=np.int32), indices, np.array([3, 16], dtype=np.int32))
    reply = pb.ValidatePageTableReply(ok=False, num_violations=1234, violations=[
        pb.Violation(reason="out_of_range", row=1, position=3, value=int(indices[3]), detail="past the pool"),
        pb.Violation(reason="bad_last_page_len", row=0, position=-1, value=17)])
    with BlockManagerClient(DEAD, timeout=300.0) as c:
        c._stub = stub = Stub(ValidatePageTable=reply)
        got = c.validate("pool-a", 6, table)
        assert c.validate("pool-b", 2, table, max_reports=7, timeout=3.5) == got
    assert got == ValidationReport(1234, [Violation("out_of_range", 1, 3, int(indices[3]), "past the pool"),
                                          Violation("bad_last_page_len", 0, -1, 17, "")])
    (m1, r1, t1, _), (m2, r2, t2, _) = stub.calls
    assert (m1, m2) == ("ValidatePageTable", "ValidatePageTable")
    for r in (r1, r2):
        assert (r.indptr.dtype, r.indptr.data) == (cpb.INT32, _le("i", [0, 2, 5]))
        assert (r.indices.dtype, r.indices.data) == (cpb.INT32, _le("i", indices))
        assert (r.last_page_len.dtype, r.last_page_len.data) == (cpb.INT32, _le("i", [3, 16]))
    assert (r1.pool, r1.layer, r1.max_reports) == ("pool-a", 6, 100)
    assert (r2.pool, r2.layer, r2.max_reports) == ("pool-b", 2, 7)
    assert 3.5 < t1 <= 300.0 and 0 < t2 <= 3.5


def test_a_broken_event_stream_raises_client_error_with_the_calls_code_and_details():
    batches = [pb.KVEventBatch(sequence=4), pb.KVEventBatch(sequence=5)]

    def call():
        yield from batches
        raise RpcErr(grpc.StatusCode.PERMISSION_DENIED, "token may not watch pool p")

    got = []
    with pytest.raises(ClientError) as e:
        for b in EventStream(call()):
            got.append(b)
    assert got == batches
    assert (e.value.code, e.value.message, e.value.reason) == (grpc.StatusCode.PERMISSION_DENIED,
                                                               "token may not watch pool p", "")


def test_client_policy_takes_retry_else_the_default_with_retries_and_failover_replaces_the_policys():
    base = RetryPolicy(attempts=4, failover=2.0, initial_backoff=0.25)
    own = RetryPolicy(attempts=2, failover=1.0)
    assert client_policy(None, None, None, base) is base
    assert client_policy(own, 9, None, base) is own
    assert client_policy(None, 3, None, base) == dataclasses.replace(base, attempts=4)
    assert client_policy(None, -2, None, base) == dataclasses.replace(base, attempts=1)
    assert client_policy(None, None, 7.5, base) == dataclasses.replace(base, failover=7.5)
    assert client_policy(own, None, 0.0, base) == RetryPolicy(attempts=2, failover=0.0)
    assert client_policy(None, 0, 9.0, base) == dataclasses.replace(base, attempts=1, failover=9.0)


def test_the_old_name_deadline_becomes_failover_the_larger_of_the_two():
    p = RetryPolicy(deadline=4.0)
    assert (p.failover, p.deadline) == (4.0, None) and p == RetryPolicy(failover=4.0)
    assert RetryPolicy(failover=6.0, deadline=4.0) == RetryPolicy(failover=6.0)
    assert RetryPolicy(failover=1.5, deadline=2.5).failover == 2.5


@pytest.mark.parametrize("ids, wide", [
    ([5, 2**31 - 1, -(2**31)], False),
    ([-3, 2**31], True),                     # min fits, max does not
    ([-(2**31) - 1, 3], True),               # max fits, min does not
    ([], False),
])
def test_score_request_sends_int32_only_when_every_id_fits(ids, wide):
    r = score_request(ids, salt="s", extra_key="k", pools=("a",), model="m")
    assert (r.token_ids.dtype, r.token_ids.data) == ((cpb.INT64, _le("q", ids)) if wide else (cpb.INT32, _le("i", ids)))
    assert (r.cache_salt, r.extra_key, list(r.pools), r.model) == ("s", "k", ["a"], "m")


class Call:
    """A WatchEvents call: its initial metadata, then its messages."""

    def __init__(self, epoch, msgs):
        self.md, self.msgs, self.cancelled = (("kvservice-leader-epoch", str(epoch)),), msgs, False

    def initial_metadata(self):
        return self.md

    def __iter__(self):
        return iter(self.msgs)

    def cancel(self):
        self.cancelled = True


class WatchStub:
    def __init__(self, name, calls, log):
        self.name, self.calls, self.log = name, calls, log

    def WatchEvents(self, req, timeout=None, metadata=None):
        self.log.append((self.name, req, timeout))
        return self.calls.pop(0)


def test_the_leader_event_stream_refuses_a_stale_epoch_and_resumes_on_the_next_address_from_the_same_sequence():
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    c = LeaderClient([a, b], timeout=3.0)
    pauses, log = [], []
    try:
        c._pause = pauses.append                      # no real backoff: the test only counts the pauses
        c.stream_answered(1, (("kvservice-leader-epoch", "5"),))
        c._rotate(1)                                  # back on a: the deposed manager
        assert c.current_target == a
        stale = Call(3, [pb.KVEventBatch(sequence=40)])
        fresh = Call(7, [pb.KVEventBatch(sequence=40), pb.KVEventBatch(sequence=41)])
        c._stubs = [WatchStub("a", [stale], log), WatchStub("b", [fresh], log)]
        s = c.watch_events("p", from_sequence=40, timeout=9.0)
        assert isinstance(s, LeaderEventStream) and (s.pool, s.next_sequence, s.timeout) == ("p", 40, 9.0)
        got = list(s)
    finally:
        c.close()
    assert [m.sequence for m in got] == [40, 41]      # only the leader's batches
    assert [(n, r.pool, r.from_sequence, t) for n, r, t in log] == [("a", "p", 40, 9.0), ("b", "p", 40, 9.0)]
    assert stale.cancelled and not fresh.cancelled
    assert (c.epoch, c.stale_replies, s.reconnects, s.next_sequence, len(pauses)) == (7, 1, 1, 42, 1)
    assert c.current_target == b


def test_a_leader_event_stream_cancelled_before_its_first_call_opens_none_and_yields_nothing():
    """cancel() before iteration: nothing to cancel yet (no call was opened), and iterating then opens no call."""
    c = LeaderClient(["127.0.0.1:1"], timeout=3.0)
    log = []
    try:
        c._stubs = [WatchStub("a", [Call(1, [pb.KVEventBatch(sequence=3)])], log)]
        s = c.watch_events("p", from_sequence=3)
        s.cancel()
        assert list(s) == [] and log == [] and s._cancelled
        s2 = c.watch_events("p", from_sequence=3)
        got = iter(s2)
        assert next(got).sequence == 3
        call = s2._call
        s2.cancel()                                   # the open call is cancelled, and the stream ends
        assert call.cancelled and list(got) == []
    finally:
        c.close()
