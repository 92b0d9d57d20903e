"""ScorePrefix (routing.score_prefix_reply) refuses token_ids whose bytes do not decode, naming the field: the
contract's tensor rules (contract/wire.py, block_manager.proto's Tensor: data holds whole items of dtype, and a
declared shape must account for every item). Oracle: the byte counts below, computed by hand."""

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import score_prefix_reply
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb


@pytest.fixture
def manager():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=8, max_seq_len=32),
                  prefix_caching=True)
    return m


@pytest.mark.parametrize(("tensor", "message"), [
    (cpb.Tensor(dtype=cpb.INT64, data=b"\1" * 12), "token_ids: 12 bytes is not a whole number of 8-byte items"),
    (cpb.Tensor(dtype=cpb.INT32, data=b"\1" * 10), "token_ids: 10 bytes is not a whole number of 4-byte items"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[3], data=b"\1" * 8),
     "token_ids: shape [3] declares 3 items but the data holds 2 (8 bytes of INT32)"),
    (cpb.Tensor(dtype=cpb.INT64, shape=[2, -1], data=b"\1" * 16),
     "token_ids: bad shape [2, -1] (at most 8 dimensions, each >= 0)"),
])
def test_undecodable_token_ids_are_refused_naming_the_field(manager, tensor, message):
    with pytest.raises(InvalidArgument) as e:
        score_prefix_reply(manager, pb.ScorePrefixRequest(token_ids=tensor))
    assert (e.value.message, e.value.reason) == (message, "INVALID_ARGUMENT")
