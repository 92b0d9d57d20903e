"""The JetStream assets of a replicated deployment: the journal stream and the snapshot object store.

Managers started together on a fresh deployment all try to create them; the first creation wins and the
others find what it made. A creation refused while nobody else made the asset is a real refusal (a
cluster still electing its meta leader, or missing peers, cannot place a replicated stream): it raises
StoreError with the server's own reason (whatever status the server gives it: 400, or 500 for more
replicas than the cluster has peers, err_code 10074), and the caller's startup retry (config.retry_startup)
tries again.
"""

from __future__ import annotations

from typing import Any

import nats.js.errors
from nats.js import api

from kvservice.state.nats.config import NatsConfig, StoreError, Unrecoverable


def reason(err: nats.js.errors.Error) -> str:
    """The server's words for a refused JetStream request (description and error code)."""
    desc = getattr(err, "description", None)
    code = getattr(err, "err_code", None)
    return f"{desc} (err_code {code})" if desc else f"{type(err).__name__}: {err}"


async def ensure_assets(js: Any, c: NatsConfig, path: str, create: bool) -> Any:
    """Open (create: or make) the journal stream and the snapshot bucket; the bucket's ObjectStore.

    js: the link's JetStream context. path: how errors name the store. Without create, a missing
    stream raises Unrecoverable and a missing bucket gives None (no snapshot was ever written).
    """
    try:
        await js.stream_info(c.stream)
    except nats.js.errors.NotFoundError:
        if not create:
            raise Unrecoverable(f"{path}: no kvservice journal there (stream {c.stream} is missing)") from None
        try:
            await js.add_stream(api.StreamConfig(
                name=c.stream, subjects=[c.subject], storage=api.StorageType.FILE, num_replicas=c.replicas,
                retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.NEW, duplicate_window=120.0,
                max_msg_size=-1, description="kvservice manager journal (docs/DURABILITY.md)"))
        except nats.js.errors.APIError as refused:     # 400, or 500 for replicas > peers (10074)
            try:
                await js.stream_info(c.stream)      # created meanwhile by another manager
            except nats.js.errors.NotFoundError:
                raise StoreError(f"{path}: creating the journal stream ({c.replicas} replicas) was refused: "
                                 f"{reason(refused)}") from None
    try:
        return await js.object_store(c.snapshot_bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            return None
    try:
        return await js.create_object_store(c.snapshot_bucket, config=api.ObjectStoreConfig(
            replicas=c.replicas, storage=api.StorageType.FILE, description="kvservice manager snapshots"))
    except nats.js.errors.APIError as refused:     # 400, or 500 for replicas > peers (10074)
        try:
            return await js.object_store(c.snapshot_bucket)
        except nats.js.errors.BucketNotFoundError:
            raise StoreError(f"{path}: creating the snapshot bucket {c.snapshot_bucket} ({c.replicas} replicas) "
                             f"was refused: {reason(refused)}") from None
