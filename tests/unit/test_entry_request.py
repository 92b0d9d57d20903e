"""stores.entry_request: a Step is journaled as the bytes it arrived as, followed by the request_id the server set;
parsing the entry gives the request as applied. Random requests, field orders and ids (unicode, long, empty)."""

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.received import Received, unwrap
from kvservice.state.stores import entry_request
from kvservice.v1 import block_manager_pb2 as pb
from tests.support_stream import fields_in_order

IDS = ["", "r", "5:alice/req-ü-🙂", "x" * 200, "st-1#99"]


@pytest.mark.parametrize("seed", range(20))
def test_the_entry_parses_to_the_request_as_applied(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    request = codec.step_request("pool-" + str(seed), extend=rng.integers(1, 1 << 40, n),
                                 extend_tokens=rng.integers(1, 9, n), request_id=str(rng.choice(IDS)) or None)
    request.stream_seq = int(rng.integers(0, 1 << 40))
    request.delta_tables = bool(rng.integers(0, 2))
    received = fields_in_order(request, rng.permutation(len(request.ListFields())).tolist())
    assert pb.StepRequest.FromString(received) == request
    applied = pb.StepRequest.FromString(received)
    applied.request_id = str(rng.choice(IDS))                     # what the server sets (scoped, derived)
    entry = entry_request(applied, received)
    assert entry.startswith(received)
    assert pb.StepRequest.FromString(entry) == applied
    if not applied.request_id:
        assert entry == received + b"J\x00"                      # request_id (field 9) written empty
    assert pb.StepRequest.FromString(entry_request(applied)) == applied           # no bytes: serialized
    assert entry_request(applied) == applied.SerializeToString(deterministic=True)


def test_received_reads_through_to_its_message_and_unwraps():
    request = codec.step_request("p", extend=[1, 2], extend_tokens=1, request_id="r")
    data = request.SerializeToString()
    got = Received(request, data)
    assert got.pool == "p" and got.request_id == "r"             # what an interceptor reads (the pool scope)
    assert unwrap(got) == (request, data)
    assert unwrap(request) == (request, None)
    with pytest.raises(AttributeError):
        got.pool = "q"                                           # a handler writes only to the unwrapped message
