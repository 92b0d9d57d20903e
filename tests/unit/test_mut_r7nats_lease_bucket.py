"""Lease._ensure_bucket's whole contract on a stand-in JetStream context (kvservice/state/nats/leader.py): an existing
bucket is used as it is; a missing one is created with exactly the documented KV config (TTL = ttl + lapse_seconds,
history 1, the deployment's replicas, file storage, "kvservice leader lease"); a creation refused because another
manager made it meanwhile takes that one; a real refusal is a StoreError naming the bucket, the replicas and the
server's description (or the error itself when it has none)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import nats.js.errors
import pytest
from nats.js import api

from kvservice.state.nats.config import StoreError
from kvservice.state.nats.leader import Lease, LeaseConfig
from tests.unit.test_mut_r3sn_lease import RecordingLink


class FakeJS:
    """key_value answers from `buckets` (BucketNotFoundError if absent); create_key_value records its config and
    raises `refuse` (after `meanwhile` makes the bucket, as another manager would) or makes the bucket."""

    def __init__(self, buckets=None, refuse=None, meanwhile=False) -> None:
        self.buckets, self.refuse, self.meanwhile, self.created, self.looked = dict(buckets or {}), refuse, \
            meanwhile, [], []

    async def key_value(self, bucket):
        self.looked.append(bucket)
        if bucket not in self.buckets:
            raise nats.js.errors.BucketNotFoundError
        return self.buckets[bucket]

    async def create_key_value(self, config):
        self.created.append(config)
        if self.refuse is not None:
            if self.meanwhile:
                self.buckets[config.bucket] = ("made by another", config.bucket)
            raise self.refuse
        self.buckets[config.bucket] = ("made here", config.bucket)
        return self.buckets[config.bucket]


def _lease(js, replicas: int = 3, ttl: float = 2.5, lapse: float = 7.25) -> Lease:
    lk = RecordingLink(2.0)
    lk.config = dataclasses.replace(lk.config, replicas=replicas)
    lease = Lease(lk, LeaseConfig(ttl_seconds=ttl, renew_seconds=0.5, margin_seconds=0.2, lapse_seconds=lapse),
                  "node-a")
    lk.js = js
    return lease


def test_an_existing_bucket_is_used_and_nothing_is_created():
    js = FakeJS()
    lease = _lease(js)
    js.buckets[lease.bucket] = kv = object()
    assert asyncio.run(lease._ensure_bucket()) is kv
    assert js.created == [] and js.looked == [lease.bucket]


def test_a_missing_bucket_is_created_with_the_documented_config():
    js = FakeJS()
    lease = _lease(js, replicas=3, ttl=2.5, lapse=7.25)
    assert asyncio.run(lease._ensure_bucket()) == ("made here", lease.bucket)
    (cfg,) = js.created
    assert (cfg.bucket, cfg.ttl, cfg.history, cfg.replicas, cfg.storage, cfg.description) == \
        (lease.bucket, 9.75, 1, 3, api.StorageType.FILE, "kvservice leader lease")
    assert lease.bucket == f"KVS_{lease.link.config.name}_leader"


def test_a_refused_creation_takes_the_bucket_another_manager_made_meanwhile():
    js = FakeJS(refuse=nats.js.errors.BadRequestError(code=400, description="already in use"), meanwhile=True)
    lease = _lease(js)
    assert asyncio.run(lease._ensure_bucket()) == ("made by another", lease.bucket)
    assert js.looked == [lease.bucket, lease.bucket]


@pytest.mark.parametrize("described", [True, False])
def test_a_real_refusal_names_the_bucket_the_replicas_and_the_servers_reason(described):
    words = "insufficient resources " + secrets.token_hex(4)
    err = nats.js.errors.BadRequestError(code=400, err_code=10023, description=words if described else None)
    js = FakeJS(refuse=err)
    lease = _lease(js, replicas=5)
    with pytest.raises(StoreError) as caught:
        asyncio.run(lease._ensure_bucket())
    why = words if described else str(err)
    assert caught.value.message == f"creating the lease bucket {lease.bucket} (5 replicas) was refused: {why}"
    assert js.looked == [lease.bucket, lease.bucket]
