"""Integer fields refuse float-coded tensors (kvservice/contract/wire.py from_tensor), and EventHub.after_step counts
the prompt pages an admission looked up as sum((n - 1) // page_size) over admit_num_tokens.

NumPy has no bfloat16 or float8, so the wire holds those codes' items as raw uint16 / uint8: integer kinds on the
host. A field that wants integers must still refuse them (block_manager.proto: counts and ids are integers), or a
float8 tensor would be read as byte-sized token counts. Oracles: the proto's dtype codes, the exact refusal text
of from_tensor, and the formula of after_step's docstring ("each full page but the last token's was looked up"),
recomputed by hand in Python ints.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import common_pb2

RAW_FLOATS = [("BFLOAT16", common_pb2.BFLOAT16, np.uint16), ("FLOAT8_E4M3", common_pb2.FLOAT8_E4M3, np.uint8),
              ("FLOAT8_E5M2", common_pb2.FLOAT8_E5M2, np.uint8)]


def _api(page: int) -> ManagerAPI:
    """A manager with pool "p": 64 slots of `page` tokens, prefix caching on."""
    api = ManagerAPI(BlockManager(3600.0))
    api.CreatePool(create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", page), Sizing(num_slots=64),
                                       prefix_caching=True))
    return api


def _looked(lens: list[int], page: int) -> int:
    return sum((n - 1) // page for n in lens)


@pytest.mark.parametrize(("name", "code", "raw"), RAW_FLOATS)
def test_a_float_code_held_as_raw_unsigned_items_is_refused_where_integers_are_wanted(name, code, raw):
    data = np.random.default_rng(int(code)).integers(1, 200, 6).astype(raw)
    t = common_pb2.Tensor(dtype=code, shape=[6], data=data.tobytes())
    with pytest.raises(InvalidArgument) as e:
        from_tensor(t, "admit_num_tokens")
    assert str(e.value) == f"admit_num_tokens: dtype {name} not allowed here"
    with pytest.raises(InvalidArgument):
        from_tensor(t, "admit_num_tokens", kinds="iu")
    got = from_tensor(t, "k_cache", kinds="iuf")                 # a cache tensor: its raw items, as sent
    assert got.dtype == raw and got.tolist() == data.tolist()


def test_a_step_with_float8_coded_counts_is_refused_and_changes_nothing() -> None:
    page = 256
    api = _api(page)
    rng = np.random.default_rng(8)
    small = [int(x) for x in rng.integers(1, 256, 3)]
    req = step_request("p", admit=[1, 2, 3], admit_tokens=small,
                       admit_token_ids=rng.integers(1, 50_000, sum(small)))
    req.admit_num_tokens.CopyFrom(common_pb2.Tensor(dtype=common_pb2.FLOAT8_E4M3, shape=[3],
                                                    data=np.asarray(small, dtype=np.uint8).tobytes()))
    with pytest.raises(InvalidArgument, match=r"^admit_num_tokens: dtype FLOAT8_E4M3 not allowed here$"):
        api.Step(req)
    assert api.manager.events.lookup_pages == {}
    with api.manager.locked("p") as pool:
        assert pool.num_sequences == 0 and pool.allocators[0].num_free == 64


def test_lookup_pages_count_every_admission_of_a_pool_with_wide_pages() -> None:
    page = 256
    api = _api(page)
    rng = np.random.default_rng(9)
    small = [int(x) for x in rng.integers(1, 256, 3)]
    wide = [int(x) for x in rng.integers(300, 2000, 2)]           # more than one page each
    assert not api.Step(step_request("p", admit=[1, 2, 3], admit_tokens=small,
                                     admit_token_ids=rng.integers(1, 50_000, sum(small)))).HasField("error")
    assert api.manager.events.lookup_pages == {("p", 0): _looked(small, page)} == {("p", 0): 0}
    assert not api.Step(step_request("p", admit=[4, 5], admit_tokens=wide,
                                     admit_token_ids=rng.integers(1, 50_000, sum(wide)))).HasField("error")
    assert api.manager.events.lookup_pages == {("p", 0): _looked(small, page) + _looked(wide, page)}
    assert _looked(wide, page) >= 2
