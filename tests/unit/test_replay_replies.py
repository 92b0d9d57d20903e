"""A restart rebuilds the replies of the last ``replay_replies`` journal entries only; the Steps before them are
replayed without page tables, slot mappings or a reply (ManagerAPI.apply_step), and reach the same state.

Oracle: the replies the live journal sent before the crash (built with tables, never replayed) and its exported
state; a retry of an early Step after the restart must be refused REQUEST_ALREADY_APPLIED, never applied twice.
"""

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal import JournalConfig
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from .test_journal import body, prefix_workload, setup_pools, workload
from .test_journal_backends import MemoryBackend, SqliteBackend


class Recorder:
    """Sends every request to the journal and records each applied Step (request copy, reply body) in order."""

    def __init__(self, j):
        self.j, self.steps = j, []

    def execute(self, method, req, _apply=None):
        sent = type(req)()
        sent.CopyFrom(req)
        reply = self.j.execute(method, req, getattr(self.j.api, method))
        if method == "Step":
            self.steps.append((sent, body(reply)))
        return reply

    @property
    def manager(self):
        return self.j.manager

    @property
    def api(self):
        return self.j.api


@pytest.fixture
def built(monkeypatch):
    """Counts ManagerAPI.run_step calls by whether they built slot mappings and tables (True) or not (False)."""
    counts = {True: 0, False: 0}
    real = ManagerAPI.run_step

    def counting(self, pool, step, cost_checked=False, tables=None, mappings=True):
        counts[bool(mappings)] += 1
        return real(self, pool, step, cost_checked, tables, mappings)

    monkeypatch.setattr(ManagerAPI, "run_step", counting)
    return counts


def config(**kw):
    return JournalConfig(sync="normal", compact_every=100_000, background_snapshots=False, **kw)


def _retry(j, req):
    again = type(req)()
    again.CopyFrom(req)
    return body(j.execute("Step", again, j.api.Step))


@pytest.mark.parametrize("backend_cls", [MemoryBackend, SqliteBackend], ids=["memory", "sqlite"])
@pytest.mark.parametrize("keep", [0, 7, 100_000])
def test_a_restart_rebuilds_the_replies_of_the_last_entries_only(tmp_path, backend_cls, keep, built):
    backend = backend_cls(tmp_path)
    j = backend.open(config(replay_replies=keep))
    rec = Recorder(j)
    setup_pools(rec)
    workload(rec, np.random.default_rng(keep % 97 + 3), 60)
    prefix_workload(rec, np.random.default_rng(keep % 89 + 5), 40)
    acknowledged = state_tree(j.manager)
    total = j.seq
    backend.crash(j)
    built[True] = built[False] = 0
    j2 = backend.open(config(replay_replies=keep))
    assert j2.replayed_entries == total                          # no snapshot: the whole journal is replayed
    assert state_tree(j2.manager) == acknowledged
    n_steps = len(rec.steps)
    rebuilt = min(keep, n_steps)                                 # the workloads' Steps are the journal's last entries
    assert built == {True: rebuilt, False: n_steps - rebuilt}
    for i, (req, reply) in enumerate(rec.steps):
        if not req.request_id:
            continue
        if i >= n_steps - keep:                                  # one of the last `keep` entries: its original reply
            assert _retry(j2, req) == reply, f"step {i} of {n_steps}"
        else:                                                    # known, reply not rebuilt: refused, not re-applied
            with pytest.raises(AlreadyExists) as e:
                _retry(j2, req)
            assert e.value.reason == "REQUEST_ALREADY_APPLIED"
            assert f"the last {keep} Steps" in e.value.message
    assert state_tree(j2.manager) == acknowledged                # the retries changed nothing
    assert j2.seq == total
    j2.close()


def test_the_replies_rebuilt_are_bounded_by_their_requests_bytes(tmp_path, built):
    backend = SqliteBackend(tmp_path)
    j = backend.open(config())
    rec = Recorder(j)
    setup_pools(rec)
    workload(rec, np.random.default_rng(11), 30)
    steps = rec.steps
    backend.crash(j)
    built[True] = built[False] = 0
    j2 = backend.open(config(reply_cache_bytes=1))              # every request is over the bound: the last one only
    assert built == {True: 1, False: len(steps) - 1}
    older = [req for req, _ in steps[:-1] if req.request_id][-1]
    with pytest.raises(AlreadyExists):                          # (the 1-byte reply cache drops the last reply too)
        _retry(j2, older)
    j2.close()


def test_rebuilding_the_manager_alone_builds_no_tables(tmp_path, built):
    backend = SqliteBackend(tmp_path)
    j = backend.open(config())
    rec = Recorder(j)
    setup_pools(rec)
    workload(rec, np.random.default_rng(12), 40)
    prefix_workload(rec, np.random.default_rng(13), 20)
    built[True] = built[False] = 0
    scratch = BlockManager(j.manager.workers.lease_seconds)
    assert j._load(scratch, None) == j.seq                      # what the journal does after an unexpected error
    assert built == {True: 0, False: len(rec.steps)}
    assert state_tree(scratch) == state_tree(j.manager)
    j.close()


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_a_snapshot_keeps_the_last_snapshot_replies_replies(n):
    w = IdempotencyWindow(JournalConfig(snapshot_replies=n))
    replies = [pb.DeletePoolReply() for _ in range(4)]
    for i, r in enumerate(replies):
        w.remember(f"id{i}", "DeletePool", bytes([i]), i + 1, 1e9 + i, r)
    ids, kept = w.capture()
    assert [i[0] for i in ids] == ["id0", "id1", "id2", "id3"]
    assert [rid for rid, _, _ in kept] == ["id0", "id1", "id2", "id3"][4 - min(n, 4):]
