"""The worker's leader-epoch fence and a kernel call's bound, without a server: the rules of docs/HA.md (a call
stamped below the epoch the worker's manager client has seen is refused, above or equal accepted, unstamped
refused once an epoch was seen, nothing checked before) on random epochs, and the deadline/cancel flag the kernel
loops read. tests/integration/test_worker_leader_epoch.py sees the same through a worker process."""

from __future__ import annotations

import random
import time

import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.transport import EPOCH_METADATA
from kvservice.worker.cancel import CallBound, KernelCancelled, bounded, check
from kvservice.worker.fencing import LeaderEpochFence, check_incarnation

ID = {"worker_id": "w-7", "pool": "p"}


def test_the_fence_follows_the_documented_rule_on_random_epochs():
    rng = random.Random(28)
    seen = [0]
    reasons: list[str] = []
    fence = LeaderEpochFence(lambda: seen[0], reasons.append)
    refused = 0
    for _ in range(300):
        seen[0] = rng.choice([0, rng.randint(1, 50)])
        stamped = rng.choice([None, rng.randint(1, 60)])
        md = [("x-other", "1")] + ([(EPOCH_METADATA, str(stamped))] if stamped is not None else [])
        want = None if seen[0] == 0 else ("LEADER_EPOCH_REQUIRED" if stamped is None else
                                          "STALE_LEADER_EPOCH" if stamped < seen[0] else None)
        if want is None:
            fence.check(md, ID, "AppendKV")
            continue
        refused += 1
        with pytest.raises(FailedPrecondition) as e:
            fence.check(md, ID, "AppendKV")
        assert e.value.reason == want and e.value.metadata["epoch"] == str(seen[0])
        assert "worker w-7 of pool 'p'" in e.value.message
        assert reasons[-1] == want
    assert fence.refused == refused == len(reasons) > 0


@pytest.mark.parametrize("value", ["abc", "0", "-3"])
def test_a_stamp_that_is_no_epoch_is_named(value):
    with pytest.raises(InvalidArgument, match=f"AppendKV: metadata {EPOCH_METADATA} must be"):
        LeaderEpochFence(lambda: 5).check([(EPOCH_METADATA, value)], ID, "AppendKV")


def test_a_bound_expires_at_its_deadline_or_when_cancelled():
    assert not CallBound().expired() and CallBound().deadline_ns == 0
    ahead = CallBound(time.monotonic() + 3600)
    assert not ahead.expired()
    ahead.cancel()
    assert ahead.expired()
    assert CallBound(time.monotonic() - 1).expired()
    with bounded(time.monotonic() + 3600):
        check("decode")                                   # neither passed nor cancelled: runs on
        with bounded(time.monotonic() - 1):
            with pytest.raises(KernelCancelled, match="decode: stopped"):
                check("decode")
        check("decode")                                   # the outer bound is back


def test_a_persistent_tables_rows_are_bounded_by_the_flag_and_the_pools_slots():
    """TablePlan.max_rows = min(--max-table-rows, the pool's slots), at least 1 (kvservice/worker/tables.py)."""
    from kvservice.contract.geometry import CacheSpec
    from kvservice.worker import ops_numpy
    from kvservice.worker.caches import CacheSet
    from kvservice.worker.service import table_plan

    spec = CacheSpec.uniform(2, 1, 64, page_size=4)
    caches = CacheSet(spec, 40, 0, 2, ops_numpy, max_seq_len=64)
    assert table_plan(caches, 1000).max_rows == 40
    assert table_plan(caches, 7).max_rows == 7
    assert table_plan(caches, 0).max_rows == 1
    assert (table_plan(caches).max_seq_len, table_plan(caches).page_size) == (64, 4)


def test_a_request_of_another_incarnation_is_refused_by_the_documented_rule():
    """docs/SECURITY.md, fencing: a kernel request's pool_incarnation other than the one the worker's memory is
    planned for is refused (STALE_INCARNATION, naming the pool and the worker's incarnation); 0 is not checked."""
    from kvservice.v1 import worker_pb2 as wpb

    rng = random.Random(16)
    kinds = (wpb.AppendKVRequest, wpb.DecodeAttentionRequest, wpb.CopyBlocksRequest, wpb.WorkerValidateRequest)
    for _ in range(200):
        mine, pool = rng.randint(1, 2**40), rng.choice(["p", "llama-7b", "tenant/a"])
        identity = {"worker_id": f"w-{rng.randint(1, 9)}", "pool": pool, "incarnation": mine}
        asked = rng.choice([0, mine, rng.randint(1, 2**40)])
        request = rng.choice(kinds)(pool_incarnation=asked)
        if asked in (0, mine):
            check_incarnation(identity, request)
            continue
        with pytest.raises(FailedPrecondition) as e:
            check_incarnation(identity, request)
        assert e.value.reason == "STALE_INCARNATION"
        assert e.value.metadata == {"pool": pool, "incarnation": str(mine)}
        assert f"incarnation {mine} of pool {pool!r}; this request was planned in incarnation {asked}" in \
            e.value.message
    check_incarnation({"worker_id": "w-1", "pool": "p", "incarnation": 5}, wpb.UpdateTablesRequest())   # no such field
