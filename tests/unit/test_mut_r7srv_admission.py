"""kvservice/server/admission.py CallCharges: the state a new call's charges start in, a stream's steady loop (a
request no bigger than the one before keeps its charge, resized: "one update, never refused"), and the name a
reply's charge is refused under ("<method> reply": the budget counts refusals by what was charged).
Oracles: the class docstrings and docs/SECURITY.md#memory-budget (a reply is charged REPLY_FACTOR = 4 x its bound,
a request WIRE_FACTOR = 6 x its wire size)."""

from __future__ import annotations

import pytest

from kvservice.server.admission import CallCharges
from kvservice.server.budget import BudgetExceeded, BudgetLimits, MemoryBudget


def test_a_new_call_holds_nothing_and_is_open() -> None:
    call = CallCharges(MemoryBudget(BudgetLimits(1 << 20, 1 << 20)), "t", "Step")
    assert (call.tenant, call.method, call.request, call.reply, call.closed) == ("t", "Step", None, None, False)


def test_a_stream_request_of_the_same_size_keeps_its_charge() -> None:
    b = MemoryBudget(BudgetLimits(1 << 20, 1 << 20))
    call = CallCharges(b, "t", "StepStream")
    call.admit(1000)
    first = call.request
    call.admit(1000)
    assert call.request is first and first.nbytes == 6000 and b.charged_bytes == 6000
    call.admit(400)
    assert call.request is first and first.nbytes == 2400 and b.charged_bytes == 2400


def test_a_reply_that_does_not_fit_is_refused_as_the_methods_reply() -> None:
    b = MemoryBudget(BudgetLimits(1 << 20, 1 << 20))
    call = CallCharges(b, "t", "Step")
    with pytest.raises(BudgetExceeded) as err:
        call.reserve_reply(300_000)                      # 4 x 300,000 bytes > 1 MiB
    assert err.value.message.startswith("Step reply needs 1.1 MiB of the manager's memory budget; ")
    assert b.refused == {"Step reply": 1} and call.reply is None and b.charged_bytes == 0
