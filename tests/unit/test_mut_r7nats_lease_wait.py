"""Lease.wait_valid waits for a renewal (kvservice/state/nats/leader.py docstring: "Return once the lease is valid;
... LeaseLapsed after `timeout` seconds"): a lapsed lease renewed while a caller waits (under the lease's condition,
as the renewer does) lets the caller go on, even with less than a second to wait; nothing is refused early."""

from __future__ import annotations

import asyncio
import threading

from tests.unit.test_mut_r7nats_lease import _lease


def test_a_renewal_during_the_wait_lets_the_caller_go_on():
    lease, clock = _lease(ttl=4.0, margin=0.25)
    asyncio.run(lease._take(None))
    clock.now = lease.valid_until + 0.5                    # lapsed
    checked = threading.Event()
    base = lease.clock

    def watched_clock():
        if threading.current_thread() is waiter_thread[0]:
            checked.set()                                  # the waiter has looked at least once
        return base()
    lease.clock = watched_clock
    waiter_thread, outcome = [None], []

    def waiter():
        try:
            lease.wait_valid(0.99)
            outcome.append("valid")
        except Exception as err:                          # the outcome is what is checked
            outcome.append(type(err).__name__)
    t = threading.Thread(target=waiter)
    waiter_thread[0] = t
    t.start()
    assert checked.wait(30.0)
    with lease._changed:                                   # only free while the waiter waits, as for the renewer
        lease.valid_until = clock.now + 3.75
        lease._changed.notify_all()
    t.join(30.0)
    assert outcome == ["valid"]
