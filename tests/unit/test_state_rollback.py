"""Rolled-back state is refused by the manager when it can prove it, and every state carries its lineage.

Issue 26, report 4: a journal WAL truncated after the last snapshot was served up to 81 Steps behind, and the
log called the cut "a commit cut short by a crash (never acknowledged)". Here the acknowledged high-water mark
(ACKED, kvservice/state/ackmark.py) refuses such a state, the refusal leaves the evidence as it found it,
`check-state` says the same, and `--repair` accepts it only as a new lineage.
"""

import contextlib
import io
import json
import logging
import shutil
import sqlite3

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.server.cli import check_state
from kvservice.state import snapshot as snap
from kvservice.state.ackmark import AckMark
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.sqlite.store import write_manifest
from kvservice.state.sqlite.wal import db_header
from kvservice.state.stores import MemoryStore, lineage_hex
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from .test_journal import run, setup_pools, step_req, workload
from .test_state_integrity import crash_copy

CONFIG = JournalConfig(sync="normal", compact_every=30, background_snapshots=False)


def cut_after_the_last_snapshot(tmp_path, tail: int = 20):
    """A crashed state dir whose WAL ends right after the newest snapshot's commit, while `tail` acknowledged
    Steps followed it. Returns (live copy before the cut, wal size at the cut, position there, position acknowledged,
    state at the cut, lineage)."""
    d = tmp_path / "live"
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    workload(j, np.random.default_rng(11), 35)
    assert j.snapshot_seq > 0
    j.snapshot()                                           # the newest snapshot: at the cut
    cut, at, at_cut = (d / "state.db-wal").stat().st_size, j.seq, state_tree(j.manager)
    for i in range(tail):                                  # acknowledged, journaled after the snapshot only in the WAL
        run(j, "Step", step_req("a", admit=[50_000 + i], n=[3], rid=f"tail-{i}"))
    assert j.snapshot_seq == at and j.seq == at + tail
    image = crash_copy(d, tmp_path / "crashed")
    lineage = j.lineage
    j.close(snapshot=False)
    return image, cut, at, at + tail, at_cut, lineage


def checked(d, repair=False):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = check_state(str(d), repair=repair)
    return code, out.getvalue()


@pytest.mark.parametrize("where", ["at a frame boundary", "inside a frame"])
def test_a_wal_cut_after_the_last_snapshot_is_refused_naming_what_was_acknowledged(tmp_path, caplog, where):
    image, cut, at, acked, _, _ = cut_after_the_last_snapshot(tmp_path)
    wal = image / "state.db-wal"
    page = db_header(image / "state.db")[0]
    size = cut if where == "at a frame boundary" else cut + 24 + page // 3
    assert (cut - 32) % (24 + page) == 0 and wal.stat().st_size > size
    with open(wal, "r+b") as f:
        f.truncate(size)
    evidence = {p.name: p.read_bytes() for p in image.iterdir() if p.is_file() and p.name not in ("lock",)}
    caplog.set_level(logging.INFO, logger="kvservice")
    with pytest.raises(StateError) as exc:
        Journal.open(image, config=CONFIG)
    err = exc.value
    assert err.reason == "STATE_ROLLBACK" and err.metadata == {"acknowledged": str(acked), "recovered": str(at)}
    assert f"ACKED) says position {acked} was acknowledged, but the journal holds only {at}" in err.message
    assert f"changes {at + 1}..{acked} are lost" in err.message and "--repair" in err.message
    assert "never acknowledged" not in caplog.text + err.message          # the false claim of the issue
    after = {p.name: p.read_bytes() for p in image.iterdir() if p.is_file() and p.name in evidence}
    assert after == evidence, "a refused start changed the state dir (SQLite checkpointed the log it refused)"
    code, report = checked(image)
    assert code == 2 and "STATE_ROLLBACK" in report and f"says position {acked} was acknowledged" in report


def test_repair_accepts_the_loss_as_a_new_lineage(tmp_path):
    image, cut, at, _, at_cut, lineage = cut_after_the_last_snapshot(tmp_path)
    with open(image / "state.db-wal", "r+b") as f:
        f.truncate(cut)
    code, report = checked(image, repair=True)
    assert code == 0 and "accepted (repair)" in report and "new lineage" in report, report
    j = Journal.open(image, config=CONFIG)
    try:
        assert j.seq == at and state_tree(j.manager) == at_cut
        assert j.lineage not in (0, lineage)             # nobody can prove it continues what clients were told
        reply = run(j, "Step", step_req("a", admit=[60_000], n=[2]))
        assert (reply.position.lineage, reply.position.seq) == (j.lineage, at + 1)
        manifest = json.loads((image / "MANIFEST").read_text())
        assert manifest["lineage"] == lineage_hex(j.lineage) and manifest["acked_mark"] is True
    finally:
        j.close()


def test_a_missing_or_foreign_mark_is_refused(tmp_path):
    image, _, _, acked, _, lineage = cut_after_the_last_snapshot(tmp_path, tail=3)
    gone = shutil.copytree(image, tmp_path / "gone")
    (gone / "ACKED").unlink()
    with pytest.raises(StateError, match=r"high-water mark \(ACKED\) is missing"):
        Journal.open(gone, config=CONFIG)
    foreign = shutil.copytree(image, tmp_path / "foreign")
    m = AckMark(foreign / "ACKED")
    m.reset(lineage ^ 1, acked)                            # another state dir's mark
    m.close()
    with pytest.raises(StateError, match=f"belongs to lineage {lineage_hex(lineage ^ 1)}"):
        Journal.open(foreign, config=CONFIG)
    j = Journal.open(image, config=CONFIG)                 # the untouched crash image recovers exactly
    try:
        assert (j.seq, j.lineage) == (acked, lineage)
    finally:
        j.close()


def test_a_state_dir_of_an_older_kvservice_gets_a_lineage_and_a_mark(tmp_path):
    """No lineage in state.db or the MANIFEST, no ACKED (written before lineages): served, and from then on kept."""
    d = tmp_path / "old"
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    seq = j.seq
    j.close()
    db = sqlite3.connect(d / "state.db")
    db.execute("DELETE FROM meta WHERE key = 'lineage'")
    db.commit()
    db.close()
    m = json.loads((d / "MANIFEST").read_text())
    write_manifest(d, **{k: v for k, v in m.items() if k not in ("lineage", "acked_mark", "format", "updated",
                                                                   "digest")})
    (d / "ACKED").unlink()
    j = Journal.open(d, config=CONFIG)
    try:
        assert j.seq == seq and j.lineage
        assert AckMark(d / "ACKED", writable=False).found.lineage == j.lineage
    finally:
        j.close()
    assert json.loads((d / "MANIFEST").read_text())["acked_mark"] is True


def test_every_reply_and_snapshot_carries_the_lineage_and_a_foreign_snapshot_is_refused(tmp_path):
    d = tmp_path / "s"
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    lineage = j.lineage
    created = j.execute("GetPool", pb.GetPoolRequest(pool="a"), j.api.GetPool)
    reads = [j.read(pb.GetStatsRequest(), j.api.GetStats), j.read(pb.ListPoolsRequest(), j.api.ListPools),
             j.read(pb.ListSequencesRequest(pool="a"), j.api.ListSequences),
             j.stamp(j.api.ListWorkers(pb.ListWorkersRequest()))]
    for reply in [created, *reads]:
        assert (reply.position.lineage, reply.position.seq) == (lineage, j.seq), type(reply).__name__
    j.snapshot()
    (name,) = [p.name for p in (d / "snapshots").iterdir()]
    j.close()
    assert snap.decode((d / "snapshots" / name).read_bytes()).lineage == lineage
    db = sqlite3.connect(d / "state.db")                    # the database now says it is another state's
    db.execute("UPDATE meta SET value = ? WHERE key = 'lineage'", (lineage_hex(lineage ^ 2),))
    db.commit()
    db.close()
    with pytest.raises(StateError, match="database comes from another state dir"):
        Journal.open(d, config=CONFIG)


def test_in_memory_state_is_a_new_lineage_per_process_and_a_rebuild_keeps_it():
    a, b = MemoryStore(), MemoryStore()
    assert a.lineage and b.lineage and a.lineage != b.lineage
    j = Journal.recover(a)
    setup_pools(j)
    j.snapshot()
    again = Journal.recover(a)                              # the journal's own rebuild path (resync)
    assert again.lineage == j.lineage == a.lineage
