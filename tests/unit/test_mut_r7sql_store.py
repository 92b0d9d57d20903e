"""SqliteStore's whole contract where earlier tests checked only part of it: every refusal of load_snapshot and
entries_after with its exact message, SQLite's quick_check finding, the connections recovery and serving use,
the lineage change begin() logs, and what _check_tables and _open say for each witness they refuse.

Oracles: the module docstring of kvservice/state/sqlite/store.py and docs/DURABILITY.md (the layout of DIR, what
each check refuses and its remedy), SQLite's documented behaviour (PRAGMA synchronous numbers FULL = 2 and
NORMAL = 1; quick_check reports a NULL in a NOT NULL column as "NULL value in <table>.<column>"; a ``mode=ro``
connection refuses writes with "attempt to write a readonly database"), and the state dir's files read back by
hand with sqlite3.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.sqlite.store import SqliteStore

from .test_mut_m28e_store import Enc, entries, meta, refused, set_meta, started, stopped, write_manifest_by_hand

RESTORE = "restore the state dir from a backup"
REPAIR = "run `kvservice check-state DIR --repair` to accept the state dir as it is"


def with_snapshot(tmp_path, rng, name="s"):
    """A stopped dir with n entries and a snapshot at `at` (1 < at < n); returns (dir, n, at, encoded)."""
    d = tmp_path / name
    n = int(rng.integers(5, 12))
    st, _ = started(d, rng, n)
    at = int(rng.integers(2, n))
    enc = Enc(rng)
    st.write_snapshot(at, enc)
    st.close(clean=True, seq=n)
    return d, n, at, enc


def sql(d, statement: str, args=()) -> None:
    db = sqlite3.connect(d / "state.db")
    try:
        db.execute(statement, args)
        db.commit()
    finally:
        db.close()


def damaged(err: StateError, said: str) -> None:
    """err is the STATE_DAMAGED refusal whose whole message is `said`, then the remedy: restore from a backup."""
    assert (err.reason, err.message) == ("STATE_DAMAGED", f"{said} {RESTORE}")


# ---- load_snapshot ------------------------------------------------------------------------------------------
def test_load_snapshot_reads_the_recorded_file_and_says_where_it_is(tmp_path):
    """The recorded snapshot: (seq, the file's bytes), and snapshot_where names it relative to DIR."""
    rng = np.random.default_rng(7_01)
    d, n, at, enc = with_snapshot(tmp_path, rng)
    st = SqliteStore.open(d, sync="normal")
    try:
        assert st.location == str(d) and st.durable and not st.readonly and not st.repair and not st.live
        assert st.remedy == "Restore the state dir from a backup (see docs/DURABILITY.md, \"Damaged state\")"
        assert st.load_snapshot() == (at, b"".join(enc.chunks))
        assert st.snapshot_where == f"snapshots/snapshot-{at:012d}.kvs"
    finally:
        st.close(clean=True, seq=n)


@pytest.mark.parametrize("name", ["../snapshot-000000000004.kvs", "sub/snapshot-000000000004.kvs",
                                  "other-000000000004.kvs", "Snapshot-000000000004.kvs"])
def test_a_snapshot_record_naming_a_file_outside_the_snapshot_dir_is_refused(tmp_path, name):
    """Only DIR/snapshots/snapshot-*: any other name in the record is damage, named as recorded."""
    rng = np.random.default_rng(7_02)
    d, n, _, _ = with_snapshot(tmp_path, rng)
    sql(d, "UPDATE snapshots SET file = ?", (name,))
    st = SqliteStore.open(d, sync="normal")
    try:
        with pytest.raises(StateError) as ei:
            st.load_snapshot()
        assert st.snapshot_where == f"snapshots/{name}"
    finally:
        st.close(clean=True, seq=n)
    damaged(ei.value, f"{d / 'state.db'}: the snapshot record names {name!r} (damaged).")


def test_a_snapshot_record_that_cannot_be_read_is_refused(tmp_path):
    """The record of the newest snapshot gone between open and load: damage, with Python's own words."""
    rng = np.random.default_rng(7_03)
    d, n, at, _ = with_snapshot(tmp_path, rng)
    st = SqliteStore.open(d, sync="normal")
    try:
        assert st.snapshot_seq == at
        sql(d, "DELETE FROM snapshots")
        with pytest.raises(StateError) as ei:
            st.load_snapshot()
    finally:
        st.close(clean=True, seq=n)
    damaged(ei.value, f"{d / 'state.db'}: the snapshot record cannot be read (cannot unpack non-iterable "
                      f"NoneType object).")


def test_a_snapshot_gone_beside_a_running_manager_asks_to_check_again(tmp_path):
    """check-state beside a running manager: a snapshot file missing may have been replaced meanwhile."""
    rng = np.random.default_rng(7_04)
    d, n, at, _ = with_snapshot(tmp_path, rng)
    w = SqliteStore.open(d, sync="normal")
    w.begin(n)
    ro = SqliteStore.open(d, readonly=True)
    f = d / "snapshots" / f"snapshot-{at:012d}.kvs"
    try:
        assert ro.live and ro.readonly and ro.snapshot_seq == at
        assert ro.notes == ["a manager is running on this dir: checked through an online copy; its write-ahead log "
                            "was not checked"]
        f.unlink()
        with pytest.raises(StateError) as ei:
            ro.load_snapshot()
    finally:
        ro.close(clean=True, seq=n)
        w.close(clean=True, seq=n)
    damaged(ei.value, f"{f}: the snapshot at {at} is missing (the running manager replaced it meanwhile: run the "
                      f"check again); the entries it covers were dropped, so the state cannot be rebuilt without it.")


def test_load_snapshot_without_a_snapshot_is_none(tmp_path):
    rng = np.random.default_rng(7_05)
    d, _ = stopped(tmp_path, "s", rng)
    st = SqliteStore.open(d, sync="normal")
    try:
        assert st.snapshot_seq == 0 and st.load_snapshot() is None
    finally:
        st.close(clean=True, seq=0)


# ---- entries_after ------------------------------------------------------------------------------------------
def test_an_entry_that_cannot_be_read_is_refused_after_the_ones_before_it(tmp_path):
    """Entries come in seq order; a row whose fields do not convert stops the reading with a named StateError."""
    rng = np.random.default_rng(7_06)
    d = tmp_path / "s"
    st, es = started(d, rng, 5)
    st.close(clean=True, seq=5)
    sql(d, "INSERT INTO entries VALUES (?, ?, ?, ?, ?)", (6, "Step", b"x", "soon", b"d" * 16))
    st = SqliteStore.open(d, sync="normal")
    got = []
    try:
        with pytest.raises(StateError) as ei:
            for e in st.entries_after(2):
                got.append(e)
    finally:
        st.close(clean=True, seq=5)
    assert got == es[2:]
    damaged(ei.value, f"{d / 'state.db'}: journal entries cannot be read (ValueError: could not convert string to "
                      f"float: 'soon').")


# ---- _connect -----------------------------------------------------------------------------------------------
def null_in(d, table: str, column: str, decl: str, row: tuple) -> None:
    """A row with NULL in a NOT NULL column, written by lifting the constraint for one insert (writable_schema)."""
    db = sqlite3.connect(d / "state.db", isolation_level=None)
    db.execute("PRAGMA writable_schema=ON")
    db.execute("UPDATE sqlite_schema SET sql = replace(sql, ?, ?) WHERE name = ?", (decl + " NOT NULL", decl, table))
    db.close()
    db = sqlite3.connect(d / "state.db", isolation_level=None)
    db.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(row))})", row)
    db.execute("PRAGMA writable_schema=ON")
    db.execute("UPDATE sqlite_schema SET sql = replace(sql, ?, ?) WHERE name = ?", (decl, decl + " NOT NULL", table))
    db.close()


@pytest.mark.parametrize("readonly", [False, True])
def test_what_sqlites_quick_check_finds_is_refused_in_its_words(tmp_path, readonly):
    rng = np.random.default_rng(7_07 + readonly)
    d, _ = stopped(tmp_path, "s", rng)
    null_in(d, "entries", "method", "method TEXT", (99, None, b"r", 1.0, b"d" * 16))
    null_in(d, "snapshots", "file", "file TEXT", (98, None, b"h" * 16, 10, 1.0))
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, readonly=readonly, sync="normal")
    head, tail = f"{d / 'state.db'}: SQLite finds the database damaged: ", f". {RESTORE}"
    msg = ei.value.message
    assert ei.value.reason == "STATE_DAMAGED" and msg.startswith(head) and msg.endswith(tail)
    found = msg[len(head):-len(tail)].split("; ")                     # in SQLite's order (b-tree pages)
    assert sorted(found) == ["NULL value in entries.method", "NULL value in snapshots.file"]


@pytest.mark.parametrize(("sync", "level"), [("full", 2), ("normal", 1), ("off", 0)])
def test_recovery_reads_read_only_and_begin_reopens_read_write_with_the_sync_level(tmp_path, sync, level):
    """Recovery's connection: WAL mode, the configured synchronous level, and no writes (a refused start leaves
    the dir as it was); after begin() the same level on a connection that writes. A fresh dir writes at once."""
    rng = np.random.default_rng(7_08)
    d, _ = stopped(tmp_path, "s", rng)
    st = SqliteStore.open(d, sync=sync)
    try:
        assert st.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert st.db.execute("PRAGMA synchronous").fetchone() == (level,)
        with pytest.raises(sqlite3.OperationalError, match="attempt to write a readonly database"):
            st.db.execute("INSERT INTO meta VALUES ('x', 'y')")
        assert st.mark.sync == (sync == "full") and st.mark.required
        assert st.begin(4) == 2
        assert st.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert st.db.execute("PRAGMA synchronous").fetchone() == (level,)
        t = threading.Thread(target=st.append, args=(entries(rng, 5, 1)[0],))    # the snapshot thread writes too
        t.start()
        t.join()
        assert [e.seq for e in st.entries_after(0)] == [1, 2, 3, 4, 5]
    finally:
        st.close(clean=True, seq=5)
    fresh = SqliteStore.open(tmp_path / "fresh", sync=sync)
    try:
        assert fresh.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert fresh.db.execute("PRAGMA synchronous").fetchone() == (level,)
        t = threading.Thread(target=fresh.db.execute, args=("INSERT INTO meta VALUES ('x', 'y')",))
        t.start()
        t.join()
        assert meta(tmp_path / "fresh") == {"format": "2", "incarnation": "0", "x": "y"}
    finally:
        fresh.close(clean=True, seq=0)


# ---- begin --------------------------------------------------------------------------------------------------
def test_begin_logs_the_lineage_it_leaves_and_why(tmp_path, caplog):
    """A repaired witness check gives the state a new lineage: begin() logs the old one, the accepted checks and
    the new one (a warning), and notes it; a first start's lineage is no change and logs nothing."""
    rng = np.random.default_rng(7_09)
    caplog.set_level(logging.INFO, logger="kvservice.state.journal")
    d = tmp_path / "s"
    st = SqliteStore.open(d, sync="normal")
    st.begin(0)
    first = st.lineage
    st.close(clean=True, seq=0)
    assert first and [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    write_manifest_by_hand(d, lineage=f"{first ^ 0xFF:016x}")
    st = SqliteStore.open(d, sync="normal", repair=True)
    try:
        why = st.overridden
        assert why == [f"{d}: state.db belongs to lineage {first:016x} but MANIFEST to {first ^ 0xFF:016x}: the "
                       f"database comes from another state dir. {RESTORE}, or {REPAIR}"]
        assert st.notes == [f"accepted (repair): {why[0]}"]
        st.begin(0)
        new = st.lineage
    finally:
        st.close(clean=True, seq=0)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        f"{d}: the state no longer provably continues lineage {first:016x} ({why[0]}); it starts lineage "
        f"{new:016x}: clients see a new history"]
    assert st.notes[1:] == [f"new lineage {new:016x} (was {first:016x})"]
    assert meta(d)["lineage"] == f"{new:016x}" and new != first
    del rng


# ---- _check_tables and _open: each refusal whole ------------------------------------------------------------
def test_each_table_check_refuses_with_its_whole_message(tmp_path):
    rng = np.random.default_rng(7_10)
    d, lin = stopped(tmp_path, "inc", rng)
    set_meta(d, "incarnation", "3")
    err = refused(d)
    assert (err.reason, err.message) == (
        "STATE_DAMAGED", f"{d}: state.db is at incarnation 3 but MANIFEST at 1: the database was replaced by another "
        f"copy. {RESTORE}, or {REPAIR}")
    set_meta(d, "incarnation", "0")                                   # behind the MANIFEST: replaced too
    assert refused(d).message.startswith(f"{d}: state.db is at incarnation 0 but MANIFEST at 1:")

    for key, value in (("incarnation", "1x"), ("lineage", "zz")):
        d, lin = stopped(tmp_path, f"bad-{key}", rng)
        set_meta(d, key, value)
        inc, lineage = ("'1x'", f"'{lin:016x}'") if key == "incarnation" else ("'1'", "'zz'")
        err = refused(d)
        assert (err.reason, err.message) == (
            "STATE_DAMAGED", f"{d / 'state.db'}: incarnation {inc} or lineage {lineage} is damaged. {RESTORE}")

    d, lin = stopped(tmp_path, "noinc", rng)
    sql(d, "DELETE FROM meta WHERE key = 'incarnation'")
    assert refused(d).message == f"{d / 'state.db'}: incarnation None or lineage '{lin:016x}' is damaged. {RESTORE}"

    d, _ = stopped(tmp_path, "nofmt", rng)
    sql(d, "DELETE FROM meta WHERE key = 'format'")
    err = refused(d)
    assert (err.reason, err.message) == ("STATE_FORMAT", f"{d / 'state.db'}: state format ? is not 2. {RESTORE}")


def test_a_database_behind_the_manifests_snapshot_names_the_one_it_has(tmp_path):
    rng = np.random.default_rng(7_11)
    d, n, at, _ = with_snapshot(tmp_path, rng)
    write_manifest_by_hand(d, snapshot_seq=at + 3)
    err = refused(d)
    assert (err.reason, err.message) == (
        "STATE_DAMAGED", f"{d}: MANIFEST records a snapshot at {at + 3} but state.db only one at {at}: {RESTORE}")
    st = SqliteStore.open(d, sync="normal", repair=True)
    try:
        assert st.overridden == [err.message] and st.notes == [f"accepted (repair): {err.message}"]
        assert st.snapshot_seq == at
    finally:
        st.close(clean=True, seq=n)


def test_a_lineage_free_database_or_manifest_is_not_a_lineage_mismatch(tmp_path):
    """Only two lineages that both exist and differ are a mismatch (state written before lineages has none)."""
    rng = np.random.default_rng(7_12)
    d, lin = stopped(tmp_path, "s", rng)
    write_manifest_by_hand(d, lineage="")
    st = SqliteStore.open(d, sync="normal")
    assert st.lineage == lin and st.overridden == []
    st.close(clean=True, seq=4)
    d, lin = stopped(tmp_path, "t", rng)
    set_meta(d, "lineage", "0")
    write_manifest_by_hand(d, lineage=f"{lin ^ 1:016x}")
    st = SqliteStore.open(d, sync="normal")
    assert st.lineage == 0 and st.overridden == []
    st.close(clean=True, seq=4)


def test_a_repair_without_a_readable_manifest_or_database_says_what_it_does_not_know(tmp_path):
    """--repair accepts a damaged MANIFEST, but a missing state.db is still refused: the figures it would have
    named come from the MANIFEST, so each is '?'."""
    rng = np.random.default_rng(7_13)
    d, _ = stopped(tmp_path, "s", rng)
    (d / "MANIFEST").write_bytes(b"{ damaged")
    (d / "state.db").unlink()
    err = refused(d, repair=True)
    assert (err.reason, err.message) == (
        "STATE_DAMAGED", f"{d}: state.db is missing or empty, but MANIFEST says this dir holds state (incarnation ?, "
        f"at least ? changes acknowledged, snapshot at ?): {RESTORE}")


@pytest.mark.parametrize("failure", [OSError(5, "Input/output error"), StateError("ACKED cannot be written")])
def test_close_releases_everything_even_when_the_mark_cannot_be_closed(tmp_path, failure):
    """A mark that could not be written already failed the journal: closing the store still closes the database
    and gives the dir's lock back (another manager may start), without raising."""
    rng = np.random.default_rng(7_14)
    d = tmp_path / "s"
    st, _ = started(d, rng, 3)
    real = st.mark.close

    def failing():
        real()
        raise failure

    st.mark.close = failing
    st.close(clean=True, seq=3)
    assert st.db is None
    again = SqliteStore.open(d, sync="normal")
    assert again.incarnation == 1 and [e.seq for e in again.entries_after(0)] == [1, 2, 3]
    again.close(clean=True, seq=3)


def test_a_read_only_open_writes_nothing_and_removes_its_private_copy(tmp_path):
    """check-state reads a copy of the database in a temp dir of its own (kvservice-check-*), removed on close;
    every file of the dir is left byte for byte as it was, and no ACKED is created."""
    rng = np.random.default_rng(7_15)
    d, n, at, enc = with_snapshot(tmp_path, rng)
    (d / "ACKED").unlink()
    write_manifest_by_hand(d, acked_mark=False)
    before = {p.name: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    ro = SqliteStore.open(d, readonly=True)
    try:
        copy = ro._copy_dir
        assert copy.name.startswith("kvservice-check-") and (copy / "state.db").is_file()
        assert ro.readonly and not ro.live and not ro.mark.required
        assert ro.load_snapshot() == (at, b"".join(enc.chunks))
        assert [e.seq for e in ro.entries_after(at)] == list(range(at + 1, n + 1))
    finally:
        ro.close(clean=True, seq=n)
    assert not copy.exists() and (ro.db, ro._copy_dir) == (None, None)
    ro = SqliteStore.open(d, readonly=True)
    shutil.rmtree(ro._copy_dir)                      # a temp cleaner was first: closing still succeeds
    ro.close(clean=True, seq=n)
    assert (ro.db, ro._copy_dir) == (None, None)
    assert {p.name: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before


def test_an_unclean_stop_one_incarnation_ahead_without_its_log_is_accepted(tmp_path):
    """The lost-log check is for the incarnation the MANIFEST names: a database one ahead (a start that stopped
    before writing its MANIFEST) has checkpointed everything, so its missing log loses nothing."""
    rng = np.random.default_rng(7_16)
    d, _ = stopped(tmp_path, "s", rng)
    write_manifest_by_hand(d, running=True)
    set_meta(d, "incarnation", "2")
    (d / "state.db-wal").unlink(missing_ok=True)
    st = SqliteStore.open(d, sync="normal")
    try:
        assert (st.incarnation, st.overridden, st.notes) == (2, [], [])
    finally:
        st.close(clean=True, seq=4)


def test_open_creates_a_missing_state_dir_with_its_parents(tmp_path):
    d = tmp_path / "a" / "b" / "state"
    st = SqliteStore.open(d, sync="normal")
    try:
        assert st.begin(0) == 1
    finally:
        st.close(clean=True, seq=0)
    assert {"state.db", "MANIFEST", "ACKED", "lock"} <= set(os.listdir(d))


@pytest.mark.parametrize("readonly", [False, True])
def test_a_store_may_be_read_from_another_thread_than_the_one_that_opened_it(tmp_path, readonly):
    """Every connection is opened with check_same_thread=False (the journal's snapshot thread shares it): recovery's
    reads and check-state's work from any thread."""
    rng = np.random.default_rng(7_17)
    d, n, at, enc = with_snapshot(tmp_path, rng)
    st = SqliteStore.open(d, sync="normal", readonly=readonly)
    got = []
    try:
        t = threading.Thread(target=lambda: got.append((st.load_snapshot(), [e.seq for e in st.entries_after(at)])))
        t.start()
        t.join()
    finally:
        st.close(clean=True, seq=n)
    assert got == [((at, b"".join(enc.chunks)), list(range(at + 1, n + 1)))]
