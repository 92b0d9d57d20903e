"""Seed 27's manager survivors (and seed 28's event-hub one, the last test), each against the rule its docstring
or DESIGN.md gives:

- ManagerAPI.step_reply_bound(level=2) looks each extended row up by its exact 64-bit sequence id: ids above 2^53
  that differ in their last bits (and so round to one float64) are different sequences, and one that is not live
  gets no bound (None: the pool refuses the step);
- a count over max_seq_len in admit_num_tokens is refused naming that field and entry, as one in
  extend_num_tokens is;
- delta.match_rows continues a row only if it gained > 0 tokens (its docstring): a same-batch result with a row
  that gained none is not the held batch again;
- the watcher limit's refusal says what to do (retry, or raise the limit with --threads above it).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.core.emit import StepResult
from kvservice.core.limits import StepShape, step_reply_bound
from kvservice.manager.api import ManagerAPI
from kvservice.manager.delta import HeldTables, match_rows
from kvservice.v1 import block_manager_pb2 as pb
from tests.kv_workload import PS as WPS
from tests.unit.test_kv_events import make_manager
from tests.unit.test_mut_s18mgr_api import PS, _i64, _model_and_api, _u64

BIG = 1 << 60                       # float64 spacing here is 256: BIG + 1 .. BIG + 127 all round to BIG


def test_the_level_2_bound_looks_rows_up_by_their_exact_64_bit_ids():
    rng = np.random.default_rng(2701)
    _, model, api = _model_and_api()
    ids = [BIG, BIG + 1, BIG + 3, 7]
    tokens = [1, 50 * PS + 1, 2, int(rng.integers(1, 5 * PS))]     # BIG and BIG + 1: 1 page against 51
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64(ids), admit_num_tokens=_i64(tokens)))
    for sid, n in zip(ids, tokens, strict=True):
        k = int(rng.integers(1, 3 * PS))
        r = pb.StepRequest(pool="p", extend_seq_ids=_u64([sid]), extend_num_tokens=_i64([k]))
        pages = -(-(n + k) // PS)                                  # the row's own pages after the step
        want = step_reply_bound(model, StepShape(1, 1, 0, k, (pages,), pages), True, False)
        assert api.step_reply_bound(r, level=2) == want, sid
    for gone in (BIG + 2, BIG + 5, BIG - 1, 8):                    # not live: near live ids, or not
        r = pb.StepRequest(pool="p", extend_seq_ids=_u64([BIG, gone]), extend_num_tokens=_i64([1, 1]))
        assert api.step_reply_bound(r, level=2) is None, gone
        r = pb.StepRequest(pool="p", fork_parent_ids=_u64([gone]), fork_child_ids=_u64([99]))
        assert api.step_reply_bound(r, level=2) is None, gone


@pytest.mark.parametrize("field", ["extend_num_tokens", "admit_num_tokens"])
def test_a_count_over_max_seq_len_is_refused_naming_its_field_and_entry(field):
    m, _, api = _model_and_api(limit=1 << 20)
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([1, 2, 3]), admit_num_tokens=_i64([1, 2, 3])))
    before = [a.tolist() for a in m.pool_and_lock("p")[0].sequences()]
    top = 60 * PS
    counts = [2, top + 1, 1]
    if field == "extend_num_tokens":
        r = pb.StepRequest(pool="p", extend_seq_ids=_u64([1, 2, 3]), extend_num_tokens=_i64(counts))
    else:
        r = pb.StepRequest(pool="p", admit_seq_ids=_u64([4, 5, 6]), admit_num_tokens=_i64(counts))
    with pytest.raises(InvalidArgument) as e:
        api.Step(r)
    assert e.value.message == (f"{field}[1] = {top + 1} tokens: pool 'p' takes at most max_seq_len={top} tokens "
                               "per sequence")
    assert [a.tolist() for a in m.pool_and_lock("p")[0].sequences()] == before


def _result(ids, num_tokens, k, num_extended):
    indptr = np.concatenate([[0], np.cumsum(k)]).astype(np.int64)
    return StepResult(np.asarray(ids, dtype=np.uint64), np.asarray(num_tokens, dtype=np.int64), indptr, (), 0,
                      num_extended=num_extended)


def test_match_rows_continues_only_rows_that_gained_tokens():
    held = HeldTables(3, None, 5, np.array([10, 11, 12], dtype=np.uint64), np.array([4, 7, 9], dtype=np.int64))
    grew = _result([10, 11, 12], [5, 9, 10], [1, 2, 1], 3)
    assert match_rows(held, grew) is None                              # the held batch again, every row grown
    still = _result([10, 11, 12], [5, 7, 10], [1, 0, 1], 3)            # row 1 gained nothing
    assert match_rows(held, still).tolist() == [0, -1, 2]
    other = _result([12, 10, 13], [10, 6, 3], [1, 2, 3], 2)            # reordered, one admitted after them
    assert match_rows(held, other).tolist() == [2, 0, -1]
    wrong = _result([10, 11, 12], [5, 8, 10], [1, 2, 1], 3)            # row 1 holds 8, not 7 + 2: sent whole
    assert match_rows(held, wrong).tolist() == [0, -1, 2]


def test_the_watcher_limit_says_how_to_get_a_stream():
    m = make_manager()
    m.events.max_subscribers, m.events.max_subscribers_per_tenant = 2, 0
    m.events.subscribe("p", None, "grpc", tenant="a")
    m.events.subscribe("p", None, "grpc", tenant="b")
    with pytest.raises(ResourceExhausted) as e:
        m.events.subscribe("p", None, "grpc", tenant="a")
    assert e.value.message == ("2 WatchEvents streams are open on this manager, its limit (--kv-events-max-watchers; "
                               "1 of them yours); retry in a few seconds, or ask the operator to raise it (with "
                               "--threads above it)")
    assert (e.value.reason, e.value.metadata) == ("LIMIT_EXCEEDED", {"limit": "2", "held": "1"})



def test_only_admissions_with_token_ids_count_as_prefix_lookups():
    """Seed 28, EventHub.after_step: kvservice_prefix_cache_lookup_pages_total counts, per admission that carried
    token ids, its full pages but the last token's ((n - 1) // page_size); an admission without token ids looked
    nothing up and counts 0."""
    rng = np.random.default_rng(2801)
    m = make_manager()
    api = ManagerAPI(m)
    key = ("p", 0)
    n = [int(v) for v in rng.integers(2 * WPS + 1, 5 * WPS, 3)]
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([1, 2, 3]), admit_num_tokens=_i64(n)))
    assert m.events.lookup_pages.get(key, 0) == 0
    k = [int(v) for v in rng.integers(WPS + 1, 3 * WPS, 2)]
    tokens = rng.integers(1, 30000, sum(k))
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([4, 5]), admit_num_tokens=_i64(k),
                            admit_token_ids=_i64(tokens)))
    want = sum((x - 1) // WPS for x in k)
    assert want > 0 and m.events.lookup_pages[key] == want
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([6]), admit_num_tokens=_i64([3 * WPS + 2])))
    assert m.events.lookup_pages[key] == want
