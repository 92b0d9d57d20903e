"""kvservice/manager/event_log.py: EventHub.after_step counts the prompt pages an admission looked up in the prefix
cache as sum((n - 1) // page_size) over its admit_num_tokens, in int64 whatever integer dtype the counts arrived as.

The wire (kvservice/contract/wire.py from_tensor, kinds "iu") decodes admit_num_tokens of any integer-kind dtype
as sent, including one-byte items (the FLOAT8 codes decode as uint8): a uint8 array with a 256-token page must
still count. Oracle: the formula of after_step's docstring ("each full page but the last token's was looked up"),
recomputed by hand in Python ints.
"""

from __future__ import annotations

import numpy as np

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import common_pb2


def _looked(lens: list[int], page: int) -> int:
    return sum((n - 1) // page for n in lens)


def test_lookup_pages_of_one_byte_counts_with_a_page_wider_than_a_byte() -> None:
    page = 256
    api = ManagerAPI(BlockManager(3600.0))
    api.CreatePool(create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", page), Sizing(num_slots=64),
                                       prefix_caching=True))
    rng = np.random.default_rng(8)
    small = [int(x) for x in rng.integers(1, 256, 3)]
    req = step_request("p", admit=[1, 2, 3], admit_tokens=small,
                       admit_token_ids=rng.integers(1, 50_000, sum(small)))
    req.admit_num_tokens.CopyFrom(common_pb2.Tensor(dtype=common_pb2.FLOAT8_E4M3, shape=[3],
                                                    data=np.asarray(small, dtype=np.uint8).tobytes()))
    reply = api.Step(req)
    assert not reply.HasField("error")
    assert api.manager.events.lookup_pages == {("p", 0): _looked(small, page)} == {("p", 0): 0}
    wide = [int(x) for x in rng.integers(300, 2000, 2)]      # int32 counts of more than one page each
    reply = api.Step(step_request("p", admit=[4, 5], admit_tokens=wide,
                                  admit_token_ids=rng.integers(1, 50_000, sum(wide))))
    assert not reply.HasField("error")
    assert api.manager.events.lookup_pages == {("p", 0): _looked(small, page) + _looked(wide, page)}
    assert _looked(wide, page) >= 2
