"""A snapshot whose write fails (kvservice/state/journal_snapshots.py, _write_capture; docs/DURABILITY.md): the
journal keeps serving, logs one ERROR "snapshot at <seq> failed (<ErrorClass>: <text>); recovery replays the longer
tail" (and no success line), counts no snapshot, keeps the older snapshot position, tries again compact_every // 2
entries later, and the pools that capture exported are exported anew by the next one, which is counted."""

from __future__ import annotations

import logging

from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig

from .test_journal import setup_pools
from .test_journal_edges import FailingSnapshots


def test_a_failed_snapshot_write_is_logged_keeps_the_old_position_and_re_exports_its_pools(caplog):
    config = JournalConfig(sync="normal", compact_every=1000, background_snapshots=False)
    store = FailingSnapshots(fail=1)
    j = Journal(BlockManager(), store, config)
    setup_pools(j)                                         # 4 entries, pools a, b and c
    with caplog.at_level(logging.INFO, logger="kvservice.state.journal"):
        j.snapshot()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvservice.state.journal"]
    assert said == [(logging.ERROR, "snapshot at 4 failed (OSError: [Errno 28] No space left on device); recovery "
                                    "replays the longer tail")]
    assert (j.failed, j.snapshots, j.snapshot_seq, j.seq, j.snapshot_bytes, j.snapshot_seconds) == \
        (None, 0, 0, 4, 0, 0.0)
    assert j.wait_for_snapshot(0) and j.tail_bytes > 0
    assert j._compact_at == 4 + 500 and j._dirty == {"a", "b", "c"} and j._states == {}
    j.snapshot()
    assert (j.snapshots, j.snapshot_seq, store.tried, j.tail_bytes) == (1, 4, [4, 4], 0)
    assert j._dirty == set() and set(j._states) == {"a", "b", "c"}
