"""A damaged or incomplete state dir is refused with a message that names the problem, never served silently.

Issue 11, report 5: one flipped bit in a snapshot gave a silently different state (sometimes with broken
invariants), some flips crashed startup with a traceback, a damaged or missing WAL rolled back to the last
snapshot and lost acknowledged entries, an empty state.db looked like a fresh start. Here every such case
either recovers exactly the acknowledged state or refuses to start (StateError), and `kvservice check-state`
says the same.
"""

import contextlib
import io
import shutil
import sqlite3
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.server.cli import check_state
from kvservice.state.ackmark import AckMark
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.sqlite.wal import check_wal, db_header
from kvservice.state.tree import state_tree

from .test_journal import prefix_workload, run, setup_pools, step_req, workload

CONFIG = JournalConfig(sync="normal", compact_every=40, background_snapshots=False)
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def crash_copy(src, dest):
    """The files of a running manager's state dir as kill -9 leaves them (the log included)."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*-shm", "lock"))
    return dest


def make_state(tmp_path, crashed: bool, name="orig"):
    """A state dir with pools, sequences, prefix-cache pages, a snapshot and a journal tail after it.

    Returns (dir, acknowledged state_tree, position, state before the last step).
    """
    d = tmp_path / name
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    workload(j, np.random.default_rng(1), 60)
    prefix_workload(j, np.random.default_rng(2), 30)
    before_last = state_tree(j.manager)
    run(j, "Step", step_req("a", admit=[77_777], n=[3], rid="last"))
    assert 0 < j.snapshot_seq < j.seq
    acknowledged, seq = state_tree(j.manager), j.seq
    if crashed:
        out = crash_copy(d, tmp_path / f"{name}-crashed")
        j.close(snapshot=False)
        return out, acknowledged, seq, before_last
    j.close(snapshot=False)                        # stopped cleanly, without a final snapshot: a tail remains
    return d, acknowledged, seq, before_last


def checked(d):
    """(exit code, output) of `kvservice check-state d`, in process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = check_state(str(d))
    return code, out.getvalue() + err.getvalue()


def outcome(d, acknowledged, seq):
    """'ok' if the dir recovers exactly `acknowledged` (check-state agreeing), else the refusal's message."""
    code, report = checked(d)
    try:
        j = Journal.open(d, config=CONFIG)
    except StateError as err:
        assert code == 2 and "NOT USABLE" in report, report
        assert err.message in report
        return err.message
    try:
        assert code == 0 and "state ok" in report, report
        assert j.seq == seq and state_tree(j.manager) == acknowledged, "served a different state"
    finally:
        j.close(snapshot=False)
    return "ok"


def flip(path, bit):
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("crashed", [False, True], ids=["stopped", "crashed"])
def test_a_flipped_bit_anywhere_is_recovered_exactly_or_refused_by_name(tmp_path, crashed):
    src, acknowledged, seq, _ = make_state(tmp_path, crashed)
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and p.name != "lock")
    names = {str(f) for f in files}
    assert {"state.db", "MANIFEST"} <= names and any(n.startswith("snapshots/") for n in names)
    assert ("state.db-wal" in names) == crashed
    rng = np.random.default_rng(7 + crashed)
    results = {}
    for trial in range(90):
        d = shutil.copytree(src, tmp_path / f"t{trial}")
        f = files[trial % len(files)]
        bit = int(rng.integers(8 * (d / f).stat().st_size))
        flip(d / f, bit)
        got = outcome(d, acknowledged, seq)
        results.setdefault(str(f), []).append(got)
        shutil.rmtree(d)
    for f, outs in results.items():
        refused = [o for o in outs if o != "ok"]
        assert all(str(src.name) not in o for o in refused)   # messages name the damaged dir, not where it came from
        if f == "ACKED":       # two records: a damaged one leaves the other, one position older: recovery reaches it
            assert not refused, outs
        elif f != "state.db":                                  # most of a database file is unused space
            assert len(refused) >= len(outs) // 2, (f, outs)


def test_the_wal_missing_after_a_crash_is_refused(tmp_path):
    d, acknowledged, seq, _ = make_state(tmp_path, crashed=True)
    (d / "state.db-wal").unlink()
    msg = outcome(d, acknowledged, seq)
    assert "state.db-wal is missing after an unclean stop" in msg and "--repair" in msg


def test_a_torn_last_commit_is_dropped_but_damage_before_it_is_refused(tmp_path):
    d, acknowledged, seq, before_last = make_state(tmp_path, crashed=True)
    wal = d / "state.db-wal"
    page = db_header(d / "state.db")[0]
    frame = 24 + page
    data = bytearray(wal.read_bytes())
    frames = (len(data) - 32) // frame
    torn = shutil.copytree(d, tmp_path / "torn")
    tail = bytearray(data)
    tail[-700:] = np.random.default_rng(3).integers(0, 256, 700, dtype=np.uint8).tobytes()   # a torn sector
    (torn / "state.db-wal").write_bytes(bytes(tail))
    rep = check_wal(torn / "state.db-wal", page)
    assert rep.problem is None and rep.torn >= 1 and rep.committed < frames
    # The last step was acknowledged: ACKED says so, and the torn log cannot pass for a crash mid-commit.
    with pytest.raises(StateError, match=f"ACKED.* says position {seq} was acknowledged.*holds only {seq - 1}") as exc:
        Journal.open(torn, config=CONFIG)
    assert exc.value.reason == "STATE_ROLLBACK" and "never acknowledged" not in exc.value.message
    # A crash between that commit and its mark (it was never acknowledged): the mark one position back.
    lineage = AckMark(torn / "ACKED", writable=False).found.lineage
    back = AckMark(torn / "ACKED")
    back.reset(lineage, seq - 1)
    back.close()
    j = Journal.open(torn, config=CONFIG)                     # the unacknowledged last commit is gone
    assert j.seq == seq - 1 and state_tree(j.manager) == before_last
    assert any("cut short by a crash" in n and f"high-water mark ({seq - 1})" in n and "never acknowledged" in n
               for n in j.store.notes), j.store.notes
    j.close()
    early = shutil.copytree(d, tmp_path / "early")            # the same garbage one frame earlier: damage
    mid = bytearray(data)
    start = 32 + (frames - 2) * frame + 24
    mid[start:start + 700] = np.random.default_rng(4).integers(0, 256, 700, dtype=np.uint8).tobytes()
    (early / "state.db-wal").write_bytes(bytes(mid))
    assert "is intact" in outcome(early, acknowledged, seq)


def test_wal_frames_of_an_earlier_generation_are_not_damage(tmp_path):
    db_path = tmp_path / "g.db"
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE t(x INTEGER PRIMARY KEY, b BLOB)")
    for i in range(30):
        db.execute("INSERT INTO t VALUES (?, randomblob(300))", (i,))
    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
    for i in range(30, 33):                                   # the log restarts: old frames stay behind
        db.execute("INSERT INTO t VALUES (?, randomblob(300))", (i,))
    image = crash_copy(tmp_path, tmp_path.parent / "gen-image")
    db.close()
    wal, page = image / "g.db-wal", db_header(image / "g.db")[0]
    rep = check_wal(wal, page)
    assert rep.problem is None and rep.valid < rep.frames and rep.torn == 0
    flip(wal, 8 * (32 + (rep.frames - 1) * (24 + page) + 100))          # damage in a leftover frame: harmless
    assert check_wal(wal, page).problem is None
    assert sqlite3.connect(image / "g.db").execute("SELECT COUNT(*) FROM t").fetchone()[0] == 33


def test_an_empty_or_missing_state_db_is_not_a_fresh_start(tmp_path):
    d, acknowledged, seq, _ = make_state(tmp_path, crashed=False)
    empty = shutil.copytree(d, tmp_path / "empty")
    (empty / "state.db").write_bytes(b"")
    assert "state.db is missing or empty, but MANIFEST says" in outcome(empty, acknowledged, seq)
    gone = shutil.copytree(d, tmp_path / "gone")
    (gone / "state.db").unlink()
    assert "missing or empty" in outcome(gone, acknowledged, seq)
    nosnap = shutil.copytree(d, tmp_path / "nosnap")
    for p in (nosnap / "snapshots").iterdir():
        p.unlink()
    assert "snapshot at" in outcome(nosnap, acknowledged, seq) and "is missing" in outcome(nosnap, acknowledged, seq)
    fresh_db = shutil.copytree(d, tmp_path / "fresh-db")     # a new, empty database beside the old snapshot
    (fresh_db / "state.db").unlink()
    sqlite3.connect(fresh_db / "state.db").close()
    assert "NOT USABLE" in checked(fresh_db)[1]
    with pytest.raises(StateError):
        Journal.open(fresh_db, config=CONFIG)


def test_a_genuinely_fresh_dir_starts_empty(tmp_path):
    for d in (tmp_path / "new", tmp_path / "only-lock"):
        if d.name == "only-lock":
            d.mkdir()
            (d / "lock").write_text("123\n")
        j = Journal.open(d, config=CONFIG)
        assert j.seq == 0 and j.manager.pool_names() == [] and j.incarnation == 1
        j.close()
    half = tmp_path / "half"                                  # a first start that stopped before its MANIFEST
    j = Journal.open(half, config=CONFIG)
    j.close(snapshot=False)
    (half / "MANIFEST").unlink()
    j = Journal.open(half, config=CONFIG)
    assert j.seq == 0
    j.close()


def test_state_without_its_manifest_is_refused_until_repaired(tmp_path):
    d, acknowledged, seq, _ = make_state(tmp_path, crashed=False)
    (d / "MANIFEST").unlink()
    assert "MANIFEST is missing but the dir holds kvservice state" in outcome(d, acknowledged, seq)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert check_state(str(d), repair=True) == 0
    assert "repaired" in out.getvalue()
    assert outcome(d, acknowledged, seq) == "ok"


def test_a_damaged_manifest_is_refused_until_repaired(tmp_path):
    d, acknowledged, seq, _ = make_state(tmp_path, crashed=True)
    text = (d / "MANIFEST").read_text().replace('"last_seq": ', '"last_seq": 1')
    (d / "MANIFEST").write_text(text)
    assert "MANIFEST: damaged" in outcome(d, acknowledged, seq)
    with contextlib.redirect_stdout(io.StringIO()):
        assert check_state(str(d), repair=True) == 0
    assert outcome(d, acknowledged, seq) == "ok"


def test_a_rolled_back_database_is_refused(tmp_path):
    """An older copy of state.db put back (e.g. from a stale backup) behind a newer MANIFEST."""
    d = tmp_path / "d"
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    j.close(snapshot=False)
    old = (d / "state.db").read_bytes()
    j = Journal.open(d, config=CONFIG)
    workload(j, np.random.default_rng(5), 10)
    acknowledged, seq = state_tree(j.manager), j.seq
    j.close(snapshot=False)
    (d / "state.db").write_bytes(old)
    assert "the database was replaced" in outcome(d, acknowledged, seq)


def test_a_format_1_state_dir_is_refused_with_what_to_do(tmp_path):
    d = tmp_path / "v1"
    d.mkdir()
    db = sqlite3.connect(d / "state.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript("""CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                        CREATE TABLE entries(seq INTEGER PRIMARY KEY, method TEXT, request BLOB, created REAL);
                        CREATE TABLE snapshots(seq INTEGER PRIMARY KEY, state BLOB, created REAL);
                        INSERT INTO meta VALUES ('format', '1');
                        INSERT INTO entries VALUES (1, 'CreatePool', x'0a0161', 1.0);""")
    db.close()
    with pytest.raises(StateError, match=r"format 1 .pickled snapshots.") as exc:
        Journal.open(d, config=CONFIG)
    assert exc.value.reason == "STATE_FORMAT" and "fresh state dir" in exc.value.message


def test_check_state_names_the_problem_without_a_traceback(tmp_path):
    d, *_ = make_state(tmp_path, crashed=True)
    (snapshot,) = (d / "snapshots").iterdir()
    data = bytearray(snapshot.read_bytes())
    data[40] ^= 0x10                                         # inside the JSON header
    snapshot.write_bytes(bytes(data))
    out = subprocess.run([sys.executable, "-m", "kvservice.server.cli", "check-state", str(d)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert "fails its checksum" in out.stderr and snapshot.name in out.stderr
    serve = subprocess.run([sys.executable, "-m", "kvservice.server.cli", "serve", "--state-dir", str(d), "--no-pools",
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr and "fails its checksum" in serve.stderr


def test_wal_checksum_helpers_agree_with_sqlite(tmp_path):
    """check_wal's vectorised checksum accepts every frame SQLite wrote (header layout as documented)."""
    d, *_ = make_state(tmp_path, crashed=True)
    wal = d / "state.db-wal"
    page = db_header(d / "state.db")[0]
    rep = check_wal(wal, page)
    magic, version, wal_page = struct.unpack(">3I", wal.read_bytes()[:12])
    assert magic in (0x377F0682, 0x377F0683) and version == 3007000
    assert wal_page == page and rep.problem is None and rep.valid == rep.frames == rep.committed > 10


@pytest.mark.parametrize("word", [0, 1])
def test_one_flipped_bit_of_the_last_frames_stored_checksum_is_named(tmp_path, word):
    """SQLite's WAL frame header ends with two big-endian 32-bit checksum words (bytes 16-23 of the 24): a bit
    flipped in byte i, bit j of word c is bit (3 - i) * 8 + j of that word, named as such."""
    wal, page = _small_wal(tmp_path, f"wal-bit-{word}")
    rep = check_wal(wal, page)
    assert rep.problem is None and rep.valid == rep.frames
    rng = np.random.default_rng(word)
    for _ in range(3):
        i, j = int(rng.integers(0, 4)), int(rng.integers(0, 8))
        at = 32 + (rep.frames - 1) * (24 + page) + 16 + 4 * word + i
        flip(wal, 8 * at + j)
        assert f"one flipped bit (in its stored checksum, bit {(3 - i) * 8 + j} of word {word})" in \
            check_wal(wal, page).problem
        flip(wal, 8 * at + j)                                  # flipped back: intact again
        assert check_wal(wal, page).problem is None


def test_check_state_beside_a_running_manager_says_what_it_could_not_check(tmp_path):
    """A manager holds the dir: check-state reads an online copy and says its write-ahead log went unchecked."""
    d = tmp_path / "live"
    j = Journal.open(d, config=CONFIG)
    try:
        setup_pools(j)
        workload(j, np.random.default_rng(5), 10)
        code, report = checked(d)
    finally:
        j.close(snapshot=False)
    assert code == 0 and "state ok" in report, report
    assert "a manager is running on this dir: checked through an online copy; its write-ahead log was not " \
           "checked" in report
    code, report = checked(d)                                  # stopped: the log is checked, no such note
    assert code == 0 and "a manager is running" not in report


def _small_wal(tmp_path, name):
    db = sqlite3.connect(tmp_path / "g.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE t(x INTEGER PRIMARY KEY, b BLOB)")
    for i in range(12):
        db.execute("INSERT INTO t VALUES (?, randomblob(300))", (i,))
    image = crash_copy(tmp_path, tmp_path.parent / name)
    db.close()
    return image / "g.db-wal", db_header(image / "g.db")[0]


@pytest.mark.parametrize("salt", [0, 1])
def test_a_flipped_salt_bit_in_a_middle_frame_is_damage_not_a_leftover(tmp_path, salt):
    """Frame header bytes 8-15 are the two salts, which the frame checksum does not cover (SQLite's WAL format):
    one flipped salt bit makes a frame look foreign while the log goes on after it."""
    wal, page = _small_wal(tmp_path, f"salt-{salt}")
    frames = check_wal(wal, page).frames
    k = frames // 2
    flip(wal, 8 * (32 + k * (24 + page) + 8 + 4 * salt) + 5)
    rep = check_wal(wal, page)
    assert rep.problem is not None and f"frame {k} of {frames} has a damaged salt" in rep.problem
    assert rep.valid == k


def test_a_damaged_wal_header_is_a_problem_not_a_torn_tail(tmp_path):
    wal, page = _small_wal(tmp_path, "head")
    frames = check_wal(wal, page).frames
    flip(wal, 8 * 1 + 2)                                                    # the magic number's second byte
    rep = check_wal(wal, page)
    assert rep.problem is not None and "header damaged" in rep.problem and f"ignore its {frames} frames" in rep.problem
    assert (rep.valid, rep.committed, rep.torn) == (0, 0, 0)
