"""What a Lease says about itself, on a stand-in link and key (no server) and an injected clock
(kvservice/state/nats/leader.py, Lease docstrings): a new lease holds nothing; a take writes this node's JSON value
and holds the lease until clock() at the take + ttl - margin; check() passes inside that bound, raises LeaseLapsed
with the exact lateness past it, LeaseLost naming why (or "standby") when not held; remaining_seconds is what is
left (0 outside); wait_valid returns at once when valid, raises LeaseLost at once when not held, and waits out a
lapse for its timeout; lose(why) gives the lease up once, telling on_lost and logging it."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

import nats.js.errors
import pytest

from kvservice.state.nats.leader import KEY, Lease, LeaseConfig, LeaseLapsed, LeaseLost
from tests.clocks import ManualClock
from tests.unit.test_mut_r3sn_lease import RecordingLink


class FakeKV:
    """create/update record (key, value, last) and answer the next revision, or raise `refuse`."""

    def __init__(self, refuse=None) -> None:
        self.writes, self.rev, self.refuse = [], 40 + secrets.randbelow(100), refuse

    async def create(self, key, value):
        return await self._write(key, value, None)

    async def update(self, key, value, last):
        return await self._write(key, value, last)

    async def _write(self, key, value, last):
        self.writes.append((key, json.loads(value), last))
        if self.refuse is not None:
            raise self.refuse
        self.rev += 1
        return self.rev


def _lease(ttl=4.0, margin=0.25, kv=None):
    clock = ManualClock(1000.0 + secrets.randbelow(1000))
    lease = Lease(RecordingLink(2.0), LeaseConfig(ttl_seconds=ttl, renew_seconds=1.0, margin_seconds=margin),
                  "node-" + secrets.token_hex(2), address="10.0.0.9:50051", clock=clock)
    lease.kv = kv or FakeKV()
    return lease, clock


def test_a_new_lease_holds_nothing_and_says_it_is_a_standby():
    lease, _ = _lease()
    assert (lease.held, lease.lost, lease.epoch, lease.revision, lease.renewals, lease.renew_failures,
            lease.holder) == (False, None, 0, 0, 0, 0, None)
    assert lease.remaining_seconds == 0.0 and lease.take_due() is None
    with pytest.raises(LeaseLost) as err:
        lease.check()
    assert (type(err.value), err.value.message, err.value.reason) == (
        LeaseLost, "this manager is not the leader (standby)", "LEASE_LOST")
    with pytest.raises(LeaseLost):
        lease.wait_valid(60.0)                        # not held: at once, no waiting for a renewal


@pytest.mark.parametrize("revision", [None, 17])
def test_a_take_writes_this_nodes_value_and_holds_until_ttl_minus_margin(revision):
    lease, clock = _lease(ttl=4.0, margin=0.25)
    assert asyncio.run(lease._take(revision)) is True
    (key, value, last), = lease.kv.writes
    assert (key, value, last) == (KEY, {"node": lease.node, "address": "10.0.0.9:50051", "epoch": 0}, revision)
    assert lease.held and lease.revision == lease.kv.rev and lease.valid_until == clock.now + 3.75
    lease.check()
    lease.wait_valid(0.0)
    clock.now += 1.5
    assert lease.remaining_seconds == pytest.approx(2.25)
    clock.now += 2.25                                 # exactly at the bound: lapsed (late 0)
    assert lease.remaining_seconds == 0.0
    with pytest.raises(LeaseLapsed) as err:
        lease.check()
    assert (err.value.message, err.value.reason) == (
        "the leader lease lapsed 0.00 s ago and is not renewed yet (NATS unreachable or this process was paused)",
        "LEASE_LAPSED")
    clock.now += 1.239
    with pytest.raises(LeaseLapsed, match=r"^the leader lease lapsed 1\.24 s ago and"):
        lease.wait_valid(0.05)


def test_a_take_another_contender_won_holds_nothing():
    lease, _ = _lease(kv=FakeKV(refuse=nats.js.errors.KeyWrongLastSequenceError()))
    assert asyncio.run(lease._take(5)) is False
    assert not lease.held and lease.revision == 0 and lease.remaining_seconds == 0.0


def test_losing_the_lease_tells_once_and_says_why(caplog):
    lease, _ = _lease()
    asyncio.run(lease._take(None))
    told = []
    lease.epoch, lease._on_lost = 7, told.append
    with caplog.at_level(logging.WARNING, logger="kvservice.state.nats.leader"):
        lease.lose("fenced by epoch 8")
        lease.lose("again")
    assert told == ["fenced by epoch 8"] and not lease.held and lease.lost == "fenced by epoch 8"
    assert [r.getMessage() for r in caplog.records if r.name == "kvservice.state.nats.leader"] == \
        ["leadership lost (epoch 7): fenced by epoch 8"]
    with pytest.raises(LeaseLost) as err:
        lease.check()
    assert type(err.value) is LeaseLost and err.value.message == "this manager is not the leader (fenced by epoch 8)"
    assert lease.remaining_seconds == 0.0 and lease.try_acquire() is False      # lost: never taken again
