"""Seed 27's state survivors:

- a recovery rebuilds the replies of the last entries whose requests' bytes add up to at most reply_cache_bytes
  (JournalConfig's docstring: "at most reply_cache_bytes of their requests"), for a bound that cuts through the
  tail (not only one so small that a single entry is over it);
- a request without request_id is not fingerprinted: its digest is read only to answer or remember a retry, so a
  Step that cannot be retried does not pay for hashing its bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.wire import to_tensor
from kvservice.state import journal as journal_mod
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from .test_journal import setup_pools, workload
from .test_journal_backends import SqliteBackend
from .test_replay_replies import Recorder, built, config  # noqa: F401  (built: a fixture)


@pytest.mark.parametrize("m", [2, 5, 11])
def test_the_replies_rebuilt_are_the_last_entries_whose_requests_fit_the_byte_bound(tmp_path, built, m):  # noqa: F811
    backend = SqliteBackend(tmp_path)
    j = backend.open(config())
    rec = Recorder(j)
    setup_pools(rec)
    workload(rec, np.random.default_rng(2700 + m), 30)
    sizes = [len(e.request) for e in j.store.entries_after(0)]
    assert len(rec.steps) > m and all(sizes)
    acknowledged = state_tree(j.manager)
    backend.crash(j)
    for slack in (0, sizes[-m - 1] - 1):             # the bound: the last m entries' bytes, up to one byte short of
        built[True] = built[False] = 0               # taking the entry before them
        j2 = backend.open(config(reply_cache_bytes=sum(sizes[-m:]) + slack))
        assert built == {True: m, False: len(rec.steps) - m}, slack      # the last m entries are Steps
        assert state_tree(j2.manager) == acknowledged
        j2.close(snapshot=False)


class _Counting:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def test_a_request_without_request_id_is_not_fingerprinted(tmp_path, monkeypatch):
    backend = SqliteBackend(tmp_path)
    j = backend.open(config())
    rec = Recorder(j)
    setup_pools(rec)
    whole = _Counting(journal_mod.digest)
    monkeypatch.setattr(journal_mod, "digest", whole)
    prefix = j._digests = _Counting(j._digests)
    rec.execute("Step", pb.StepRequest(pool="a", admit_seq_ids=_t([5, 6], np.uint64),
                                       admit_num_tokens=_t([3, 40], np.int64)))
    ext = pb.StepRequest(pool="a", extend_seq_ids=_t([5, 6], np.uint64), extend_num_tokens=_t([1, 1], np.int64))
    rec.execute("Step", ext)
    rec.execute("DeletePool", pb.DeletePoolRequest(pool="c"))
    assert (prefix.calls, whole.calls) == (0, 0)
    ext.request_id = "r1"
    rec.execute("Step", ext)
    rec.execute("DeletePool", pb.DeletePoolRequest(pool="b", request_id="r2"))
    assert (prefix.calls, whole.calls) == (1, 1)      # a Step through the prefix digests, the others whole
    j.close()


def _t(values, dtype):
    return to_tensor(np.asarray(values, dtype=dtype))
