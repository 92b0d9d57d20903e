"""kvservice/server/stream.py step_one: a StepStream request is journaled as the bytes it arrived as (the module
doc; kvservice/contract/received.py), followed by the request_id field the server set (``<stream id>#<seq>``
without tokens), not as a re-serialization of the parsed message.

The bytes sent are valid protobuf that no serializer writes: fields in descending field-number order, and the
pool field twice (protobuf keeps the last one), so a re-encoding cannot reproduce them."""

from __future__ import annotations

import grpc
import numpy as np

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
from tests.support_stream import fields_in_order

SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field (number < 16, data < 128 bytes) as the wire writes it: tag, length, bytes."""
    assert number < 16 and len(data) < 128
    return bytes([number << 3 | 2, len(data)]) + data


def test_a_streamed_step_is_journaled_byte_for_byte_as_sent_then_its_request_id() -> None:
    rng = np.random.default_rng(20)
    running = serve("127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            pb_grpc.BlockManagerStub(ch).CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)),
                                                     timeout=10)
            lens = [int(x) for x in rng.integers(1, 30, 3)]
            sent = []
            for seq, (hashes, tokens) in enumerate([([11, 12, 13], lens), ([11], [2])], start=1):
                r = step_request("q", admit=hashes, admit_tokens=tokens) if seq == 1 else \
                    step_request("q", extend=hashes, extend_tokens=tokens)
                r.stream_seq = seq
                pool = pb.StepRequest.DESCRIPTOR.fields_by_name["pool"].number
                data = _field(pool, b"other-pool") + fields_in_order(r)      # a repeated field: the last one wins
                assert pb.StepRequest.FromString(data) == r
                assert data != r.SerializeToString() and data != r.SerializeToString(deterministic=True)
                sent.append(data)
            stream = ch.stream_stream("/kvservice.v1.BlockManager/StepStream", request_serializer=lambda b: b,
                                      response_deserializer=pb.StepReply.FromString)
            replies = list(stream(iter(sent), metadata=((STREAM_ID_KEY, "st-r3"),), timeout=10))
        assert [(r.HasField("error"), r.stream_seq) for r in replies] == [(False, 1), (False, 2)]
        entries = [e for e in running.journal.store.entries_after(0) if e.method == "Step"]
    finally:
        running.stop(0)
    rid = pb.StepRequest.DESCRIPTOR.fields_by_name["request_id"].number
    assert [e.request for e in entries] == [sent[0] + _field(rid, b"st-r3#1"), sent[1] + _field(rid, b"st-r3#2")]
