"""The leader lease's whole contract on stand-in links and keys (no server) with an injected clock, the oracle being
kvservice/state/nats/leader.py's module and method docstrings plus hand-computed values:

- LeaseConfig refuses each bad timing with its exact message, boundaries included (margin in (0, ttl/4), renew in
  (0, ttl/3], poll in (0, ttl], lapse >= 0), and its bucket TTL is ttl + lapse.
- the renewer (``_renew_loop``): a failed renewal logs what failed and either the time left (while clock() is below
  valid_until) or "lapsed" (from valid_until on, the same bound check() uses); every second failure in a row
  reconnects to another server; a renewal landing at or after valid_until logs the lapse; a refused renewal adopts
  the key's revision when its value is still this process's and loses the lease otherwise; a lapse longer than
  lapse_seconds loses it, naming how long nothing was renewed.
- release() deletes the key at the held revision and logs the epoch; a refused delete logs when the key lapses.
- a standby takes a revision that stood still for a whole TTL (not earlier), and the one-call wrappers
  (try_acquire, current) pass the documented timeouts and names to the link.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import threading
from types import SimpleNamespace

import nats.errors
import nats.js.errors
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.state.nats import leader as leader_module
from kvservice.state.nats.config import StoreError
from kvservice.state.nats.leader import KEY, Holder, Lease, LeaseConfig, LeaseLapsed, LeaseLost
from tests.clocks import ManualClock
from tests.unit.test_mut_r3sn_lease import RecordingLink

LOGGER = "kvservice.state.nats.leader"


class Unanswered(nats.errors.Error):
    """A NATS error of the test's own, so its class name and text are known here."""

    def __str__(self) -> str:
        return self.args[0]


class RunningLink(RecordingLink):
    """Records call(coro, timeout, what) like RecordingLink, but runs the coroutine (on a loop of its own)."""

    def call(self, coro, timeout, what="a request"):
        self.calls.append((coro.__qualname__, timeout, what))
        if self.error is not None:
            coro.close()
            raise self.error
        return asyncio.run(coro)


class ScriptKV:
    """update(key, value, last) records its arguments and runs the next step of `script` (a function that may move
    the clock and returns a revision or an exception to raise); with the script done it ends the renewer (loses the
    lease) and answers a revision. get answers `entries` in turn (an entry or an exception); delete records."""

    def __init__(self, script=(), entries=()) -> None:
        self.script, self.entries = list(script), list(entries)
        self.updates, self.creates, self.deletes, self.lease = [], [], [], None

    async def update(self, key, value, last):
        self.updates.append((key, json.loads(value), last))
        if not self.script:
            self.lease._lose("script done")
            return 10_000
        out = self.script.pop(0)()
        if isinstance(out, BaseException):
            raise out
        return out

    async def create(self, key, value):
        self.creates.append((key, json.loads(value)))
        return 77

    async def get(self, key):
        out = self.entries.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    async def delete(self, key, last):
        self.deletes.append((key, last))


def _entry(node: str, revision: int, epoch: int = 0) -> SimpleNamespace:
    return SimpleNamespace(value=json.dumps({"node": node, "address": "", "epoch": epoch}).encode(),
                           revision=revision)


class Reconnects:
    """A stand-in nats-py client: force_reconnect counts; connected_url is what the warning names."""

    def __init__(self, netloc: str | None) -> None:
        self.count = 0
        self.connected_url = SimpleNamespace(netloc=netloc) if netloc else None

    async def force_reconnect(self) -> None:
        self.count += 1


def _lease(kv, ttl=4.0, margin=0.25, lapse=12.0, renew=0.01, netloc="n2.example:4222"):
    clock = ManualClock(1000.0 + secrets.randbelow(1000))
    link = RunningLink(2.0)
    link.nc = Reconnects(netloc)
    lease = Lease(RecordingLink(2.0), LeaseConfig(ttl_seconds=ttl, renew_seconds=renew, margin_seconds=margin,
                                                  lapse_seconds=lapse),
                  "node-" + secrets.token_hex(3), address="10.0.0.9:50051", clock=clock)
    lease.link, lease.kv, kv.lease = link, kv, lease
    return lease, clock, link


def _messages(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]


# ---- LeaseConfig -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(ttl_seconds=2.0, margin_seconds=0.5), "margin_seconds must be in (0, ttl/4), got 0.5"),
    (dict(ttl_seconds=2.0, margin_seconds=0.0), "margin_seconds must be in (0, ttl/4), got 0.0"),
    (dict(ttl_seconds=2.0, margin_seconds=-0.1), "margin_seconds must be in (0, ttl/4), got -0.1"),
    (dict(ttl_seconds=3.0, renew_seconds=1.25), "renew_seconds (1.25) must be in (0, ttl/3] (ttl 3 s): a leader "
                                                "must be able to miss two renewals"),
    (dict(ttl_seconds=3.0, renew_seconds=0.0), "renew_seconds (0) must be in (0, ttl/3] (ttl 3 s): a leader "
                                               "must be able to miss two renewals"),
    (dict(ttl_seconds=3.0, poll_seconds=3.5), "poll_seconds must be in (0, ttl], got 3.5"),
    (dict(ttl_seconds=3.0, poll_seconds=0.0), "poll_seconds must be in (0, ttl], got 0.0"),
    (dict(lapse_seconds=-0.5), "lapse_seconds must be >= 0, got -0.5"),
])
def test_lease_config_refuses_each_bad_timing_with_its_message(kwargs, message):
    with pytest.raises(InvalidArgument) as err:
        LeaseConfig(**kwargs)
    assert err.value.message == message and err.value.reason == "INVALID_ARGUMENT"


def test_lease_config_takes_each_bound_it_documents_as_allowed():
    c = LeaseConfig(ttl_seconds=3.0, renew_seconds=1.0, poll_seconds=3.0, margin_seconds=0.7, lapse_seconds=0.0)
    assert (c.renew_seconds, c.poll_seconds, c.margin_seconds, c.bucket_ttl_seconds) == (1.0, 3.0, 0.7, 3.0)
    assert LeaseConfig(ttl_seconds=2.5, lapse_seconds=7.25).bucket_ttl_seconds == 9.75
    d = LeaseConfig()
    assert (d.ttl_seconds, d.renew_seconds, d.poll_seconds, d.margin_seconds, d.lapse_seconds) == (
        2.0, 0.5, 0.1, 0.1, 12.0)


# ---- renewing -----------------------------------------------------------------------------------------------------
def test_the_renewer_logs_time_left_until_valid_until_and_lapsed_from_it_on(caplog):
    steps = []
    kv = ScriptKV(steps)
    lease, clock, link = _lease(kv)
    assert asyncio.run(lease._take(None)) is True          # create -> revision 77
    r0, vu0 = lease.revision, lease.valid_until
    assert (r0, vu0) == (77, clock.now + 3.75)
    told = []
    lease.epoch, lease._on_lost = 5, told.append

    def at(t, out):
        def step():
            clock.now = t
            return out
        return step
    vu1 = vu0 + 3.75                                       # renewed with sent = vu0
    steps += [at(vu0 - 0.5, TimeoutError()),               # 0.50 s left
              at(vu0, Unanswered("no reply 1")),           # exactly at the bound: lapsed; 2nd in a row: reconnect
              at(vu0, 123),                                # lands at the bound: a lapse of 0.00 s
              at(vu1 - 1.25, OSError("reset")),            # failures counted again from 0: no reconnect
              at(vu1 - 1.25, nats.js.errors.KeyWrongLastSequenceError()),   # ours landed: adopt 124
              at(vu1 - 1.25, TimeoutError()),              # the 2nd failure in a row again: reconnect
              at(vu1 - 1.25, nats.js.errors.KeyWrongLastSequenceError())]   # someone else's: lost
    kv.script, kv.entries = steps, [_entry(lease.node, 124), _entry("node-other", 130, epoch=6)]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(lease._renew_loop())
    value = {"node": lease.node, "address": "10.0.0.9:50051", "epoch": 5}
    assert kv.updates == [(KEY, value, r) for r in (r0, r0, r0, 123, 123, 124, 124)]
    lost = "another manager holds the leader key (renewal refused: its revision moved)"
    assert _messages(caplog) == [
        ("WARNING", "lease renewal failed (TimeoutError: ); 0.50 s left"),
        ("WARNING", "lease renewal failed (Unanswered: no reply 1); lapsed: serving nothing until a renewal "
                    "succeeds"),
        ("WARNING", "lease renewals unanswered through n2.example:4222: reconnecting to another NATS server"),
        ("WARNING", "lease renewed after a lapse of 0.00 s: serving again"),
        ("WARNING", "lease renewal failed (OSError: reset); 1.25 s left"),
        ("WARNING", "lease renewal failed (TimeoutError: ); 1.25 s left"),
        ("WARNING", "lease renewals unanswered through n2.example:4222: reconnecting to another NATS server"),
        ("WARNING", f"leadership lost (epoch 5): {lost}")]
    assert link.nc.count == 2 and told == [lost] and (lease.held, lease.lost) == (False, lost)
    assert (lease.renewals, lease.renew_failures, lease.revision, lease.valid_until) == (1, 4, 124, vu1)


def test_a_renewal_before_the_bound_logs_no_lapse_and_moves_the_bound(caplog):
    kv = ScriptKV()
    lease, clock, _ = _lease(kv)
    asyncio.run(lease._take(None))
    vu0 = lease.valid_until
    clock.now = vu0 - 0.5
    told = []
    lease.epoch, lease._on_lost = 2, told.append
    kv.script = [lambda: 200]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(lease._renew_loop())
    assert _messages(caplog) == [("WARNING", "leadership lost (epoch 2): script done")]
    assert (lease.renewals, lease.revision, lease.valid_until) == (2, 200, vu0 - 0.5 + 3.75)
    assert [last for _, _, last in kv.updates] == [77, 200]


def test_a_refused_renewal_whose_key_cannot_be_read_loses_the_lease():
    kv = ScriptKV([lambda: nats.js.errors.KeyWrongLastSequenceError()], [nats.js.errors.KeyNotFoundError()])
    lease, _, _ = _lease(kv)
    asyncio.run(lease._take(None))
    asyncio.run(lease._renew_loop())
    assert lease.lost == "another manager holds the leader key (renewal refused: its revision moved)"
    assert lease.renewals == 0 and lease.renew_failures == 0


def test_a_lapse_longer_than_lapse_seconds_loses_the_lease_saying_for_how_long(caplog):
    kv = ScriptKV()
    lease, clock, link = _lease(kv, ttl=4.0, margin=0.25, lapse=12.0, netloc=None)
    asyncio.run(lease._take(None))
    vu = lease.valid_until
    clock.now = vu + 12.0                                  # exactly lapse_seconds past: one more try

    def later():
        clock.now = vu + 12.5
        return Unanswered("gone")
    kv.script = [later]
    told = []
    lease.epoch, lease._on_lost = 3, told.append
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(lease._renew_loop())
    why = "lease lapsed: no renewal succeeded for 16.5 s"   # 12.5 past the bound + the 4 s TTL
    assert told == [why] and len(kv.updates) == 1 and link.nc.count == 0
    assert _messages(caplog) == [
        ("WARNING", "lease renewal failed (Unanswered: gone); lapsed: serving nothing until a renewal succeeds"),
        ("WARNING", f"leadership lost (epoch 3): {why}")]


def test_two_failures_reconnect_naming_an_unknown_server_when_none_is_connected(caplog):
    kv = ScriptKV([lambda: TimeoutError(), lambda: TimeoutError()])
    lease, clock, link = _lease(kv, netloc=None)
    asyncio.run(lease._take(None))
    clock.now = lease.valid_until + 1.0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(lease._renew_loop())
    assert link.nc.count == 1
    assert ("WARNING", "lease renewals unanswered through ?: reconnecting to another NATS server") in \
        _messages(caplog)


def test_a_client_without_force_reconnect_is_left_as_it_is(caplog):
    lease, _, link = _lease(ScriptKV())
    link.nc = SimpleNamespace(connected_url=None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(lease._move_to_another_server())
    assert _messages(caplog) == []


# ---- releasing -----------------------------------------------------------------------------------------------------
def test_release_deletes_the_key_at_the_held_revision_and_logs_the_epoch(caplog):
    kv = ScriptKV()
    lease, _, link = _lease(kv)
    asyncio.run(lease._take(None))
    lease.epoch = 41
    lease._renewer = renewer = concurrent.futures.Future()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        lease.release()
    assert renewer.cancelled() and kv.deletes == [(KEY, 77)]
    assert link.calls == [("ScriptKV.delete", 3.0, "releasing the leader key")]
    assert _messages(caplog) == [("INFO", "leader key released (epoch 41)")]
    assert (lease.held, lease.lost) == (False, "released")
    lease.release()                                        # not held any more: nothing deleted again
    assert kv.deletes == [(KEY, 77)]


@pytest.mark.parametrize("error", [StoreError("releasing the leader key: timed out"), Unanswered("no responders")])
def test_a_refused_release_says_when_the_key_lapses(caplog, error):
    kv = ScriptKV()
    lease, _, link = _lease(kv, ttl=2.5, margin=0.5)
    asyncio.run(lease._take(None))
    link.error = error
    with caplog.at_level(logging.INFO, logger=LOGGER):
        lease.release()
    assert _messages(caplog) == [("WARNING", f"could not release the leader key ({error}); it lapses in 2.5 s")]
    assert (lease.held, lease.lost) == (False, "released")


def test_release_keeps_the_reason_a_lease_was_lost():
    lease, _, link = _lease(ScriptKV())
    asyncio.run(lease._take(None))
    lease.lose("fenced by epoch 9")
    lease.release()
    assert lease.lost == "fenced by epoch 9" and link.calls == []


# ---- taking ------------------------------------------------------------------------------------------------------
def test_a_standby_takes_a_revision_that_stood_still_for_a_whole_ttl_not_earlier(caplog):
    other = "node-" + secrets.token_hex(3)
    kv = ScriptKV([lambda: 300], [_entry(other, 50, epoch=3)] * 3)
    lease, clock, _ = _lease(kv, ttl=4.0, margin=0.25)
    t0 = clock.now
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert asyncio.run(lease._try_acquire()) is False
        assert lease.take_due() == t0 + 4.0 and lease.holder == Holder(other, "", 3, 50)
        clock.now = t0 + 3.75
        assert asyncio.run(lease._try_acquire()) is False and lease.take_due() == t0 + 4.0
        assert kv.updates == []
        clock.now = t0 + 4.0                               # unchanged for exactly a whole TTL: taken
        assert asyncio.run(lease._try_acquire()) is True
    assert (lease.revision, lease.valid_until, lease.take_due()) == (300, t0 + 7.75, None)
    assert kv.updates == [(KEY, {"node": lease.node, "address": "10.0.0.9:50051", "epoch": 0}, 50)]
    assert _messages(caplog) == [("INFO", f"leader {other} (epoch 3) did not renew revision 50 for 4.00 s; "
                                          "taking over")]


def test_a_standby_waits_again_after_the_revision_moves_and_takes_our_own_landed_key_at_once():
    other = "node-" + secrets.token_hex(3)
    kv = ScriptKV([lambda: 301, lambda: 302], [_entry(other, 50), _entry(other, 51), _entry(other, 51)])
    lease, clock, _ = _lease(kv)
    t0 = clock.now
    assert asyncio.run(lease._try_acquire()) is False
    clock.now = t0 + 3.0
    assert asyncio.run(lease._try_acquire()) is False and lease.take_due() == t0 + 7.0   # 51 first seen at t0+3
    clock.now = t0 + 6.5
    assert asyncio.run(lease._try_acquire()) is False and kv.updates == []
    kv.entries = [_entry(lease.node, 60)]
    assert asyncio.run(lease._try_acquire()) is True and lease.revision == 301
    assert kv.updates[-1][2] == 60 and lease.take_due() is None and lease.valid_until == t0 + 6.5 + 3.75


def test_an_absent_key_is_created_and_an_unreadable_one_starts_the_wait_over():
    kv = ScriptKV([], [_entry("x", 50), Unanswered("cut off"), nats.js.errors.KeyNotFoundError()])
    lease, _, _ = _lease(kv)
    assert asyncio.run(lease._try_acquire()) is False and lease.take_due() is not None
    with pytest.raises(Unanswered):
        asyncio.run(lease._try_acquire())
    assert lease.take_due() is None
    assert asyncio.run(lease._try_acquire()) is True
    assert kv.creates == [(KEY, {"node": lease.node, "address": "10.0.0.9:50051", "epoch": 0})]
    assert lease.revision == 77


def test_try_acquire_and_current_make_one_call_each_with_the_documented_wait_and_name():
    kv = ScriptKV([], [nats.js.errors.KeyNotFoundError(), nats.js.errors.KeyNotFoundError(), _entry("m9", 8, 4)])
    lease, _, link = _lease(kv)
    assert lease.current() is None
    assert lease.try_acquire() is True                   # absent: created
    assert link.calls == [("ScriptKV.get", 3.0, "reading the leader key"),
                          ("Lease._try_acquire", 5.0, "reading (and maybe taking) the leader key")]
    assert lease.try_acquire() is True and len(link.calls) == 2       # held: no call
    assert lease.current() == Holder("m9", "", 4, 8) == lease.holder
    lease.lose("x")
    assert lease.try_acquire() is False and len(link.calls) == 3


class RecordingCondition:
    """The lease's condition, recording each wait's timeout (so the poll period is counted, not timed)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond, self.waits = cond, []

    def __enter__(self):
        return self.cond.__enter__()

    def __exit__(self, *exc):
        return self.cond.__exit__(*exc)

    def wait(self, timeout):
        self.waits.append(timeout)
        return self.cond.wait(timeout)


def test_wait_valid_looks_again_at_least_every_50_ms_while_lapsed():
    """A lease made valid again without a notify (the clock moved back, a renewal seen later) is noticed within
    one poll: every wait is at most 0.05 s."""
    lease, clock, _ = _lease(ScriptKV())
    asyncio.run(lease._take(None))
    clock.now = lease.valid_until + 0.5
    lease._changed = rec = RecordingCondition(lease._changed)
    with pytest.raises(LeaseLapsed):
        lease.wait_valid(0.3)
    assert rec.waits and max(rec.waits) <= 0.05


class PacedAsyncio:
    """Stands in for the asyncio module inside leader.py: sleeps and wait_for timeouts are recorded (and not
    waited), run_coroutine_threadsafe records its loop and closes the coroutine unrun."""

    def __init__(self) -> None:
        self.sleeps, self.timeouts, self.started = [], [], []

    async def sleep(self, seconds):
        self.sleeps.append(seconds)
        await asyncio.sleep(0)

    async def wait_for(self, aw, timeout):
        self.timeouts.append(timeout)
        return await aw

    def run_coroutine_threadsafe(self, coro, loop):
        self.started.append((coro.__qualname__, loop))
        coro.close()
        return "renewer"


@pytest.mark.parametrize(("renew", "wait", "pause"), [(0.01, 0.25, 0.0025), (1.0, 1.0, 0.1), (0.2, 0.25, 0.05)])
def test_the_renewer_sleeps_a_period_waits_at_least_a_quarter_second_and_pauses_after_a_failure(
        monkeypatch, renew, wait, pause):
    paced = PacedAsyncio()
    monkeypatch.setattr(leader_module, "asyncio", paced)
    kv = ScriptKV([lambda: TimeoutError(), lambda: 90])
    lease, _, _ = _lease(kv, ttl=4.0, renew=renew)
    asyncio.run(lease._take(None))
    asyncio.run(lease._renew_loop())
    assert paced.timeouts == [wait, wait, wait]            # failed, renewed, (script done)
    assert paced.sleeps == [renew, pause, renew]


def test_start_renewing_needs_the_lease_then_runs_the_renewer_on_the_links_loop(monkeypatch):
    paced = PacedAsyncio()
    monkeypatch.setattr(leader_module, "asyncio", paced)
    lease, _, link = _lease(ScriptKV())
    link.loop = object()
    with pytest.raises(LeaseLost) as err:
        lease.start_renewing(3, print)
    assert (type(err.value), err.value.message) == (LeaseLost, "start_renewing without holding the lease")
    assert paced.started == [] and lease.epoch == 0
    asyncio.run(lease._take(None))
    told = []
    lease.start_renewing(12, told.append)
    assert paced.started == [("Lease._renew_loop", link.loop)] and lease._renewer == "renewer"
    assert lease.epoch == 12 and lease._on_lost == told.append


def test_wait_valid_with_no_time_left_raises_without_waiting(monkeypatch):
    clock = ManualClock(50.0)
    monkeypatch.setattr(leader_module, "time", SimpleNamespace(monotonic=clock))
    lease, lclock, _ = _lease(ScriptKV())
    asyncio.run(lease._take(None))
    lclock.now = lease.valid_until
    rec = RecordingCondition(lease._changed)

    def no_wait(timeout):
        rec.waits.append(timeout)
        raise AssertionError("waited with no time left")
    rec.wait = no_wait
    lease._changed = rec
    with pytest.raises(LeaseLapsed):
        lease.wait_valid(0.0)
    assert rec.waits == []
