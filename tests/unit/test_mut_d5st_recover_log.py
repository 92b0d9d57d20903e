"""Journal.recover's one INFO line, read back whole: where the state came from (the store's location), the
snapshot position it started from, how many entries it replayed and in how long, the lineage as 16 hex digits,
the new incarnation and the pools it holds ("none" if it holds none). The positions are counted by hand here:
each accepted request is one journal entry."""

from __future__ import annotations

import logging
import re

import numpy as np

from kvservice.state.journal import Journal, JournalConfig
from tests.unit.test_journal import crash, run, setup_pools, step_req


def recovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvservice.state.journal" and r.getMessage().startswith("recovered ")]


def line_re(where, snap, replayed, lineage, incarnation, pools) -> str:
    return (f"recovered {re.escape(str(where))}: snapshot at {snap}, {replayed} entries replayed in "
            rf"\d+\.\d{{3}} s, lineage {lineage:016x}, incarnation {incarnation}, pools: {re.escape(pools)}")


def test_recovery_logs_its_source_position_replay_lineage_incarnation_and_pools(tmp_path, caplog):
    """A fresh dir: snapshot at 0, 0 entries, incarnation 1, pools none. After 4 setup entries, a forced snapshot
    and k more Steps, a crash and a restart: snapshot at 4, k entries replayed, incarnation 2, pools a, b, c."""
    caplog.set_level(logging.INFO, logger="kvservice.state.journal")
    cfg = JournalConfig(sync="normal", compact_every=10_000, background_snapshots=False)
    j = Journal.open(tmp_path, config=cfg)
    lines = recovery_lines(caplog)
    assert len(lines) == 1
    assert re.fullmatch(line_re(tmp_path, 0, 0, j.lineage, 1, "none"), lines[0]), lines[0]
    assert (j.replayed_entries, j.incarnation) == (0, 1)
    setup_pools(j)                         # 3 CreatePool + 1 RegisterWorker: 4 entries
    assert j.seq == 4
    j.snapshot(force=True)
    k = int(np.random.default_rng(55).integers(3, 9))
    for i in range(k):
        run(j, "Step", step_req("a", admit=[100 + i], n=[5]))
    assert j.seq == 4 + k
    lineage = j.lineage
    crash(j)
    caplog.clear()
    j2 = Journal.open(tmp_path, config=cfg)
    try:
        lines = recovery_lines(caplog)
        assert len(lines) == 1
        assert re.fullmatch(line_re(tmp_path, 4, k, lineage, 2, "a, b, c"), lines[0]), lines[0]
        assert (j2.snapshot_seq, j2.replayed_entries, j2.incarnation, j2.seq) == (4, k, 2, 4 + k)
        assert j2.recovery_seconds >= 0
    finally:
        crash(j2)
