"""ManagerAPI.check_step_cost's shortcut for extend-only steps (limits.extend_bound: c0 + ce * E + cs * S, the
bound from the request alone) against the rule its docstring and _quick_shape's give: a step is bounded from the
request alone only when its ids are 1-D integer arrays as long as their counts and every count is > 0. A step that
is not (a count of 0 among others, a count of 0 alone, a negative one, counts without ids, ids without counts, ids
of another length, dimension or dtype; an admission of 0 tokens) gets no bound (StepCost(False, 0)) and nothing
is reserved for it, whatever the limit; a well-formed extend-only step gets exactly c0 + ce * E + cs * S."""

import dataclasses

import numpy as np

from kvservice.core.limits import extend_bound
from kvservice.manager.api import ManagerAPI, StepCost
from kvservice.manager.step_input import decode_step
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s18mgr_api import _i64, _model_and_api, _u64


def _cost(api, pool, step):
    """(check_step_cost's answer, what it reserved)."""
    reserved = []
    api.reserve_reply = reserved.append
    return api.check_step_cost(pool, step), reserved


def test_the_extend_only_shortcut_bounds_only_well_formed_steps_with_counts_above_zero():
    rng = np.random.default_rng(7071)
    m, model, probe = _model_and_api()
    ids = [int(x) for x in rng.permutation(np.unique(rng.integers(1, 10**6, 10))[:5])]
    probe.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(ids), admit_num_tokens=_i64(rng.integers(1, 9, 5))))
    pool = m.pool_and_lock("p")[0]
    k = rng.integers(1, 6, 5).tolist()
    for tables, block_table in ((True, False), (True, True), (False, False)):
        c0, ce, cs = extend_bound(model, tables, block_table)
        want = c0 + ce * len(ids) + cs * sum(k)
        r = pb.StepRequest(pool="p", extend_seq_ids=_u64(ids), extend_num_tokens=_i64(k), omit_tables=not tables,
                           include_block_table=block_table)
        for limit in (want, 1 << 30):
            assert _cost(ManagerAPI(m, max_reply_bytes=limit), pool, decode_step(r)) == (StepCost(True, want),
                                                                                          [want]), limit
    zero_among = list(k)
    zero_among[int(rng.integers(5))] = 0
    bad = {
        "a count of 0 among others": dict(extend_seq_ids=_u64(ids), extend_num_tokens=_i64(zero_among)),
        "a count of 0 alone": dict(extend_seq_ids=_u64(ids[:1]), extend_num_tokens=_i64([0])),
        "a negative count": dict(extend_seq_ids=_u64(ids[:2]), extend_num_tokens=_i64([3, -2])),
        "counts without ids": dict(extend_num_tokens=_i64(k[:2])),
        "ids without counts": dict(extend_seq_ids=_u64(ids[:2])),
        "fewer counts than ids": dict(extend_seq_ids=_u64(ids), extend_num_tokens=_i64(k[:4])),
        "more counts than ids": dict(extend_seq_ids=_u64(ids[:2]), extend_num_tokens=_i64(k[:3])),
        "an admission of 0 tokens": dict(admit_seq_ids=_u64([10**7]), admit_num_tokens=_i64([0])),
        "an admission of 0 tokens among others": dict(admit_seq_ids=_u64([10**7, 10**7 + 1]),
                                                      admit_num_tokens=_i64([3, 0])),
    }
    for limit in (1, 1 << 30):
        api = ManagerAPI(m, max_reply_bytes=limit)
        for what, fields in bad.items():
            assert _cost(api, pool, decode_step(pb.StepRequest(pool="p", **fields))) == (StepCost(False, 0), []), \
                (what, limit)
        good = decode_step(pb.StepRequest(pool="p", extend_seq_ids=_u64(ids[:1]), extend_num_tokens=_i64(k[:1])))
        for what, e_ids in (("2-D ids", np.array([ids[:1]], dtype=np.uint64)),
                            ("float ids", np.array(ids[:1], dtype=np.float64))):
            step = dataclasses.replace(good, extend_seq_ids=e_ids)
            assert _cost(api, pool, step) == (StepCost(False, 0), []), (what, limit)
