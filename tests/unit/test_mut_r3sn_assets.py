"""ensure_assets against the shared single-node nats-server (``nats1``): the journal stream is created with the
configured number of replicas (NatsConfig.replicas: "JetStream replicas of the stream and buckets"), so a single
node asked for 3 refuses the stream itself (nats-server: err_code 10074, "replicas > 1 not supported in non-clustered
mode"), and no stream is left created; with 1, the stream's replicas are 1."""

from __future__ import annotations

import uuid

import nats.js.errors
import pytest

from kvservice.state.nats.assets import ensure_assets
from kvservice.state.nats.config import NatsConfig, StoreError

from .test_nats_store import link  # noqa: F401  (fixture)


def test_a_single_node_refuses_a_three_replica_journal_stream_first(link, nats1):  # noqa: F811
    """replicas=3 on one node -> StoreError quoting the server's refusal (a 500, err_code 10074), and no stream
    of that name exists afterwards (a stream created with any other replica count would exist)."""
    c = NatsConfig(tuple(nats1.urls), name="t" + uuid.uuid4().hex[:10], replicas=3)
    with pytest.raises(StoreError, match=r"^the-path: creating the journal stream \(3 replicas\) was refused: "
                                         r".+ \(err_code 10074\)$"):
        link.call(ensure_assets(link.js, c, "the-path", True), 30.0)

    async def stream_missing():
        try:
            await link.js.stream_info(c.stream)
        except nats.js.errors.NotFoundError:
            return True
        return False

    assert link.call(stream_missing(), 10.0)


def test_a_one_replica_journal_stream_has_one_replica(link, nats1):  # noqa: F811
    """replicas=1 -> the stream is created with num_replicas 1 (as its config reads back)."""
    c = NatsConfig(tuple(nats1.urls), name="t" + uuid.uuid4().hex[:10], replicas=1)
    assert link.call(ensure_assets(link.js, c, "p", True), 30.0) is not None
    info = link.call(link.js.stream_info(c.stream), 10.0)
    assert (info.config.num_replicas, info.config.subjects) == (1, [c.subject])
