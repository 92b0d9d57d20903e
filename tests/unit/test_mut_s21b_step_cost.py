"""ManagerAPI.check_step_cost on a step no bound can be computed for (StepCost's docstring: reply_bytes 0 = none
computed): over the limit from the request alone and from the pool's token total, naming an unknown sequence,
so the per-row bound (level 2) is None. Nothing is reserved; the pool then refuses the step itself."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, NotFound
from kvservice.manager.api import ManagerAPI, StepCost
from kvservice.manager.step_input import decode_step
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s18mgr_api import PS, _i64, _model_and_api, _u64


def test_an_unknown_row_past_the_first_bounds_gives_no_bound_and_reserves_nothing():
    """Level 0 and level 1 over the limit, level 2 None (an extended id the pool does not hold): StepCost(False, 0),
    reserve_reply never called; Step then refuses it (NotFound naming the id) and the pool is unchanged."""
    rng = np.random.default_rng(2105)
    m, _, probe = _model_and_api()
    ids = list(range(1, 9))
    probe.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(ids),
                              admit_num_tokens=_i64(rng.integers(1, 3 * PS, len(ids)).tolist())))
    unknown = int(rng.integers(100, 10**6))
    e_ids = [*ids, unknown]
    r = pb.StepRequest(pool="p", extend_seq_ids=_u64(e_ids), extend_num_tokens=_i64(rng.integers(1, 3, len(e_ids))),
                       admit_seq_ids=_u64([50]), admit_num_tokens=_i64([int(rng.integers(1, 9))]))
    b0, b1 = (probe.step_reply_bound(r, level).total for level in (0, 1))
    assert b0 > b1 and probe.step_reply_bound(r, 2) is None
    pool = m.pool_and_lock("p")[0]
    before = pool.sequences()
    for limit in (b1 - 1, 1):
        api = ManagerAPI(m, max_reply_bytes=limit)
        reserved: list[int] = []
        api.reserve_reply = reserved.append
        assert api.check_step_cost(pool, decode_step(r)) == StepCost(False, 0), limit
        assert reserved == []
        with pytest.raises(NotFound, match=str(unknown)):
            api.Step(r)
        after = pool.sequences()
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))


def test_a_malformed_request_gives_no_bound_from_the_request_alone_and_reserves_nothing():
    """Arrays of different lengths (two admitted ids, one count): no shape from the request alone, so
    StepCost(False, 0) whatever the limit, nothing reserved; Step refuses it and the pool is unchanged."""
    m, _, _ = _model_and_api()
    r = pb.StepRequest(pool="p", admit_seq_ids=_u64([3, 4]), admit_num_tokens=_i64([5]))
    pool = m.pool_and_lock("p")[0]
    for limit in (1, 10**9):
        api = ManagerAPI(m, max_reply_bytes=limit)
        reserved: list[int] = []
        api.reserve_reply = reserved.append
        assert api.check_step_cost(pool, decode_step(r)) == StepCost(False, 0), limit
        assert reserved == []
        with pytest.raises(InvalidArgument) as exc:
            api.Step(r)
        assert exc.value.message == "admit_num_tokens has 1 entries for 2 sequence ids"
        assert pool.num_sequences == 0
