"""The memory budget (kvservice/server/budget.py) and the per-call charges of admission.py, without gRPC.

Charged bytes are counted, never RSS: every path (success, refusal, error, cancellation, a stream's
next request) must leave the budget where an independent tally says it is.
"""

from __future__ import annotations

import threading

import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.server.admission import CallCharges
from kvservice.server.budget import (
    REPLY_FACTOR,
    WIRE_FACTOR,
    BudgetExceeded,
    BudgetLimits,
    MemoryBudget,
    cgroup_memory_limit,
    derive_budget,
)

MIB = 1 << 20


def budget(total: int = 100 * MIB, tenant: int = 60 * MIB) -> MemoryBudget:
    return MemoryBudget(BudgetLimits(total, tenant))


def test_charges_and_releases_add_up_per_tenant_and_in_all() -> None:
    b = budget()
    a1 = b.charge("a", 10 * MIB, "Step request")
    a2 = b.charge("a", 5 * MIB, "Step reply")
    c = b.charge("b", 7 * MIB, "ScorePrefix request")
    assert (b.charged_bytes, b.tenant_bytes("a"), b.tenant_bytes("b")) == (22 * MIB, 15 * MIB, 7 * MIB)
    a1.resize(3 * MIB)                     # shrinking always fits
    assert b.tenant_bytes("a") == 8 * MIB and b.charged_bytes == 15 * MIB
    a1.release()
    a1.release()                           # idempotent
    a2.release()
    assert b.tenants() == {"b": 7 * MIB}
    with c:
        pass
    assert b.charged_bytes == 0 and b.tenants() == {} and b.peak_bytes == 22 * MIB


def test_a_tenant_is_refused_at_its_own_limit_while_others_still_fit() -> None:
    b = budget(total=100 * MIB, tenant=60 * MIB)
    held = b.charge("a", 50 * MIB, "Step request")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("a", 11 * MIB, "Step reply")
    assert isinstance(err.value, ResourceExhausted) and err.value.reason == "MEMORY_BUDGET"
    assert "tenant 'a' already hold 50.0 MiB of their 60 MiB (--tenant-rpc-memory-budget): retry" in err.value.message
    assert "Step reply needs 11.0 MiB" in err.value.message
    # the ErrorInfo metadata a client reads: what was asked, what the tenant holds, both limits, all charged
    assert err.value.metadata == {"needed": str(11 * MIB), "held": str(50 * MIB), "tenant_limit": str(60 * MIB),
                                  "charged": str(50 * MIB), "limit": str(100 * MIB)}
    assert b.tenant_bytes("a") == 50 * MIB and b.refused == {"Step reply": 1}     # nothing charged
    other = b.charge("b", 45 * MIB, "Step request")       # another tenant still fits under the global limit
    assert b.charged_bytes == 95 * MIB
    with pytest.raises(BudgetExceeded) as err:            # ... until the global limit: anyone is refused
        b.charge("c", 6 * MIB, "Step request")
    assert "all tenants hold 95.0 MiB of the manager's 100 MiB (--rpc-memory-budget)" in err.value.message
    with pytest.raises(BudgetExceeded) as err:            # more than there is at all: say so
        b.charge("c", 101 * MIB, "Step request")
    assert "more than the 60 MiB (--tenant-rpc-memory-budget) there is" in err.value.message
    held.release()
    other.release()
    assert b.charged_bytes == 0


def test_a_refused_resize_keeps_the_old_size() -> None:
    b = budget(total=20 * MIB, tenant=20 * MIB)
    c = b.charge("a", 5 * MIB, "StepStream session")
    with pytest.raises(BudgetExceeded):
        c.resize(21 * MIB)
    assert c.nbytes == 5 * MIB and b.charged_bytes == 5 * MIB
    c.release()
    assert b.charged_bytes == 0


def test_concurrent_charges_never_pass_the_limit_and_all_come_back() -> None:
    b = budget(total=64 * MIB, tenant=64 * MIB)
    refused, peaks = [], []

    def worker(k: int) -> None:
        for i in range(300):
            try:
                c = b.charge(f"t{k % 3}", (1 + (i * 7 + k) % 5) * MIB, "Step request")
            except BudgetExceeded:
                refused.append(1)
                continue
            peaks.append(b.charged_bytes)
            c.release()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.charged_bytes == 0 and b.tenants() == {}
    assert max(peaks) <= 64 * MIB and b.peak_bytes <= 64 * MIB
    assert sum(b.refused.values()) == len(refused)


def test_call_charges_cover_a_stream_request_by_request_and_release_on_close() -> None:
    b = budget(total=100 * MIB, tenant=100 * MIB)
    call = CallCharges(b, "a", "StepStream")
    call.admit(1 * MIB)
    call.reserve_reply(2 * MIB)
    assert b.charged_bytes == (WIRE_FACTOR + 2 * REPLY_FACTOR) * MIB
    call.reserve_reply(1 * MIB)                           # the reply bound of the same request, recomputed
    assert b.charged_bytes == (WIRE_FACTOR + REPLY_FACTOR) * MIB
    call.admit(2 * MIB)                                   # the next request: the last one and its reply are done
    assert b.charged_bytes == 2 * WIRE_FACTOR * MIB
    call.reserve_reply(1 * MIB)
    call.done()                                           # answered; the stream waits for its next request
    assert b.charged_bytes == 0
    call.admit(1 * MIB)
    call.close()
    assert b.charged_bytes == 0
    call.admit(3 * MIB)                                   # parsed after the call ended: never charged forever
    call.reserve_reply(3 * MIB)
    assert b.charged_bytes == 0


def test_a_refused_request_leaves_nothing_charged_and_the_next_one_can_fit() -> None:
    b = budget(total=10 * WIRE_FACTOR * MIB, tenant=10 * WIRE_FACTOR * MIB)
    call = CallCharges(b, "a", "Step")
    call.admit(4 * MIB)
    with pytest.raises(BudgetExceeded):                   # a stream's next request, too big: the last one
        call.admit(11 * MIB)                              # was released first, the new one not charged
    assert b.charged_bytes == 0 and call.request is None
    call.admit(9 * MIB)
    with pytest.raises(BudgetExceeded):                   # REPLY_FACTOR x 2 MiB > the 1 x WIRE_FACTOR MiB left
        call.reserve_reply(2 * MIB)
    assert b.charged_bytes == 9 * WIRE_FACTOR * MIB
    call.close()
    assert b.charged_bytes == 0


def test_the_budget_is_derived_from_the_memory_limit(tmp_path) -> None:
    base = derive_budget(4 << 30, 1 << 24)
    assert 2 << 30 < base < 3 << 30                         # docs/SECURITY.md#memory-budget: 2,304 MiB
    assert derive_budget(1 << 30, 1 << 24) == (1 << 30) // 8     # too little left: an eighth of the limit
    v2 = tmp_path / "memory.max"
    v2.write_text("4294967296\n")
    assert cgroup_memory_limit((str(v2),)) == 4 << 30
    v2.write_text("max\n")
    assert cgroup_memory_limit((str(v2),)) is None
    assert cgroup_memory_limit((str(tmp_path / "absent"),)) is None
    with pytest.raises(ValueError, match=r"memory budgets must be > 0 bytes, got total 0, tenant 1"):
        BudgetLimits(0, 1)
    with pytest.raises(ValueError, match=r"got total 7, tenant -3"):
        BudgetLimits(7, -3)


def test_reserve_reply_charges_the_running_call_and_nothing_outside_one() -> None:
    """The servicer's reserve_reply() reaches the call the interceptor set for this context (its handler's); a
    replay at startup runs outside any call and charges nothing."""
    import contextvars

    from kvservice.server import admission

    b = budget(total=100 * MIB, tenant=100 * MIB)
    admission.reserve_reply(5 * MIB)                          # no call: nothing charged
    assert b.charged_bytes == 0
    call = CallCharges(b, "a", "GetPool")

    def in_call() -> None:
        admission._CALL.set(call)                             # what AdmissionInterceptor does for the handler
        admission.reserve_reply(2 * MIB)

    contextvars.copy_context().run(in_call)
    assert b.charged_bytes == 2 * REPLY_FACTOR * MIB == b.tenant_bytes("a")
    call.close()
    assert b.charged_bytes == 0
