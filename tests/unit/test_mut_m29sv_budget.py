"""The memory budget (kvservice/server/budget.py) against a plain-Python model of docs/SECURITY.md#memory-budget.

The rule: a charge that would take its tenant past the tenant limit or everyone past the total limit is refused
(BudgetExceeded: RESOURCE_EXHAUSTED, reason MEMORY_BUDGET) and nothing changes; shrinking always fits; the refusal
says what was needed, which limit was full (the tenant's when the tenant is over it and its limit is the smaller)
and what to do. The model below is written from that text, byte by byte: limits of a few hundred bytes make random
charges land exactly on, and one byte past, each limit.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.server.budget import BudgetExceeded, BudgetLimits, Charge, MemoryBudget

MIB = 1 << 20


class Model:
    """Tenant -> bytes held, everyone's total and its peak, refusals by what; each Charge's model size by id."""

    def __init__(self, total: int, tenant: int) -> None:
        self.total_limit, self.tenant_limit = total, tenant
        self.held: dict[str, int] = {}
        self.total = self.peak = 0
        self.refused: dict[str, int] = {}
        self.size: dict[int, tuple[str, str, int]] = {}

    def move(self, key: int, tenant: str, what: str, old: int, new: int) -> dict[str, str] | None:
        """None if it fits (and is applied), else the refusal's expected ErrorInfo metadata (nothing applied)."""
        grow, held = new - old, self.held.get(tenant, 0)
        if grow > 0 and (held + grow > self.tenant_limit or self.total + grow > self.total_limit):
            self.refused[what] = self.refused.get(what, 0) + 1
            return {"needed": str(grow), "held": str(held), "tenant_limit": str(self.tenant_limit),
                    "charged": str(self.total), "limit": str(self.total_limit)}
        self.held[tenant] = held + grow
        if not self.held[tenant]:
            del self.held[tenant]
        self.total += grow
        self.peak = max(self.peak, self.total)
        self.size[key] = (tenant, what, new)
        return None

    def flag(self, tenant: str, grow: int) -> str:
        over_tenant = self.held.get(tenant, 0) + grow > self.tenant_limit
        return "--tenant-rpc-memory-budget" if over_tenant and self.tenant_limit < self.total_limit \
            else "--rpc-memory-budget"


@pytest.mark.parametrize("seed", range(4))
def test_random_charges_resizes_and_releases_follow_the_model(seed) -> None:
    rng = np.random.default_rng(900 + seed)
    total = int(rng.integers(300, 600))
    tenant = total if seed % 2 else int(rng.integers(100, total))       # equal limits, and a smaller tenant one
    b, model = MemoryBudget(BudgetLimits(total, tenant)), Model(total, tenant)
    live: list[Charge] = []
    tenants = ["", "alpha", "beta"]
    whats = ["Step request", "Step reply", "StepStream session", "WatchEvents reply"]
    refusals = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.45 or not live:
            t, what = tenants[int(rng.integers(3))], whats[int(rng.integers(4))]
            n = int(rng.integers(0, 160))
            want = model.flag(t, n)
            try:
                c = b.charge(t, n, what)
            except BudgetExceeded as err:
                expected = model.move(-1, t, what, 0, n)
                assert expected is not None, (t, n)
                _check_refusal(err, what, n, want, expected)
                refusals += 1
            else:
                assert model.move(id(c), t, what, 0, n) is None, (t, n)
                assert (c.tenant, c.what, c.nbytes) == (t, what, n)
                live.append(c)
        elif op < 0.8:
            c = live[int(rng.integers(len(live)))]
            n = int(rng.integers(0, 200))
            want = model.flag(c.tenant, n - c.nbytes)
            old = c.nbytes
            try:
                c.resize(n)
            except BudgetExceeded as err:
                expected = model.move(id(c), c.tenant, c.what, old, n)
                assert expected is not None
                _check_refusal(err, c.what, n - old, want, expected)
                assert c.nbytes == old                          # a refused resize keeps the old size
                refusals += 1
            else:
                assert model.move(id(c), c.tenant, c.what, old, n) is None
                assert c.nbytes == n
        else:
            c = live.pop(int(rng.integers(len(live))))
            assert model.move(id(c), c.tenant, c.what, c.nbytes, 0) is None
            c.release()
            c.release()                                          # idempotent
            assert c.nbytes == 0
        assert b.charged_bytes == model.total and b.tenants() == model.held and b.peak_bytes == model.peak
        assert all(b.tenant_bytes(t) == model.held.get(t, 0) for t in tenants)
        assert b.refused == model.refused
    assert refusals > 20                                         # the limits were reached, and often
    for c in live:
        c.release()
    assert b.charged_bytes == 0 and b.tenants() == {}


def _check_refusal(err: BudgetExceeded, what: str, grow: int, flag: str, metadata: dict[str, str]) -> None:
    assert isinstance(err, ResourceExhausted) and err.reason == "MEMORY_BUDGET"
    assert err.metadata == metadata
    assert err.message.startswith(f"{what} needs {grow / MIB:.1f} MiB of the manager's memory budget; ")
    assert f"({flag})" in err.message


def test_one_byte_past_either_limit_is_refused_and_exactly_at_it_fits() -> None:
    """The limits are inclusive: a tenant may hold exactly tenant_bytes and all together exactly total_bytes; one
    byte more, as a new charge or as a resize growing by one, is refused and changes nothing."""
    b = MemoryBudget(BudgetLimits(1000, 600))
    a = b.charge("a", 599, "Step request")
    with pytest.raises(BudgetExceeded) as err:                  # 599 + 2 > 600
        b.charge("a", 2, "Step reply")
    assert err.value.metadata["needed"] == "2"
    a.resize(600)                                                # grows by 1 to exactly the tenant limit
    with pytest.raises(BudgetExceeded) as err:
        a.resize(601)                                            # grows by 1 past it
    assert err.value.metadata == {"needed": "1", "held": "600", "tenant_limit": "600", "charged": "600",
                                  "limit": "1000"}
    assert "--tenant-rpc-memory-budget" in err.value.message and a.nbytes == 600
    with pytest.raises(BudgetExceeded):
        b.charge("a", 1, "Step reply")
    z = b.charge("b", 400, "Step request")                       # everyone: exactly 1000
    with pytest.raises(BudgetExceeded) as err:
        b.charge("c", 1, "Step request")
    assert err.value.metadata == {"needed": "1", "held": "0", "tenant_limit": "600", "charged": "1000",
                                  "limit": "1000"}
    assert "(--rpc-memory-budget)" in err.value.message and "tenant 'c'" not in err.value.message
    assert b.refused == {"Step reply": 2, "Step request": 2}     # by what was charged (a resize: its own what)
    assert (b.charged_bytes, b.tenants(), b.peak_bytes) == (1000, {"a": 600, "b": 400}, 1000)
    zero = b.charge("c", 0, "Step request")                      # a charge of nothing always fits, lists no tenant
    assert zero.nbytes == 0 and "c" not in b.tenants()
    for c in (a, z, zero):
        c.release()
    assert b.charged_bytes == 0 and b.tenants() == {}


def test_sizes_are_whole_bytes_and_never_negative() -> None:
    b = MemoryBudget(BudgetLimits(100, 100))
    c = b.charge("a", -50, "Step request")
    assert c.nbytes == 0 and b.charged_bytes == 0 and b.tenants() == {}
    c.resize(37.9)
    assert c.nbytes == 37 and b.tenant_bytes("a") == 37
    c.resize(-1)
    assert c.nbytes == 0 and b.charged_bytes == 0 and b.peak_bytes == 37
    with b.charge("a", 100, "x") as full:
        assert b.charged_bytes == 100 and full.budget is b
    assert b.charged_bytes == 0


def test_a_refusal_names_the_tenant_and_the_limit_that_was_full_in_mib() -> None:
    """The message of docs/SECURITY.md: what is needed (MiB, one decimal), who holds how much of which limit
    (MiB, whole), the flag to raise, and the advice: retry / split / omit_tables / close idle streams; a charge over
    the whole limit says so and says to send smaller requests."""
    b = MemoryBudget(BudgetLimits(200 * MIB, 80 * MIB))
    held = b.charge("team-a", 70 * MIB + MIB // 2, "Step request")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("team-a", 10 * MIB, "Step reply")
    assert err.value.message == (
        "Step reply needs 10.0 MiB of the manager's memory budget; tenant 'team-a' already hold 70.5 MiB of their "
        "80 MiB (--tenant-rpc-memory-budget): retry when fewer large requests are in flight, send smaller ones "
        "(split the step, omit_tables), or close idle streams")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("", 81 * MIB, "WatchEvents reply")
    assert err.value.message == (
        "WatchEvents reply needs 81.0 MiB of the manager's memory budget; that is more than the 80 MiB "
        "(--tenant-rpc-memory-budget) there is: send smaller requests (split the step, omit_tables) or raise "
        "--tenant-rpc-memory-budget")
    with pytest.raises(BudgetExceeded) as err:                  # exactly the whole tenant limit: there is that much
        b.charge("team-a", 80 * MIB, "Step request")
    assert err.value.message.endswith("already hold 70.5 MiB of their 80 MiB (--tenant-rpc-memory-budget): retry "
                                      "when fewer large requests are in flight, send smaller ones (split the step, "
                                      "omit_tables), or close idle streams")
    other = b.charge("", 80 * MIB, "Step request")
    with pytest.raises(BudgetExceeded) as err:
        b.charge("team-b", 50 * MIB, "StepStream session")
    assert err.value.message == (
        "StepStream session needs 50.0 MiB of the manager's memory budget; requests and sessions of all tenants "
        "hold 150.5 MiB of the manager's 200 MiB (--rpc-memory-budget): retry when fewer large requests are in "
        "flight, send smaller ones (split the step, omit_tables), or close idle streams")
    held.release()
    other.release()
    same = MemoryBudget(BudgetLimits(64 * MIB, 64 * MIB))      # equal limits: the global one is named
    with pytest.raises(BudgetExceeded) as err:
        same.charge("", 65 * MIB, "Echo request")
    assert err.value.message.endswith("that is more than the 64 MiB (--rpc-memory-budget) there is: send smaller "
                                      "requests (split the step, omit_tables) or raise --rpc-memory-budget")


@pytest.mark.parametrize("seed", range(3))
def test_a_calls_charges_follow_the_documented_lifecycle(seed) -> None:
    """admission.CallCharges against a model of docs/SECURITY.md#memory-budget: a request is 6 x its wire size and
    replaces the call's previous request and reply (a stream's next request); a reply is 4 x its bound, recomputed in
    place; done() gives both back, close() too and ends all charging; a refusal charges nothing new (a bigger next
    request has already released the previous one; a reply that does not grow stays as it was)."""
    from kvservice.server.admission import CallCharges

    rng = np.random.default_rng(300 + seed)
    limit = int(rng.integers(400, 900))
    b = MemoryBudget(BudgetLimits(limit, limit))
    other = b.charge("t", int(rng.integers(0, 100)), "other")      # the same tenant's other calls
    call = CallCharges(b, "t", "StepStream")
    req = rep = 0
    closed = False
    refusals = 0
    for i in range(400):
        op = 1.0 if i == 370 else rng.random()          # closed at 370: then nothing is charged any more
        if op < 0.4:
            w = int(rng.integers(0, limit // 4))
            rep = 0
            if closed:
                call.admit(w)
            elif 6 * w <= req or other.nbytes + 6 * w <= limit:
                call.admit(w)
                req = 6 * w
            else:
                with pytest.raises(BudgetExceeded):
                    call.admit(w)
                req = 0
                refusals += 1
        elif op < 0.75:
            r = int(rng.integers(0, limit // 3))
            if closed or other.nbytes + req + 4 * r <= limit:
                call.reserve_reply(r)
                rep = 0 if closed else 4 * r
            else:
                with pytest.raises(BudgetExceeded):
                    call.reserve_reply(r)
                refusals += 1
        elif op < 0.97 or i < 370:
            call.done()
            req = rep = 0
        else:
            call.close()
            req = rep = 0
            closed = True
        assert b.charged_bytes == other.nbytes + req + rep == b.tenant_bytes("t")
        assert (call.request.nbytes if call.request else 0, call.reply.nbytes if call.reply else 0) == (req, rep)
    assert refusals > 10
    call.close()
    other.release()
    assert b.charged_bytes == 0


def test_the_cgroup_limit_is_read_from_v2_then_v1_and_the_budget_derived_as_documented(tmp_path) -> None:
    """docs/SECURITY.md#memory-budget: the budget is 0.8 x (memory limit - 256 MiB - 56 bytes x max_total_slots -
    the 64 MiB reply cache), at least an eighth of the limit: 2,304 MiB for 4 GiB and 2^24 slot units."""
    from kvservice.server.budget import cgroup_memory_limit, derive_budget

    mib = 1 << 20
    assert derive_budget(4 << 30, 1 << 24) == 2304 * mib
    assert derive_budget(4 << 30, 1 << 24, reply_cache_bytes=0) == int(0.8 * (4096 - 256 - 896) * mib)
    assert derive_budget(8 << 30, 0, 64 * mib) == int(0.8 * (8192 - 256 - 64) * mib)
    edge = 8 * (256 + 64) * mib // 7                        # 0.8 x what is left == exactly an eighth of the limit
    assert derive_budget(edge, 0) in (edge // 8, int(0.8 * (edge - 320 * mib)))
    assert derive_budget(512 * mib, 1 << 24) == 64 * mib      # nothing left: an eighth
    v1, v2, absent = tmp_path / "v1", tmp_path / "v2", str(tmp_path / "absent")
    v1.write_text("3221225472\n")
    assert cgroup_memory_limit((absent, str(v1))) == 3 << 30                 # v2 absent: v1's
    v1.write_text("9223372036854771712\n")                                    # v1's "no limit"
    assert cgroup_memory_limit((absent, str(v1))) is None
    v2.write_text("max\n")
    assert cgroup_memory_limit((str(v2), str(tmp_path / "never-read"))) is None
    v2.write_text(str((1 << 60) - 1))
    assert cgroup_memory_limit((str(v2),)) == (1 << 60) - 1
    v2.write_text(str(1 << 60))                                               # from 2^60 on: "no limit"
    assert cgroup_memory_limit((str(v2),)) is None
    with pytest.raises(ValueError, match="got total 5, tenant 0"):
        BudgetLimits(5, 0)
    with pytest.raises(ValueError, match="got total -1, tenant 5"):
        BudgetLimits(-1, 5)
    assert BudgetLimits(1, 1).total_bytes == 1
    import inspect

    from kvservice.server.budget import DEFAULT_MEMORY_LIMIT
    files = inspect.signature(cgroup_memory_limit).parameters["files"].default
    assert files == ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")   # v2, then v1
    assert DEFAULT_MEMORY_LIMIT == 4 << 30                      # "or 4 GiB when there is none"
