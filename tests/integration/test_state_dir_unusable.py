"""`kvservice serve --state-dir` on a dir, database or volume it cannot write: one line that says why and what to
do, exit status 2, no traceback, and the dir left as it was.

Read-only is real: the manager runs as a process that file permissions bind (as root, without the capabilities
that let root ignore them: setpriv). A full disk cannot be made here without root's mount; it is an ENOSPC from
the fsync that makes the state durable (where a full volume shows on Linux), patched into a manager process of
its own, and a real SQLITE_FULL for the classification.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.state.journal import Journal
from kvservice.state.sqlite.unusable import unusable_state

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
               "--inh-caps=-dac_override,-dac_read_search"]


def _bound_by_permissions() -> list[str]:
    """The command prefix under which file permissions bind this process ([] when they already do); skips
    where that cannot be had (root without setpriv)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions cannot be made to bind")
    return NO_OVERRIDE


def _serve(state_dir: Path) -> subprocess.CompletedProcess:
    cmd = [*_bound_by_permissions(), sys.executable, "-m", "kvservice.server.cli", "serve", "--state-dir",
           str(state_dir), "--listen", "127.0.0.1:0", "--metrics-port", "-1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def _existing_state(state_dir: Path) -> None:
    journal = Journal.open(state_dir)
    journal.close(snapshot=True)


def _tree(state_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(state_dir)): p.read_bytes() for p in sorted(state_dir.rglob("*")) if p.is_file()}


def _assert_refused(r: subprocess.CompletedProcess, reason: str, words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvservice: ")]
    assert len(lines) == 1 and f"NOT USABLE ({reason})" in lines[0] and words in lines[0], r.stderr


def test_a_read_only_fresh_dir_is_refused_in_one_line(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o555)
    try:
        r = _serve(d)
    finally:
        d.chmod(0o755)
    _assert_refused(r, "STATE_NOT_WRITABLE", "give its user write access")
    assert list(d.iterdir()) == []


def test_a_read_only_dir_with_state_is_refused_and_left_as_it_was(tmp_path):
    d = tmp_path / "state"
    _existing_state(d)
    before = _tree(d)
    for p in [d, *d.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        r = _serve(d)
    finally:
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    _assert_refused(r, "STATE_NOT_WRITABLE", str(d))
    assert _tree(d) == before


def test_a_read_only_database_in_a_writable_dir_is_refused(tmp_path):
    d = tmp_path / "state"
    _existing_state(d)
    (d / "state.db").chmod(0o444)
    try:
        r = _serve(d)
    finally:
        (d / "state.db").chmod(0o644)
    _assert_refused(r, "STATE_NOT_WRITABLE", "SQLite: attempt to write a readonly database")
    assert Journal.open(d, readonly=True).seq == 0         # still a sound state dir


#: A manager whose fsync reports a full volume (where a full disk shows on Linux): run as `python -c` so that its
#: stderr and exit status are the process's own. If it ever got as far as serving, it exits 99 instead.
FULL_VOLUME = """
import errno, os, sys
from kvservice.server import cli
fsyncs = []
def full(fd):
    fsyncs.append(fd)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
def never_serves(running, *args):
    running.stop(grace=0)
    sys.exit(99)
os.fsync = full
cli._serve_until_stopped = never_serves
rc = cli.main(sys.argv[1:])
print(f"fsyncs={len(fsyncs)}")
sys.exit(rc)
"""


def test_a_full_volume_at_start_is_refused_in_one_line(tmp_path):
    d = tmp_path / "state"
    _existing_state(d)
    before = _tree(d)
    r = subprocess.run([sys.executable, "-c", FULL_VOLUME, "serve", "--state-dir", str(d), "--listen", "127.0.0.1:0",
                        "--metrics-port", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    _assert_refused(r, "STATE_DISK_FULL", "free space or grow the volume")
    assert r.stdout.strip() != "fsyncs=0", r.stdout
    after = _tree(d)             # what was there is unchanged (a half-written MANIFEST.tmp may be left beside it)
    assert {k: after.get(k) for k in before if k != "lock"} == {k: v for k, v in before.items() if k != "lock"}
    journal = Journal.open(d)    # and once there is space, the manager starts from it
    assert journal.seq == 0
    journal.close(snapshot=False)


def test_sqlites_own_write_failures_are_named(tmp_path):
    db = sqlite3.connect(tmp_path / "x.db")
    db.execute("PRAGMA page_size = 512")
    db.execute("CREATE TABLE t (x)")
    db.execute("PRAGMA max_page_count = 3")                 # the database's volume is "full" at 3 pages
    with pytest.raises(sqlite3.Error) as full:
        db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    db.close()
    ro = sqlite3.connect(f"file:{tmp_path / 'x.db'}?mode=ro", uri=True)
    with pytest.raises(sqlite3.Error) as readonly:
        ro.execute("INSERT INTO t VALUES (1)")
    ro.close()
    assert unusable_state(full.value, "D").reason == "STATE_DISK_FULL"
    assert unusable_state(readonly.value, "D").reason == "STATE_NOT_WRITABLE"
    assert unusable_state(OSError(errno.EROFS, "Read-only file system"), "D").reason == "STATE_NOT_WRITABLE"
    assert unusable_state(OSError(errno.EIO, "I/O error"), "D").reason == "STATE_IO_ERROR"
    assert unusable_state(OSError(errno.EADDRINUSE, "in use"), "D") is None
    assert unusable_state(ValueError("x"), "D") is None
