"""Replays tests/fuzz/corpus.py against a memory-only and a durable manager over gRPC.

Every entry must get its status (never INTERNAL, never a fail-stop), change nothing (state_tree before
and after), and leave the server answering. Then the reply-size edge: the largest step whose bound fits
the message limit is delivered by the transport (no "Sent message larger than max"), one token more is
refused by the manager itself.
"""

import grpc
import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.status import error_info
from kvservice.core.invariants import assert_invariants
from kvservice.manager.api import ManagerAPI
from kvservice.server.app import serve
from kvservice.server.limits import Limits
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

from .corpus import ENTRIES, MESSAGE_LIMIT, POOLS, SETUP, i64, setup_step, u64
from .support import COUNTS

pytestmark = pytest.mark.integration
NO_CAPS = Limits(max_step_sequences=0, max_step_tokens=0, max_pool_slots=0, max_pools=0)


@pytest.fixture(scope="module", params=["memory", "durable"])
def server(request, tmp_path_factory):
    journal = None
    if request.param == "durable":
        journal = Journal.open(tmp_path_factory.mktemp("corpus"), config=JournalConfig(sync="normal"))
    running = serve(journal=journal, limits=NO_CAPS, max_message_bytes=MESSAGE_LIMIT)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}", options=[
        ("grpc.max_receive_message_length", 4 * MESSAGE_LIMIT), ("grpc.max_send_message_length", 4 * MESSAGE_LIMIT)])
    stub = pb_grpc.BlockManagerStub(channel)
    for name, layers, layout, slots, max_len, prefix in POOLS:
        stub.CreatePool(pb.CreatePoolRequest(
            name=name, sizing=pb.Sizing(num_slots=slots, max_seq_len=max_len), enable_prefix_caching=prefix,
            cache=_spec(CacheSpec.uniform(layers, 1, 64, page_size=16, layout=layout))), timeout=30)
    for pool, seq_id, tokens in SETUP:
        stub.Step(setup_step(pool, seq_id, tokens), timeout=30)
    yield running, stub
    channel.close()
    running.stop()


def _spec(spec):
    from kvservice.contract.convert import cache_spec_to_proto
    return cache_spec_to_proto(spec)


def unchanged_and_answering(running, stub, before):
    assert running.journal.failed is None and not running.failed.is_set()
    assert state_tree(running.manager) == before
    for name in running.manager.pool_names():
        with running.manager.locked(name) as pool:
            assert_invariants(pool)
    assert stub.Echo(pb.EchoRequest(payload=b"up"), timeout=10).payload == b"up"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_corpus_entry(server, entry):
    running, stub = server
    before = state_tree(running.manager)
    request = entry.request()
    with pytest.raises(grpc.RpcError) as exc:
        getattr(stub, entry.rpc)(request, timeout=60)
    assert exc.value.code() == entry.code, exc.value.details()
    assert entry.words in exc.value.details()
    if entry.reason:
        assert error_info(exc.value).reason == entry.reason
    COUNTS[("BlockManager", f"{entry.rpc} (corpus)")][entry.code.name] += 1
    unchanged_and_answering(running, stub, before)


def test_reply_at_the_edge_of_the_limit_is_delivered(server):
    """Largest admission whose bound fits: delivered and within the limit; one token more: REPLY_TOO_LARGE."""
    running, stub = server
    probe = ManagerAPI(running.manager)

    def admit(n):
        return pb.StepRequest(pool="wide", admit_seq_ids=u64([5000]), admit_num_tokens=i64([n]),
                              include_block_table=True)
    lo, hi = 1, 4096
    while lo < hi:                                # largest n with bound <= limit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if probe.step_reply_bound(admit(mid)).total <= MESSAGE_LIMIT else (lo, mid - 1)
    before = state_tree(running.manager)
    with pytest.raises(grpc.RpcError) as exc:
        stub.Step(admit(lo + 1), timeout=30)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(exc.value).reason == "REPLY_TOO_LARGE"            # the manager's, not the transport's
    unchanged_and_answering(running, stub, before)
    reply = stub.Step(admit(lo), timeout=30)
    assert 0.95 * MESSAGE_LIMIT < reply.ByteSize() <= MESSAGE_LIMIT
    assert np.frombuffer(reply.num_tokens.data, "<i8").tolist() == [lo]
    stub.Step(pb.StepRequest(pool="wide", free_seq_ids=u64([5000])), timeout=30)
