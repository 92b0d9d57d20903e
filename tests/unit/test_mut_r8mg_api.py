"""ManagerAPI.step_reply_bound at level 2 (each extended row bounded by its own tokens) for a live sequence whose
id is 0: a valid id (the pool takes any non-negative id), so the bound is the one the same step gets with the row
under any other id. Oracle: renaming a sequence changes no size in a reply but the ids' varints, and the bound
counts ids at their widest; the real reply must fit in the bound (docs/DESIGN.md, reply size limits).
Also the REPLY_TOO_LARGE refusal's split advice and metadata (hand-computed from the bound's parts), and no bound
for a zero token count (a step the pool refuses)."""

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s18mgr_api import PS, _i64, _model_and_api, _u64


def test_the_level_2_bound_of_sequence_0_is_the_bound_of_any_other_id():
    api = ManagerAPI(BlockManager())
    spec = CacheSpec.uniform(2, 1, 64, page_size=4)
    bounds = {}
    for sid in (0, 5):
        name = f"p{sid}"
        api.CreatePool(codec.create_pool_request(name, spec, Sizing(num_slots=32, max_seq_len=64)))
        api.Step(codec.step_request(name, admit=[sid], admit_tokens=[9]))
        req = codec.step_request(name, extend=[sid], extend_tokens=6)
        bounds[sid] = [api.step_reply_bound(req, level) for level in (2, 1, 0)]
        assert all(b is not None for b in bounds[sid]), (sid, bounds[sid])
        exact, quick, blind = (b.total for b in bounds[sid])
        assert exact <= quick <= blind
        reply = api.Step(req)
        assert reply.ByteSize() <= exact
        assert list(codec.parse_step(reply).num_tokens) == [15]
    assert bounds[0] == bounds[5]
    unknown = codec.step_request("p0", extend=[7], extend_tokens=1)
    assert api.step_reply_bound(unknown, 2) is None                   # an id the pool does not hold: no bound


def test_split_advice_names_at_least_one_token_per_step_and_scales_with_the_room_left():
    """The last advice of REPLY_TOO_LARGE: about new_tokens * (limit - rest) / (total - rest) new tokens per step
    (the slot mappings and tables grow with the tokens; `rest` does not), and never fewer than 1."""
    rng = np.random.default_rng(8101)
    n = rng.integers(PS, 40 * PS, 10).tolist()
    r = pb.StepRequest(pool="p", admit_seq_ids=_u64(range(100, 110)), admit_num_tokens=_i64(n))
    b = _model_and_api()[2].step_reply_bound(r)
    tokens = sum(n)
    half = b.rest + (b.total - b.rest) // 2
    for limit, per_step in ((b.rest, 1), (b.rest + 1, 1), (half, tokens * (half - b.rest) // (b.total - b.rest))):
        assert per_step >= 1 and limit < b.slot_mappings + b.rest
        api = _model_and_api(limit)[2]
        with pytest.raises(ResourceExhausted) as e:
            api.Step(r)
        assert f"split it into smaller steps (at most about {per_step} new tokens per step for this pool)" \
            in e.value.message, (limit, e.value.message)
        assert {k: e.value.metadata[k] for k in ("new_tokens", "limit", "omit_tables", "include_block_table")} == \
            {"new_tokens": str(tokens), "limit": str(limit), "omit_tables": "False", "include_block_table": "False"}
    omitted = pb.StepRequest(pool="p", admit_seq_ids=_u64(range(100, 110)), admit_num_tokens=_i64(n), omit_tables=True)
    with pytest.raises(ResourceExhausted) as e:
        _model_and_api(b.rest)[2].Step(omitted)
    assert (e.value.metadata["omit_tables"], e.value.metadata["include_block_table"]) == ("True", "False")


@pytest.mark.parametrize("field", ["admit", "extend"])
def test_no_bound_for_a_step_with_a_zero_count_at_any_level(field):
    """A zero token count is refused by the pool, so no level bounds it (step_reply_bound's None)."""
    api = _model_and_api()[2]
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([1, 2]), admit_num_tokens=_i64([5, 6])))
    if field == "admit":
        r = pb.StepRequest(pool="p", admit_seq_ids=_u64([3, 4]), admit_num_tokens=_i64([3, 0]))
    else:
        r = pb.StepRequest(pool="p", extend_seq_ids=_u64([1, 2]), extend_num_tokens=_i64([0, 2]))
    assert [api.step_reply_bound(r, level) for level in (0, 1, 2)] == [None, None, None]
    ok = pb.StepRequest(pool="p", admit_seq_ids=_u64([3, 4]), admit_num_tokens=_i64([3, 1]))
    assert all(api.step_reply_bound(ok, level) is not None for level in (0, 1, 2))
