"""SqliteStore's files read back by hand: state.db's tables (sqlite3), MANIFEST (JSON + blake2b), ACKED (struct).

The layouts are the ones written in kvservice/state/sqlite/store.py's and ackmark.py's docstrings and
docs/DURABILITY.md; the store is driven through its JournalStore calls, without a Journal.
"""

import hashlib
import json
import sqlite3
import struct

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.sqlite.store import SqliteStore
from kvservice.state.stores import Entry


class Enc:
    """What write_snapshot needs of an encoded snapshot: its header digest, size and chunks (opaque bytes)."""

    def __init__(self, rng):
        body = rng.bytes(int(rng.integers(100, 400)))
        self.header_digest = rng.bytes(16)
        self.chunks = [body[:16], self.header_digest, body[16:]]      # bytes 16-31: the header digest
        self.nbytes = len(body) + 16


def manifest(d) -> dict:
    m = json.loads((d / "MANIFEST").read_bytes())
    body = {k: v for k, v in m.items() if k != "digest"}
    assert m["digest"] == hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    return m


def acked(d) -> list[tuple[int, int]]:
    """(lineage, seq) of both ACKED records (offsets 0 and 512): magic, lineage u64, seq u64, blake2b-128."""
    raw = (d / "ACKED").read_bytes()
    assert len(raw) == 1024
    out = []
    for at in (0, 512):
        magic, lineage, seq = struct.unpack("<8sQQ", raw[at:at + 24])
        assert magic == b"KVACKED1"
        assert raw[at + 24:at + 40] == hashlib.blake2b(raw[at:at + 24], digest_size=16).digest()
        out.append((lineage, seq))
    return out


def meta(d) -> dict:
    db = sqlite3.connect(d / "state.db")
    try:
        return dict(db.execute("SELECT key, value FROM meta").fetchall())
    finally:
        db.close()


def entries(rng, first: int, n: int) -> list[Entry]:
    return [Entry(s, f"M{s % 3}", rng.bytes(int(rng.integers(1, 60))), float(rng.uniform(1, 2e9)))
            for s in range(first, first + n)]


def started(d, rng, n=5):
    """A store opened on a fresh dir, begun at 0, with n entries appended; returns (store, entries)."""
    st = SqliteStore.open(d, sync="normal")
    st.begin(0)
    es = entries(rng, 1, n)
    for e in es:
        st.append(e)
    return st, es


def test_begin_writes_incarnation_lineage_manifest_and_acked(tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "s"
    st, es = started(d, rng)
    lin = st.lineage
    assert lin and st.incarnation == 1
    assert (st.notes, st.overridden, st.live, st.torn_frames) == ([], [], False, 0)
    assert meta(d) == {"format": "2", "incarnation": "1", "lineage": f"{lin:016x}"}
    m = manifest(d)
    assert (m["format"], m["incarnation"], m["running"], m["last_seq"], m["snapshot_seq"], m["lineage"],
            m["acked_mark"]) == (2, 1, True, 0, 0, f"{lin:016x}", True)
    assert acked(d) == [(lin, 0), (lin, 0)]
    st.close(clean=True, seq=5)
    m = manifest(d)
    assert (m["incarnation"], m["running"], m["last_seq"]) == (1, False, 5)
    assert not (d / "state.db-wal").exists() or (d / "state.db-wal").stat().st_size == 0   # checkpointed

    st = SqliteStore.open(d, sync="normal")
    assert (st.incarnation, st.lineage, st.snapshot_seq) == (1, lin, 0)
    assert list(st.entries_after(0)) == es
    assert list(st.entries_after(3)) == es[3:]
    assert st.load_snapshot() is None
    assert st.begin(5) == 2
    assert meta(d)["incarnation"] == "2" and meta(d)["lineage"] == f"{lin:016x}"
    assert (manifest(d)["incarnation"], manifest(d)["last_seq"]) == (2, 5)
    assert acked(d) == [(lin, 4), (lin, 5)]                 # seq 5 at offset 512 (odd), seq 4 at 0
    assert st.notes == []
    st.close(clean=True, seq=5)


def test_write_snapshot_records_it_and_drops_what_it_covers(tmp_path):
    rng = np.random.default_rng(2)
    d = tmp_path / "s"
    st, es = started(d, rng, 9)
    one = Enc(rng)
    st.write_snapshot(4, one)
    (d / "snapshots" / "snapshot-000000000099.kvs.tmp").write_bytes(b"left over")
    two = Enc(rng)
    st.write_snapshot(7, two)
    assert sorted(p.name for p in (d / "snapshots").iterdir()) == ["snapshot-000000000007.kvs",
                                                                   "snapshot-000000000099.kvs.tmp"]
    assert (manifest(d)["snapshot_seq"], manifest(d)["last_seq"]) == (7, 7)
    st.close(clean=True, seq=9)
    db = sqlite3.connect(d / "state.db")
    rows = db.execute("SELECT seq, file, header_digest, nbytes FROM snapshots").fetchall()
    left = [r[0] for r in db.execute("SELECT seq FROM entries ORDER BY seq")]
    db.close()
    assert rows == [(7, "snapshot-000000000007.kvs", two.header_digest, two.nbytes)]
    assert left == [8, 9]

    st = SqliteStore.open(d, sync="normal")
    assert st.snapshot_seq == 7
    assert st.load_snapshot() == (7, b"".join(two.chunks))
    assert list(st.entries_after(7)) == es[7:]
    st.begin(9)                                     # files of snapshots never recorded go
    assert [p.name for p in (d / "snapshots").iterdir()] == ["snapshot-000000000007.kvs"]
    st.close(clean=True, seq=9)

    ro = SqliteStore.open(d, readonly=True)
    assert ro.load_snapshot() == (7, b"".join(two.chunks))
    ro.close(clean=True, seq=9)
    f = d / "snapshots" / "snapshot-000000000007.kvs"
    f.write_bytes(f.read_bytes()[:-1])
    ro = SqliteStore.open(d, readonly=True)
    with pytest.raises(StateError) as ei:
        ro.load_snapshot()
    ro.close(clean=True, seq=9)
    assert ei.value.reason == "STATE_DAMAGED"
    assert f"{two.nbytes - 1} bytes, header digest" in ei.value.message
    got = f.read_bytes()
    assert ei.value.message == (f"{f}: {two.nbytes - 1} bytes, header digest {got[16:32].hex()}; the database "
                                f"recorded {two.nbytes} bytes, {two.header_digest.hex()}: truncated, damaged or "
                                "replaced. restore the state dir from a backup")
    assert got[16:32] == two.header_digest


def test_a_manifest_snapshot_the_database_lacks_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    d = tmp_path / "s"
    st, _ = started(d, rng, 4)
    st.write_snapshot(3, Enc(rng))
    st.close(clean=True, seq=4)
    db = sqlite3.connect(d / "state.db")
    db.execute("DELETE FROM snapshots")
    db.commit()
    db.close()
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, sync="normal")
    assert "MANIFEST records a snapshot at 3 but state.db has none" in ei.value.message


def test_a_repair_starts_a_new_lineage_and_says_so(tmp_path):
    rng = np.random.default_rng(4)
    d = tmp_path / "s"
    st, _ = started(d, rng, 3)
    old = st.lineage
    st.close(clean=True, seq=3)
    (d / "MANIFEST").unlink()
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, sync="normal")
    assert "MANIFEST is missing but the dir holds kvservice state (state.db, 0 snapshot files)" in ei.value.message
    assert (d / "state.db").stat().st_size > 0 and meta(d)["incarnation"] == "1"       # nothing was deleted
    st = SqliteStore.open(d, sync="normal", repair=True)
    assert st.overridden == ["no MANIFEST: how much was acknowledged is unknown"]
    assert st.begin(3) == 2
    new = st.lineage
    assert new not in (0, old)
    assert st.notes == [f"new lineage {new:016x} (was {old:016x})"]
    assert meta(d) == {"format": "2", "incarnation": "2", "lineage": f"{new:016x}"}
    assert acked(d) == [(new, 2), (new, 3)]
    assert manifest(d)["lineage"] == f"{new:016x}"
    st.close(clean=True, seq=3)


def test_a_database_with_entries_but_no_manifest_or_acked_is_not_fresh(tmp_path):
    """Only a first start that stopped before writing anything (empty tables) may start empty again."""
    rng = np.random.default_rng(5)
    d = tmp_path / "s"
    st, _ = started(d, rng, 6)
    st.close(clean=False, seq=6)
    (d / "MANIFEST").unlink()
    (d / "ACKED").unlink()
    for readonly in (True, False):
        with pytest.raises(StateError) as ei:
            SqliteStore.open(d, sync="normal", readonly=readonly)
        assert ei.value.reason == "STATE_DAMAGED" and "MANIFEST is missing" in ei.value.message
    db = sqlite3.connect(d / "state.db")
    assert db.execute("SELECT COUNT(*) FROM entries").fetchone() == (6,)
    db.execute("DELETE FROM entries")                       # now: our tables, nothing in them
    db.commit()
    db.close()
    with pytest.raises(StateError):                          # read-only never starts a state
        SqliteStore.open(d, readonly=True)
    assert (d / "state.db").exists()
    st = SqliteStore.open(d, sync="normal")                  # an interrupted first start: fresh
    assert st.incarnation == 0 and list(st.entries_after(0)) == []
    st.close(clean=True, seq=0)


def test_read_only_opens_share_the_lock_and_see_a_running_manager(tmp_path):
    rng = np.random.default_rng(6)
    d = tmp_path / "s"
    st, es = started(d, rng, 4)
    st.close(clean=True, seq=4)
    lock = (d / "lock").read_bytes()
    a = SqliteStore.open(d, readonly=True)
    b = SqliteStore.open(d, readonly=True)                   # two checks at once: a shared lock
    assert not a.live and not b.live
    assert list(a.entries_after(0)) == es == list(b.entries_after(0))
    assert (d / "lock").read_bytes() == lock                 # a check does not write its pid
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, sync="normal")                   # no manager starts while a check holds it
    assert ei.value.reason == "STATE_BUSY"
    a.close(clean=True, seq=4)
    b.close(clean=True, seq=4)
    w = SqliteStore.open(d, sync="normal")
    w.begin(4)
    c = SqliteStore.open(d, readonly=True)                   # beside a running manager: an online copy
    assert c.live and any("a manager is running on this dir" in n for n in c.notes)
    assert list(c.entries_after(0)) == es
    c.close(clean=True, seq=4)
    w.close(clean=True, seq=4)
    nolock = tmp_path / "nolock"
    started(nolock, rng, 1)[0].close(clean=True, seq=1)
    (nolock / "lock").unlink()
    SqliteStore.open(nolock, readonly=True).close(clean=True, seq=1)
    assert not (nolock / "lock").exists()                     # read-only creates nothing


def write_manifest_by_hand(d, **changes) -> None:
    """MANIFEST rewritten with `changes`, its digest recomputed as documented (blake2b-128 of the sorted JSON)."""
    m = {k: v for k, v in manifest(d).items() if k != "digest"}
    m.update(changes)
    m["digest"] = hashlib.blake2b(json.dumps(m, sort_keys=True).encode(), digest_size=16).hexdigest()
    (d / "MANIFEST").write_text(json.dumps(m))


def set_meta(d, key: str, value: str) -> None:
    db = sqlite3.connect(d / "state.db")
    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
    db.commit()
    db.close()


def refused(d, **kw) -> StateError:
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, sync="normal", **kw).close(clean=True, seq=0)
    return ei.value


def stopped(tmp_path, name, rng, n=4):
    d = tmp_path / name
    st, _ = started(d, rng, n)
    lin = st.lineage
    st.close(clean=True, seq=n)
    return d, lin


def test_each_witness_disagreement_is_refused_with_its_figures(tmp_path):
    rng = np.random.default_rng(9)
    d, _ = stopped(tmp_path, "fmt", rng)
    write_manifest_by_hand(d, format=3)
    err = refused(d)
    assert (err.reason, err.message) == ("STATE_FORMAT", f"{d}: state format 3 is not 2; use the kvservice release "
                                                         "that wrote it")

    d, _ = stopped(tmp_path, "nodb", rng)
    write_manifest_by_hand(d, snapshot_seq=2)
    (d / "state.db").unlink()
    err = refused(d)
    assert err.reason == "STATE_DAMAGED"
    assert err.message == (f"{d}: state.db is missing or empty, but MANIFEST says this dir holds state (incarnation "
                           "1, at least 4 changes acknowledged, snapshot at 2): restore the state dir from a backup")

    d, _ = stopped(tmp_path, "onlyacked", rng)
    for name in ("state.db", "MANIFEST"):
        (d / name).unlink()
    (d / "ACKED").write_bytes(b"".join(
        struct.pack("<8sQQ", b"KVACKED1", 7, s) +
        hashlib.blake2b(struct.pack("<8sQQ", b"KVACKED1", 7, s), digest_size=16).digest() + bytes(472)
        for s in (12, 13)))
    err = refused(d)
    assert err.message.startswith(f"{d}: MANIFEST and state.db are missing, but ACKED says 13 changes were "
                                  "acknowledged here: this is not a fresh state dir.")

    d, _ = stopped(tmp_path, "old", rng)
    set_meta(d, "format", "1")
    err = refused(d)
    assert err.reason == "STATE_FORMAT"
    assert err.message == (f"{d / 'state.db'}: state format 1 is not 2: format 1 (pickled snapshots) was written "
                           "by an older kvservice and is not read by this one; finish with the old release (drain its "
                           "pools), then start this one on a fresh state dir")
    set_meta(d, "format", "7")
    err = refused(d)
    assert err.message == f"{d / 'state.db'}: state format 7 is not 2. restore the state dir from a backup"

    d, _ = stopped(tmp_path, "inc", rng)
    set_meta(d, "incarnation", "x1")
    err = refused(d)
    assert err.message.startswith(f"{d / 'state.db'}: incarnation 'x1' or lineage")
    set_meta(d, "incarnation", "3")
    err = refused(d)
    assert err.message.startswith(f"{d}: state.db is at incarnation 3 but MANIFEST at 1: the database was replaced")
    set_meta(d, "incarnation", "2")                           # one ahead: a start that stopped before its MANIFEST
    SqliteStore.open(d, sync="normal").close(clean=True, seq=0)

    d, lin = stopped(tmp_path, "lineage", rng)
    write_manifest_by_hand(d, lineage=f"{lin ^ 1:016x}")
    err = refused(d)
    assert err.message.startswith(f"{d}: state.db belongs to lineage {lin:016x} but MANIFEST to {lin ^ 1:016x}")
    st = SqliteStore.open(d, sync="normal", repair=True)
    assert st.overridden == [err.message]
    st.close(clean=True, seq=0)

    d, _ = stopped(tmp_path, "unclean", rng)
    write_manifest_by_hand(d, running=True)
    (d / "state.db-wal").unlink(missing_ok=True)
    err = refused(d)
    assert err.message.startswith(f"{d}: state.db-wal is missing after an unclean stop of incarnation 1: ")


def test_check_position_refuses_fewer_changes_than_the_manifest_acknowledged(tmp_path):
    rng = np.random.default_rng(10)
    d, _ = stopped(tmp_path, "s", rng, 6)
    st = SqliteStore.open(d, sync="normal")
    st.check_position(6)
    st.check_position(8)
    with pytest.raises(StateError) as ei:
        st.check_position(5)
    st.close(clean=True, seq=6)
    assert ei.value.reason == "STATE_ROLLBACK"
    assert ei.value.message.startswith(f"{d}: MANIFEST says at least 6 changes were acknowledged, but the state dir "
                                       "holds only 5: acknowledged changes were lost")


def test_a_database_header_that_lost_wal_mode_is_refused_before_sqlite_opens_it(tmp_path):
    rng = np.random.default_rng(11)
    d, _ = stopped(tmp_path, "s", rng)
    data = bytearray((d / "state.db").read_bytes())
    assert data[18:20] == b"\x02\x02"
    data[18:20] = b"\x01\x01"
    (d / "state.db").write_bytes(bytes(data))
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, readonly=True)                    # check-state of a stopped dir checks it too
    err = refused(d)
    assert ei.value.message == err.message
    assert err.reason == "STATE_DAMAGED"
    assert err.message == (f"{d}: state.db: header says journal mode 1/1, not WAL (2/2): the header is damaged, and "
                           "SQLite would ignore the write-ahead log and its commits: restore the state dir from a "
                           "backup")


def crashed_copy(tmp_path, rng, name, n=6):
    """A state dir as kill -9 leaves it: files copied while the store is open (its log not checkpointed)."""
    src = tmp_path / f"{name}-live"
    st, es = started(src, rng, n)
    d = tmp_path / name
    d.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.name not in ("lock", "state.db-shm"):
            (d / p.name).write_bytes(p.read_bytes())
    st.close(clean=True, seq=n)
    return d, es


def test_the_log_is_checked_before_sqlite_reads_it(tmp_path):
    rng = np.random.default_rng(12)
    d, es = crashed_copy(tmp_path, rng, "intact")
    st = SqliteStore.open(d, sync="normal")
    assert list(st.entries_after(0)) == es and st.torn_frames == 0
    st.close(clean=True, seq=6)

    d, es = crashed_copy(tmp_path, rng, "torn")
    wal = d / "state.db-wal"
    page = struct.unpack(">I", wal.read_bytes()[8:12])[0]
    data = bytearray(wal.read_bytes())
    frames = (len(data) - 32) // (24 + page)
    assert frames >= 6
    last = 32 + (frames - 1) * (24 + page)
    data[last + 24:last + 24 + 64] = rng.bytes(64)            # the last commit's only frame, garbled: torn
    wal.write_bytes(bytes(data))
    st = SqliteStore.open(d, sync="normal")
    assert st.torn_frames == 1
    assert list(st.entries_after(0)) == es[:-1]
    st.check_position(5)
    assert st.notes == ["state.db-wal: the last 1 frames are an incomplete commit (a write cut short by a crash, or a "
                        "log cut in the middle of a frame); dropped. The recovered position 5 reaches the acknowledged "
                        "high-water mark (0), so it was never acknowledged, unless the machine itself crashed (with "
                        "--sync normal that can lose acknowledged commits)"]
    assert not st.mark.sync
    st.close(clean=True, seq=5)

    d, _ = crashed_copy(tmp_path, rng, "damaged")
    wal = d / "state.db-wal"
    data = bytearray(wal.read_bytes())
    mid = 32 + 2 * (24 + page)
    data[mid + 24:mid + 24 + 64] = rng.bytes(64)               # frame 2 garbled, the frames after it intact
    wal.write_bytes(bytes(data))
    err = refused(d)
    assert err.reason == "STATE_DAMAGED"
    assert err.message.startswith(f"{d}: state.db-wal: frame 2 of {frames} fails its checksum but frame 3 after it "
                                  "is intact")
    assert err.message.endswith("restore the state dir from a backup; or, to accept losing those commits, move "
                                "state.db-wal away and run `kvservice check-state DIR --repair` to accept the state "
                                "dir as it is")
    assert wal.read_bytes() == bytes(data)                      # a refused start leaves the log as it found it


def test_a_read_only_open_of_a_dir_without_state_is_refused_and_creates_nothing(tmp_path):
    d = tmp_path / "none"
    d.mkdir()
    with pytest.raises(StateError) as ei:
        SqliteStore.open(d, readonly=True)
    assert (ei.value.reason, ei.value.message) == (
        "STATE_MISSING", f"{d}: no kvservice state here (state.db and MANIFEST are missing)")
    assert list(d.iterdir()) == []


def test_a_format_1_database_without_manifest_is_named_not_taken_for_a_first_start(tmp_path):
    rng = np.random.default_rng(13)
    d, _ = stopped(tmp_path, "s", rng)
    for name in ("MANIFEST", "ACKED"):
        (d / name).unlink()
    set_meta(d, "format", "1")
    err = refused(d)
    assert (err.reason, err.message) == (
        "STATE_FORMAT", f"{d / 'state.db'}: state format 1 (pickled snapshots) was written by an older kvservice and "
        "is not read by this one: finish with the old release (drain its pools), then start this one on a fresh "
        "state dir")
    assert meta(d)["format"] == "1"


def test_a_database_without_its_tables_is_refused(tmp_path):
    rng = np.random.default_rng(14)
    d, _ = stopped(tmp_path, "s", rng)
    db = sqlite3.connect(d / "state.db")
    db.execute("DROP TABLE snapshots")
    db.commit()
    db.close()
    err = refused(d)
    assert (err.reason, err.message) == (
        "STATE_DAMAGED", f"{d / 'state.db'}: its tables cannot be read (no such table: snapshots); written by another "
        "kvservice, or damaged. restore the state dir from a backup")
