"""kvservice/server/budget.py MemoryBudget: the refusal's whole text and ErrorInfo where the existing tests leave a
branch open, and that only growth is ever refused.

Oracles: docs/SECURITY.md#memory-budget and the class docstrings: a charge that would take its tenant past
tenant_bytes or everyone past total_bytes is refused (RESOURCE_EXHAUSTED, reason MEMORY_BUDGET) naming the limit
that was full (the tenant's only while it is below the global one and the tenant's is the one passed; the
callers without a token are "this server's callers"); Charge: "Resizing is refused like a new charge when it grows
past a limit" (a resize that does not grow never is). Messages are written out by hand.
"""

from __future__ import annotations

import pytest

from kvservice.server.budget import BudgetExceeded, BudgetLimits, MemoryBudget

MIB = 1 << 20
ADVICE = ("retry when fewer large requests are in flight, send smaller ones (split the step, omit_tables), or close "
          "idle streams")


def test_callers_without_a_token_are_named_as_such_at_their_tenant_limit() -> None:
    b = MemoryBudget(BudgetLimits(200 * MIB, 80 * MIB))
    b.charge("", 70 * MIB + MIB // 2, "Step request")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("", 10 * MIB, "Step reply")
    assert err.value.message == (
        "Step reply needs 10.0 MiB of the manager's memory budget; this server's callers already hold 70.5 MiB of "
        f"their 80 MiB (--tenant-rpc-memory-budget): {ADVICE}")
    assert (err.value.reason, err.value.metadata) == ("MEMORY_BUDGET", {
        "needed": str(10 * MIB), "held": str(70 * MIB + MIB // 2), "tenant_limit": str(80 * MIB),
        "charged": str(70 * MIB + MIB // 2), "limit": str(200 * MIB)})
    assert b.refused == {"Step reply": 1} and b.charged_bytes == 70 * MIB + MIB // 2


def test_a_tenant_that_fits_exactly_its_own_limit_is_refused_by_the_global_one() -> None:
    b = MemoryBudget(BudgetLimits(200 * MIB, 80 * MIB))
    b.charge("o1", 80 * MIB, "Step request")
    b.charge("o2", 80 * MIB, "Step request")
    b.charge("t", 30 * MIB, "Step request")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("t", 50 * MIB, "StepStream session")             # t would hold exactly its 80 MiB: that fits
    assert err.value.message == (
        "StepStream session needs 50.0 MiB of the manager's memory budget; requests and sessions of all tenants hold "
        f"190.0 MiB of the manager's 200 MiB (--rpc-memory-budget): {ADVICE}")
    assert err.value.metadata == {"needed": str(50 * MIB), "held": str(30 * MIB), "tenant_limit": str(80 * MIB),
                                  "charged": str(190 * MIB), "limit": str(200 * MIB)}


def test_only_growth_is_refused_even_past_limits_lowered_meanwhile() -> None:
    b = MemoryBudget(BudgetLimits(100 * MIB, 100 * MIB))
    c = b.charge("a", 10 * MIB, "StepStream session")
    b.limits = BudgetLimits(5 * MIB, 5 * MIB)                     # now over both limits
    c.resize(10 * MIB)                                            # the same size: nothing grows
    zero = b.charge("a", 0, "Step reply")                         # a new charge of nothing
    c.resize(8 * MIB)
    with pytest.raises(BudgetExceeded):
        c.resize(9 * MIB)
    assert (c.nbytes, zero.nbytes, b.tenant_bytes("a"), b.charged_bytes) == (8 * MIB, 0, 8 * MIB, 8 * MIB)
    assert b.refused == {"StepStream session": 1} and b.peak_bytes == 10 * MIB
