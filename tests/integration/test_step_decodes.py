"""A Step's request is decoded once, and journaled as the bytes it arrived as: per served unary Step, per StepStream
request and per replayed journal entry, decode_step runs once and each array the request carries is decoded
(Tensor -> NumPy) once, wherever it goes after (Limits, the journal, the cost check, Pool.step, the stream's
incremental tables)."""

from collections import Counter

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, codec
from kvservice.contract import wire
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.manager import api as api_module
from kvservice.manager import step_input
from kvservice.server import servicer as servicer_module
from kvservice.server import stream as stream_module
from kvservice.server.app import serve
from kvservice.server.stream import scoped_request_id
from kvservice.state.journal import Journal, MemoryStore
from kvservice.v1 import block_manager_pb2 as pb
from tests.support_stream import fields_in_order

pytestmark = pytest.mark.integration
SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)
SIZING = Sizing(num_slots=256, max_seq_len=256)


class Decodes:
    """Counts decode_step calls and the Tensor decodings of StepRequest arrays (by field), wherever they happen."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        self.arrays: Counter[str] = Counter()
        real_decode, real_tensor = step_input.decode_step, wire.from_tensor

        def decode_step(request):
            self.steps += 1
            return real_decode(request)

        def from_tensor(t, name, *args, **kwargs):
            if name in step_input.STEP_ARRAYS:
                self.arrays[name] += 1
            return real_tensor(t, name, *args, **kwargs)

        for module in (step_input, servicer_module, stream_module, api_module):
            monkeypatch.setattr(module, "decode_step", decode_step)
        for module in (wire, step_input):
            monkeypatch.setattr(module, "from_tensor", from_tensor)

    def take(self) -> tuple[int, dict[str, int]]:
        """(decode_step calls, decodings per array field) since the last take."""
        out = (self.steps, dict(self.arrays))
        self.steps, self.arrays = 0, Counter()
        return out


# (request fields, the arrays it carries): every array field, and both kinds of steady loop
STEPS = [
    ({"admit": [1, 2, 3], "admit_tokens": [9, 5, 8], "admit_token_ids": np.arange(1, 23)},
     {"admit_seq_ids", "admit_num_tokens", "admit_token_ids"}),
    ({"extend": [1, 2, 3], "extend_tokens": [1, 2, 1]}, {"extend_seq_ids", "extend_num_tokens"}),
    ({"extend": [1, 2, 3], "extend_tokens": 1}, {"extend_seq_ids", "extend_num_tokens"}),
    ({"extend": [1, 2, 3], "extend_tokens": 1}, {"extend_seq_ids", "extend_num_tokens"}),
    ({"free": [3], "fork": [(1, 7)], "extend": [2], "extend_tokens": 1},
     {"free_seq_ids", "fork_parent_ids", "fork_child_ids", "extend_seq_ids", "extend_num_tokens"}),
]


def test_a_step_is_decoded_once_served_streamed_and_replayed(monkeypatch):
    store = MemoryStore()
    journal = Journal.recover(store)
    running = serve("127.0.0.1:0", journal=journal)
    decodes = Decodes(monkeypatch)
    journaled = []
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
            for pool in ("u", "s"):
                c.create_pool(pool, SPEC, SIZING, prefix_caching=True)
            decodes.take()
            for fields, arrays in STEPS:                              # unary Steps, with a request_id and without
                c.step("u", **fields)
                assert decodes.take() == (1, dict.fromkeys(arrays, 1))
                journaled.append(arrays)
            with c.step_stream("s") as s:                             # a StepStream, deltas on
                for fields, arrays in STEPS + STEPS[2:4] * 3:
                    if "fork" in fields or "free" in fields:
                        continue                                      # the ids already went; covered by unary
                    s.step(**fields)
                    assert decodes.take() == (1, dict.fromkeys(arrays, 1))
                    journaled.append(arrays)
    finally:
        running.server.stop(1).wait()          # not running.stop(): its snapshot would leave nothing to replay
    journal.close(snapshot=False)
    decodes.take()
    again = Journal.recover(store)                                    # replay: every entry after the baseline
    steps, arrays = decodes.take()
    assert again.replayed_entries == len(journaled) + 2                # and the two CreatePools
    assert steps == len(journaled)
    want = Counter(f for entry in journaled for f in entry)
    assert arrays == dict(want)
    with again.manager.locked("u") as pool:
        assert sorted(pool.sequences()[0].tolist()) == [1, 2, 7]
    again.close(snapshot=False)


def test_the_journal_appends_the_bytes_it_received_unary_and_streamed():
    """The journal entry of a served Step (unary, and StepStream) is the request's bytes as they arrived, followed by
    the request_id the server set (scoped to the caller's tenant, or derived from the stream): not a re-serialization
    of the parsed message. The bytes sent here put the fields in an order a re-serialization changes."""
    tokens = TokenTable.from_yaml("tokens:\n  - {name: admin, token: admin-0123456789abcdef, pools: ['*'], "
                                  "role: admin}\n  - {name: team-a, token: teama-0123456789abcdef, pools: [p]}\n")
    store = MemoryStore()
    journal = Journal.recover(store)
    running = serve("127.0.0.1:0", journal=journal, tokens=tokens)
    target = f"127.0.0.1:{running.port}"
    meta = (("authorization", "Bearer teama-0123456789abcdef"),)
    try:
        with BlockManagerClient(target, token="admin-0123456789abcdef") as admin:
            admin.create_pool("p", SPEC, SIZING)
        with grpc.insecure_channel(target) as ch:
            step = ch.unary_unary("/kvservice.v1.BlockManager/Step", request_serializer=lambda b: b,
                                  response_deserializer=pb.StepReply.FromString)
            sent = fields_in_order(codec.step_request("p", admit=[1, 2], admit_tokens=[5, 9], request_id="r-1"))
            assert sent != pb.StepRequest.FromString(sent).SerializeToString(deterministic=True)
            step(sent, metadata=meta)
            stream = ch.stream_stream("/kvservice.v1.BlockManager/StepStream", request_serializer=lambda b: b,
                                      response_deserializer=pb.StepReply.FromString)
            r = codec.step_request("p", extend=[1, 2], extend_tokens=1)
            r.stream_seq = 1
            streamed = fields_in_order(r)
            replies = list(stream(iter([streamed]), metadata=(*meta, (STREAM_ID_KEY, "st-1"))))
            assert not replies[0].HasField("error"), replies[0].error
    finally:
        running.server.stop(1).wait()
    entries = [e for e in store.entries_after(0) if e.method == "Step"]
    assert len(entries) == 2
    unary, streamed_entry = entries
    scoped = scoped_request_id("team-a", "r-1")
    assert unary.request.startswith(sent) and unary.request != sent
    assert pb.StepRequest.FromString(unary.request).request_id == scoped
    assert streamed_entry.request.startswith(streamed)
    assert pb.StepRequest.FromString(streamed_entry.request).request_id == scoped_request_id("team-a", "st-1#1")
    journal.close(snapshot=False)
    again = Journal.recover(store)                                 # the entries replay to the same pool
    with again.manager.locked("p") as pool:
        assert sorted(pool.sequences()[0].tolist()) == [1, 2]
        assert sorted(pool.sequences()[1].tolist()) == [6, 10]
    again.close(snapshot=False)
