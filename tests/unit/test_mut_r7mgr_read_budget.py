"""ReadBudget's pieces in flight (read_budget.py: _running is tenant -> pieces in flight): a tenant is listed only
while it has pieces running, so a manager that served many tenants keeps no entry for those that are idle (the
buckets are bounded by max_tenants; nothing else would bound this map)."""

from kvservice.manager.read_budget import ReadBudget
from tests.clocks import ManualClock


def test_only_tenants_with_pieces_running_are_kept_in_flight():
    budget = ReadBudget(share=0.5, burst=4.0, clock=ManualClock(10.0), max_in_flight=2)
    tenants = [f"tok-{i}" for i in range(5)]
    for t in tenants:
        assert budget.try_start(t) == 0.0
    assert budget.try_start("tok-0") == 0.0
    assert budget._running == {"tok-0": 2, "tok-1": 1, "tok-2": 1, "tok-3": 1, "tok-4": 1}
    budget.finish("tok-0", 0.25)
    assert budget._running == {"tok-0": 1, "tok-1": 1, "tok-2": 1, "tok-3": 1, "tok-4": 1}
    for t in tenants:
        budget.finish(t, 0.25)
    assert budget._running == {}
    assert budget._buckets["tok-0"] == (3.5, 10.0) and budget._buckets["tok-4"] == (3.75, 10.0)
