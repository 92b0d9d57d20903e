"""Lease opening its bucket through a recording stand-in for NatsLink (no server needed): the one link.call it makes
(the coroutine, the wait, what it is called) and how a NATS error there is reported (the StoreError names the
bucket, the error's class and its text)."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import nats.errors
import pytest

from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.leader import Lease, LeaseConfig


class BucketRefused(nats.errors.Error):
    """A NATS error of the test's own, so that its class name and text are known here."""


class RecordingLink:
    """Has what Lease.__init__ uses of a NatsLink: config and call(coro, timeout, what), which records its
    arguments, closes the coroutine unrun and returns `result` or raises `error`."""

    def __init__(self, request_seconds: float, error: Exception | None = None) -> None:
        self.config = NatsConfig(("nats://127.0.0.1:4222",), name="t" + secrets.token_hex(5),
                                 request_seconds=request_seconds, append_seconds=max(15.0, request_seconds))
        self.error, self.result, self.calls = error, SimpleNamespace(), []

    def call(self, coro, timeout, what="a request"):
        self.calls.append((coro.__qualname__, timeout, what))
        coro.close()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize(("request_seconds", "wait"), [(0.5, 10.0), (2.0, 10.0), (10 / 3, 10.0), (5.0, 15.0),
                                                       (7.25, 21.75)])
def test_opening_the_lease_bucket_waits_three_requests_but_at_least_ten_seconds(request_seconds, wait):
    """One call: _ensure_bucket, waited max(10 s, 3 x request_seconds) (hand-computed here), named after the
    bucket KVS_<name>_leader; its result is the lease's kv."""
    lk = RecordingLink(request_seconds)
    lease = Lease(lk, LeaseConfig(), "node-a")
    bucket = f"KVS_{lk.config.name}_leader"
    assert lk.calls == [("Lease._ensure_bucket", wait, f"opening the lease bucket {bucket}")]
    assert lease.kv is lk.result and lease.bucket == bucket


def test_a_nats_error_opening_the_bucket_is_a_store_error_naming_the_bucket_the_error_class_and_text():
    """A nats.errors.Error from the call -> StoreError "opening the lease bucket B: <ErrorClass>: <its text>"."""
    text = "refused-" + secrets.token_hex(4)
    lk = RecordingLink(2.0, error=BucketRefused(text))
    with pytest.raises(StoreError) as caught:
        Lease(lk, LeaseConfig(), "node-a")
    assert str(caught.value) == f"opening the lease bucket KVS_{lk.config.name}_leader: BucketRefused: {text}"
