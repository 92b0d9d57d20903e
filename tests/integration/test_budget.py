"""The memory budget on a real gRPC server: a request over it is refused RESOURCE_EXHAUSTED before anything
changes, and a closed stream's session gives its charge back at once (bytes charged are counted, not RSS)."""

import queue
import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.server.budget import BudgetLimits
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
MIB = 1 << 20
SPEC = CacheSpec.uniform(2, 1, 64, "float16", 4)
SIZING = Sizing(num_slots=65_536, max_seq_len=65_536)


@pytest.fixture(scope="module")
def running():
    r = serve("127.0.0.1:0", budget=BudgetLimits(4 * MIB, 4 * MIB), max_message_bytes=16 * MIB)
    with BlockManagerClient(f"127.0.0.1:{r.port}", timeout=20, retries=0) as c:
        c.create_pool("p", SPEC, SIZING)
    yield r
    r.stop()


def settled(budget, want: int = 0) -> int:
    """The budget's charged bytes once they reach `want` (a call's charges go back as it ends), bounded."""
    for _ in range(400):
        if budget.charged_bytes == want:
            break
        time.sleep(0.01)
    return budget.charged_bytes


def test_requests_over_the_budget_are_refused_and_change_nothing(running):
    with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=20, retries=0) as c:
        c.step("p", admit=[1], admit_tokens=3)
        before = c.stats("p")["p"]
        refused = dict(running.budget.refused)
        # 100,000 admissions: a 1.2 MB request, charged 6 x before it is parsed: over the 4 MiB budget
        with pytest.raises(ClientError) as exc:
            c.step("p", admit=np.arange(10, 100_010, dtype=np.uint64), admit_tokens=1)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Step request needs" in exc.value.message and "--rpc-memory-budget" in exc.value.message
        # a small request whose reply is not: 2 x 65,536 new tokens, 12 bytes each, bound before the step
        with pytest.raises(ClientError) as exc:
            c.step("p", admit=[2, 3], admit_tokens=65_536)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Step reply needs" in exc.value.message
        # the same over StepStream: the stream's request is refused, the stream and the pool are unchanged
        with c.step_stream("p") as s:
            with pytest.raises(ClientError) as exc:
                s.step(admit=[4, 5], admit_tokens=65_536)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in exc.value.message
        after = c.stats("p")["p"]
        assert (after.num_sequences, after.num_free_slots) == (before.num_sequences, before.num_free_slots) == \
            (1, before.num_free_slots)
        assert c.step("p", extend=[1], extend_tokens=2).num_tokens.tolist() == [5]     # what fits is served
        assert running.budget.refused["Step request"] == refused.get("Step request", 0) + 1
        assert running.budget.refused["Step reply"] == refused.get("Step reply", 0) + 1
        assert running.budget.refused["StepStream reply"] == refused.get("StepStream reply", 0) + 1
        c.step("p", free=[1])
    assert settled(running.budget) == 0


def test_closed_streams_give_their_sessions_charge_back_at_once(running):
    target = f"127.0.0.1:{running.port}"
    assert settled(running.budget) == 0
    with BlockManagerClient(target, timeout=20, retries=0) as c:
        streams = [c.step_stream("p") for _ in range(5)]
        for k, s in enumerate(streams):
            ids = np.arange(100 + 1000 * k, 100 + 1000 * k + 500, dtype=np.uint64)
            s.step(admit=ids, admit_tokens=2)
            s.step(extend=ids, extend_tokens=1)       # the session keeps the tables its client holds
            s.step(extend=ids, extend_tokens=1)
        open_bytes = running.budget.charged_bytes
        sessions = [running.servicer.streams._sessions[("", s.stream_id)] for s in streams]
        kept = sum(v.charge.nbytes for v in sessions)
        assert kept >= 5 * 500 * (8 + 8)              # each keeps its held rows: ids and tokens
        assert open_bytes >= kept
        assert settled(running.budget, kept) == kept  # idle open streams: their answered requests are not charged
        for s in streams:
            s.close()
        assert settled(running.budget) == 0           # every session's and request's charge is back
        assert all(v.charge.nbytes == 0 and v.held is None and v.kept_bytes() == 0 and v.last_seq == 3
                   for v in sessions)                 # last_seq stays: a resend after a reconnect is answered
        c.step("p", free=np.concatenate([np.arange(100 + 1000 * k, 600 + 1000 * k) for k in range(5)])
               .astype(np.uint64))


def test_calls_without_a_known_token_are_not_read_and_cost_the_budget_nothing():
    tokens = TokenTable.from_yaml("tokens:\n  - {name: a, token: a-0123456789abcdef, pools: ['*'], role: admin}\n")
    r = serve("127.0.0.1:0", tokens=tokens, budget=BudgetLimits(4 * MIB, 2 * MIB))
    try:
        big = np.arange(1, 100_001, dtype=np.uint64)            # 6 x 1.2 MB: over the budget if it were read
        for token in (None, "not-a-token"):
            with BlockManagerClient(f"127.0.0.1:{r.port}", token=token, timeout=20, retries=0) as c:
                with pytest.raises(ClientError) as exc:
                    c.step("p", admit=big, admit_tokens=1)
                assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(ClientError) as exc, c.step_stream("p") as s:
                    s.step(admit=big, admit_tokens=1)
                assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert r.budget.refused == {} and r.budget.peak_bytes == 0
        with BlockManagerClient(f"127.0.0.1:{r.port}", token="a-0123456789abcdef", timeout=20, retries=0) as c:
            with pytest.raises(ClientError) as exc:             # a known token's request is read, and charged
                c.step("p", admit=big, admit_tokens=1)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than the 2 MiB (--tenant-rpc-memory-budget)" in exc.value.message     # its tenant's limit
    finally:
        r.stop()


def test_a_refused_stream_request_leaves_nothing_in_its_session(running):
    with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=20, retries=0) as c:
        c.step("p", admit=[7], admit_tokens=1)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    q = queue.SimpleQueue()
    call = pb_grpc.BlockManagerStub(channel).StepStream(iter(q.get, None), metadata=((STREAM_ID_KEY, "refused"),))
    try:
        # 1 id and 50,000 counts: it passes Limits and is refused by the pool (the lengths differ)
        q.put(pb.StepRequest(pool="p", stream_seq=1, extend_seq_ids=to_tensor(np.array([7], dtype=np.uint64)),
                             extend_num_tokens=to_tensor(np.ones(50_000, dtype=np.int64))))
        assert next(call).error.reason == "INVALID_ARGUMENT"
        session = running.servicer.streams._sessions[("", "refused")]
        assert session.held is None and session.kept_bytes() == 0 and session.charge.nbytes == 0
        q.put(pb.StepRequest(pool="p", stream_seq=2, extend_seq_ids=to_tensor(np.array([7], dtype=np.uint64)),
                             extend_num_tokens=to_tensor(np.ones(1, dtype=np.int64))))
        assert not next(call).HasField("error")       # the stream goes on
    finally:
        q.put(None)
        channel.close()
    with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=20, retries=0) as c:
        assert c.step("p", free=[7]).num_free_slots > 0
    assert settled(running.budget) == 0
