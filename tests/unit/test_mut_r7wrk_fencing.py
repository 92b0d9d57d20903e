"""The worker's fences, each refusal pinned whole: check_incarnation's STALE_INCARNATION (message, reason,
metadata) and LeaderEpochFence.check's three refusals (an unstamped call, a stale stamp, a stamp that is no epoch):
the exact message naming the method, the worker and pool (or '?' when the identity lacks them), the epochs, the
reason and metadata, the refusal count and the reason handed to on_refuse; and the MemoryGate's admissions
(docs/SECURITY.md#fencing, docs/HA.md)."""

from __future__ import annotations

import random
import threading

import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.v1 import worker_pb2 as wpb
from kvservice.worker.fencing import LeaderEpochFence, MemoryGate, check_incarnation
from tests.clocks import until

KEY = "kvservice-leader-epoch"      # docs/HA.md: the metadata a scheduler stamps its calls with


def test_a_stale_incarnation_is_refused_with_the_whole_message_and_metadata():
    """check_incarnation: the message names the worker, the incarnation its memory is planned for, the pool (repr),
    the incarnation asked, and says what to do; reason STALE_INCARNATION, metadata pool and incarnation (mine)."""
    rng = random.Random()
    for _ in range(20):
        mine, asked = rng.sample(range(1, 2**40), 2)
        wid, pool = f"w-{rng.randint(1, 99)}", rng.choice(["p", "llama-7b", "tenant/a"])
        identity = {"worker_id": wid, "pool": pool, "incarnation": mine, "epoch": rng.randint(1, 9)}
        with pytest.raises(FailedPrecondition) as e:
            check_incarnation(identity, wpb.DecodeAttentionRequest(pool_incarnation=asked))
        assert e.value.message == (
            f"worker {wid} holds memory planned for incarnation {mine} of pool {pool!r}; this request was planned "
            f"in incarnation {asked}: the pool was created again. Use the tables of a Step of the current pool, "
            "and workers registered with it (ListWorkers)")
        assert (e.value.reason, e.value.metadata) == ("STALE_INCARNATION", {"pool": pool, "incarnation": str(mine)})


def test_an_identity_without_an_incarnation_counts_as_incarnation_0():
    """A worker identity that names no incarnation is incarnation 0: any request naming one is refused naming 0;
    a request naming none (0) passes."""
    identity = {"worker_id": "w-1", "pool": "p"}
    check_incarnation(identity, wpb.AppendKVRequest())
    with pytest.raises(FailedPrecondition) as e:
        check_incarnation(identity, wpb.AppendKVRequest(pool_incarnation=1))
    assert "holds memory planned for incarnation 0 of pool 'p'; this request was planned in incarnation 1:" in \
        e.value.message and e.value.metadata == {"pool": "p", "incarnation": "0"}


def _refusal(fence, md, identity, method):
    with pytest.raises(FailedPrecondition) as e:
        fence.check(md, identity, method)
    return e.value


def test_the_leader_epoch_refusals_whole():
    """LeaderEpochFence.check once an epoch was seen: an unstamped call (only other metadata) is refused
    LEADER_EPOCH_REQUIRED with metadata {epoch}; a call stamped below is refused STALE_LEADER_EPOCH with
    {epoch, stamped}; each message names the method, the worker and pool and the epochs, and says what to do.
    Every refusal is counted and its reason handed to on_refuse; a stamp equal to or above the epoch passes."""
    rng = random.Random()
    seen = rng.randint(2, 10**6)
    stale = rng.randint(1, seen - 1)
    reasons = []
    fence = LeaderEpochFence(lambda: seen, reasons.append)
    ident = {"worker_id": "w-9", "pool": "llama"}
    who = "worker w-9 of pool 'llama'"
    e = _refusal(fence, [("x-trace", "7")], ident, "DecodeAttention")
    assert e.message == (
        f"DecodeAttention: {who} serves a replicated manager (leader epoch {seen}) and this call names no leader "
        f"epoch: send the epoch of the manager reply its tables came from in the metadata {KEY} "
        "(kvservice.client.worker_client.WorkerClient(leader_epoch=...))")
    assert (e.reason, e.metadata) == ("LEADER_EPOCH_REQUIRED", {"epoch": str(seen)})
    assert (fence.refused, reasons) == (1, ["LEADER_EPOCH_REQUIRED"])
    e = _refusal(fence, [(KEY, str(stale))], ident, "CopyBlocks")
    assert e.message == (
        f"CopyBlocks: {who} has seen leader epoch {seen}, but this call's tables come from epoch {stale}: a "
        "deposed manager. Nothing was read or written; take the tables from the current leader (a LeaderClient "
        "retries there) and send the call again")
    assert (e.reason, e.metadata) == ("STALE_LEADER_EPOCH", {"epoch": str(seen), "stamped": str(stale)})
    assert (fence.refused, reasons) == (2, ["LEADER_EPOCH_REQUIRED", "STALE_LEADER_EPOCH"])
    for stamp in (seen, seen + rng.randint(1, 99)):
        fence.check([("x-trace", "7"), (KEY, str(stamp))], ident, "AppendKV")
    assert (fence.refused, reasons) == (2, ["LEADER_EPOCH_REQUIRED", "STALE_LEADER_EPOCH"])


def test_a_refusal_names_an_unknown_worker_and_pool_with_a_question_mark_and_needs_no_on_refuse():
    """An identity without worker_id or pool is named 'worker ? of pool '?''; a fence without on_refuse still
    refuses and counts. Epoch 1 is a valid stamp (not refused as no epoch)."""
    fence = LeaderEpochFence(lambda: 2)
    e = _refusal(fence, None, {}, "UpdateTables")
    assert e.message.startswith("UpdateTables: worker ? of pool '?' serves a replicated manager (leader epoch 2) ")
    e = _refusal(fence, [(KEY, "1")], {}, "AppendKV")
    assert e.message.startswith("AppendKV: worker ? of pool '?' has seen leader epoch 2, but this call's tables "
                                "come from epoch 1: ")
    assert fence.refused == 2


def test_a_worker_that_has_seen_no_epoch_checks_nothing_but_the_stamps_form():
    """No epoch seen (no source, or a source saying 0): any call passes, stamped or not, and nothing is counted;
    a stamp that is no decimal epoch >= 1 is still InvalidArgument, naming the method and the value."""
    for fence in (LeaderEpochFence(), LeaderEpochFence(lambda: 0)):
        for md in (None, [], [("x", "y")], [(KEY, "1")], [(KEY, "99")]):
            fence.check(md, {"worker_id": "w", "pool": "p"}, "AppendKV")
        assert fence.refused == 0 and fence.seen == 0
        with pytest.raises(InvalidArgument) as e:
            fence.check([(KEY, "abc")], {}, "AppendKV")
        assert e.value.message == f"AppendKV: metadata {KEY} must be a decimal epoch, got 'abc'"
        for bad in ("0", "-4"):
            with pytest.raises(InvalidArgument) as e:
                fence.check([(KEY, bad)], {}, "CopyBlocks")
            assert e.value.message == f"CopyBlocks: metadata {KEY} must be >= 1, got {int(bad)}"
        assert fence.refused == 0


def test_the_memory_gate_admits_readers_together_and_a_writer_alone():
    """MemoryGate: shared holders nest and overlap; an exclusive holder gets in once they left, and readers get in
    again after it. A gate that never admitted one of these would leave the thread running (bounded wait)."""
    gate, steps = MemoryGate(), []

    def run():
        with gate.shared():
            with gate.shared():
                steps.append("two readers")
        with gate.exclusive():
            steps.append("writer")
        with gate.exclusive():
            steps.append("writer again")
        with gate.shared():
            steps.append("reader after")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert until(lambda: not t.is_alive()), steps
    assert steps == ["two readers", "writer", "writer again", "reader after"]


def test_a_writer_waits_for_the_reader_in_and_then_goes_first():
    """A writer asking while a reader holds the gate waits until it leaves, then runs alone."""
    gate, steps = MemoryGate(), []
    inside = threading.Event()
    release = threading.Event()

    def reader():
        with gate.shared():
            inside.set()
            release.wait(30)
            steps.append("reader out")

    def writer():
        with gate.exclusive():
            steps.append("writer in")

    r = threading.Thread(target=reader, daemon=True)
    r.start()
    assert inside.wait(30)
    w = threading.Thread(target=writer, daemon=True)
    w.start()
    assert until(lambda: gate._waiting == 1)      # the writer is queued behind the reader
    assert steps == []
    release.set()
    assert until(lambda: not w.is_alive() and not r.is_alive())
    assert steps == ["reader out", "writer in"]
