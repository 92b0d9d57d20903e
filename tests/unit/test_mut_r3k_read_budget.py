"""kvservice/manager/read_budget.py ReadBudget with a clock moved by hand: exact balances against the module
docstring's token bucket (refilled at `share` CPU seconds per second, holding at most `burst`, a piece
starting while the balance is positive and charged afterwards; a spent tenant waits (1 ms - balance) / share
seconds), MAX_IN_FLIGHT pieces at once, the least recently seen tenant forgotten first, and the exact
RATE_LIMITED refusal. Shares and times are powers of two so every balance is exact in floating point."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.manager.read_budget import BUSY_WAIT, ReadBudget
from tests.clocks import ManualClock


def _wait(balance: float, share: float) -> float:
    """What a tenant with this (spent) balance is told to wait."""
    return (1e-3 - balance) / share


def test_a_debt_is_repaid_at_share_seconds_per_second_up_to_the_burst():
    clock = ManualClock(100.0)
    b = ReadBudget(share=0.25, burst=2.0, clock=clock)
    assert b.try_start("a") == 0                     # a new tenant starts with a full bucket: 2 s
    b.finish("a", 3.0)                               # 2 - 3 = -1 s
    assert b.try_start("a") == _wait(-1.0, 0.25)
    clock.now = 102.0                                # 2 s x 0.25 repaid: -0.5
    assert b.try_start("a") == _wait(-0.5, 0.25)
    clock.now = 103.5                                # -0.5 + 1.5 x 0.25 = -0.125
    assert b.try_start("a") == _wait(-0.125, 0.25)
    clock.now = 104.5                                # -0.125 + 0.25 = 0.125 > 0: starts
    assert b.try_start("a") == 0
    b.finish("a", 0.125)                             # exactly spent: a balance of 0 may not start
    assert b.try_start("a") == _wait(0.0, 0.25)
    clock.now = 1000.0                               # 0 + 895.5 x 0.25, held at the 2 s burst
    assert b.try_start("a") == 0
    b.finish("a", 2.0)
    assert b.try_start("a") == _wait(0.0, 0.25)
    b.charge("a", -5.0)                              # a negative charge counts as none
    assert b.try_start("a") == _wait(0.0, 0.25)
    b.charge("a", 0.5)                               # work found heavy late: charged without a start
    assert b.try_start("a") == _wait(-0.5, 0.25)
    assert b.try_start("other") == 0                 # another tenant: a bucket of its own


def test_a_share_above_one_refills_faster_than_the_clock():
    """share 4 (four cores' worth): 0.25 s of clock repays 1 s of CPU."""
    clock = ManualClock(8.0)
    b = ReadBudget(share=4.0, burst=1.0, clock=clock)
    b.charge("t", 3.0)                               # 1 - 3 = -2
    assert b.try_start("t") == _wait(-2.0, 4.0)
    clock.now = 8.25                                 # -2 + 0.25 x 4 = -1
    assert b.try_start("t") == _wait(-1.0, 4.0)
    clock.now = 8.75                                 # -1 + 0.5 x 4 = 1: starts
    assert b.try_start("t") == 0


def test_pieces_in_flight_are_limited_per_tenant():
    b = ReadBudget(share=0.5, burst=4.0, clock=ManualClock(), max_in_flight=2)
    assert [b.try_start("a"), b.try_start("a"), b.try_start("a")] == [0, 0, BUSY_WAIT]
    assert b.try_start("b") == 0                     # another tenant's pieces count apart
    b.finish("a", 0.0)
    assert [b.try_start("a"), b.try_start("a")] == [0, BUSY_WAIT]
    b.finish("a", 0.0)
    b.finish("a", 0.0)
    b.finish("a", 0.0)                               # one finish too many changes nothing
    assert [b.try_start("a"), b.try_start("a"), b.try_start("a")] == [0, 0, BUSY_WAIT]


def test_the_least_recently_seen_tenant_is_forgotten_first_and_starts_full_again():
    """max_tenants 2: two tenants are both remembered; a third makes the least recently seen one forgotten."""
    clock = ManualClock(1.0)
    b = ReadBudget(share=0.5, burst=1.0, clock=clock, max_tenants=2)
    for t in ("a", "x"):
        b.charge(t, 3.0)                             # both in debt: 1 - 3 = -2
    assert b.try_start("a") == _wait(-2.0, 0.5)
    assert b.try_start("x") == _wait(-2.0, 0.5)      # two tenants, both remembered; a is now the least recent
    assert b.try_start("b") == 0                     # a third: a is forgotten
    assert b.try_start("x") == _wait(-2.0, 0.5)      # x is not (and is now the most recent)
    assert b.try_start("a") == 0                     # a full bucket again; b, the least recent, is forgotten
    b.charge("b", 0.0)                               # b back with a full bucket: a charge forgets nobody...
    assert b.try_start("x") == _wait(-2.0, 0.5)      # ...the next start forgets the least recent, a, not x
    assert b.try_start("a") == 0


def test_share_zero_is_no_limit_and_bad_settings_are_refused_with_both_flags():
    b = ReadBudget(share=0, burst=1.0, clock=ManualClock(), max_in_flight=1)
    b.charge("a", 100.0)
    assert [b.try_start("a") for _ in range(3)] == [0, 0, 0]
    b.finish("a", 100.0)
    with b.piece("a", "ScorePrefix"):
        pass
    assert b.refused == 0
    for share, burst in ((-0.5, 1.0), (0.5, 0.0), (0.5, -1.0)):
        with pytest.raises(InvalidArgument) as exc:
            ReadBudget(share=share, burst=burst)
        assert exc.value.message == (f"--tenant-read-share must be >= 0 and --tenant-read-burst > 0, got {share} and "
                                     f"{burst}")


def test_a_refused_piece_is_rate_limited_with_the_exact_wait_and_runs_nothing():
    clock = ManualClock(50.0)
    b = ReadBudget(share=0.125, burst=0.5, clock=clock, max_in_flight=3)
    b.charge("", 1.5)                                # 0.5 - 1.5 = -1
    ran = []
    with pytest.raises(ResourceExhausted) as exc:
        with b.piece("", "ScorePrefix"):
            ran.append(1)
    wait = _wait(-1.0, 0.125)                        # 8.008 s
    assert ran == [] and b.refused == 1
    assert exc.value.message == (
        "ScorePrefix: this manager's callers used its share of the manager's CPU for heavy reads (ScorePrefix, KV "
        "event resets and catch-up: --tenant-read-share 0.125 of a core, bursts of --tenant-read-burst 0.5 s, 3 at "
        "once); retry in 8.01 s")
    assert exc.value.reason == "RATE_LIMITED" and exc.value.metadata == {"retry_after_seconds": "8.008"}
    assert f"{wait:.3f}" == "8.008"
    b.charge("tok", 1.0)
    with pytest.raises(ResourceExhausted) as exc:
        with b.piece("tok", "WatchEvents reset"):
            pass
    assert exc.value.message.startswith("WatchEvents reset: token 'tok' used its share")
    assert exc.value.message.endswith(f"retry in {_wait(-0.5, 0.125):.2f} s") and b.refused == 2


def test_a_piece_that_ran_frees_its_place_in_flight():
    b = ReadBudget(share=0.5, burst=1.0, clock=ManualClock(), max_in_flight=1)
    with b.piece("a", "ScorePrefix"):
        assert b.try_start("a") == BUSY_WAIT         # the piece holds the tenant's one place
    assert b.try_start("a") == 0                     # given back (its CPU time charged: far under the 1 s burst)


def test_a_piece_is_charged_the_cpu_time_it_took_and_a_busy_tenant_is_told_the_busy_wait():
    """A piece is charged the CPU seconds of its own block only: a burst a little below what this thread has used
    so far still leaves credit after an empty block. A tenant whose pieces are all running is refused with
    BUSY_WAIT (0.05 s, under a second)."""
    import time

    while time.thread_time() < 0.05:                   # this thread has used at least 50 ms of CPU
        sum(range(10_000))
    burst = time.thread_time() / 2
    b = ReadBudget(share=0.5, burst=burst, clock=ManualClock(), max_in_flight=1)
    with b.piece("a", "ScorePrefix"):
        pass
    assert b.try_start("a") == 0                     # charged microseconds, not the thread's whole CPU time
    with pytest.raises(ResourceExhausted) as exc:
        with b.piece("a", "ScorePrefix"):
            pass
    assert exc.value.message.endswith(", 1 at once); retry in 0.05 s")
    assert exc.value.metadata == {"retry_after_seconds": f"{BUSY_WAIT:.3f}"} and BUSY_WAIT == 0.05
