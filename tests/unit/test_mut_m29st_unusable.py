"""unusable_state's whole message for each cause (kvservice/state/sqlite/unusable.py).

docs/operations.md: a volume the manager cannot write at start says so on one line: STATE_NOT_WRITABLE (give the
user write access or mount read-write), STATE_DISK_FULL (free space or grow the volume), STATE_IO_ERROR (check the
device); the message names the dir, the failing file (an OSError's filename) or SQLite's own words, and the remedy.
"""

from __future__ import annotations

import errno
import sqlite3

import numpy as np
import pytest

from kvservice.state.sqlite.unusable import NO_SPACE, NOT_WRITABLE, unusable_state

FULL = ("the volume of state dir {d} is full ({what}); free space or grow the volume, then start again (what was "
        "acknowledged before is still on it)")
IO = "state dir {d}: the volume reported an I/O error ({what}); check the device (dmesg), then run kvservice " \
     "check-state DIR"
CANT_OPEN = "state dir {d}: SQLite cannot open its database ({what}); check that the dir exists and that the " \
            "manager's user may write it"
READ_ONLY = ("state dir {d} cannot be written ({what}); the manager writes its journal, snapshots and lock there: "
             "give its user write access to the dir and every file in it, or mount the volume read-write (kvservice "
             "check-state DIR reads it without writing)")


def _sqlite(message: str, name: str = "") -> sqlite3.Error:
    e = sqlite3.OperationalError(message)
    if name:
        e.sqlite_errorname = name
    return e


@pytest.mark.parametrize("with_file", [False, True])
def test_each_os_error_names_the_dir_the_file_and_the_remedy(with_file):
    rng = np.random.default_rng(2944 + with_file)
    d = f"/srv/kv-{int(rng.integers(1 << 30)):x}"
    for code, reason, text in [(errno.EROFS, "STATE_NOT_WRITABLE", READ_ONLY), (errno.EACCES, "STATE_NOT_WRITABLE",
                               READ_ONLY), (errno.EPERM, "STATE_NOT_WRITABLE", READ_ONLY),
                               (errno.ENOSPC, "STATE_DISK_FULL", FULL), (errno.EDQUOT, "STATE_DISK_FULL", FULL),
                               (errno.EIO, "STATE_IO_ERROR", IO)]:
        words = f"os words {int(rng.integers(1 << 20))}"
        f = f"{d}/state.db-wal" if with_file else None
        err = OSError(code, words, f) if with_file else OSError(code, words)
        e = unusable_state(err, d)
        assert e.reason == reason
        assert e.message == text.format(d=d, what=f"{words}: {f}" if with_file else words)
    assert NOT_WRITABLE == {errno.EACCES, errno.EPERM, errno.EROFS} and NO_SPACE == {errno.ENOSPC, errno.EDQUOT}


def test_an_os_error_without_its_words_is_named_as_python_prints_it():
    err = OSError(errno.ENOSPC, "")
    assert unusable_state(err, "/d").message == FULL.format(d="/d", what=str(err))


@pytest.mark.parametrize(("err", "reason", "text"), [
    (_sqlite("attempt to write a readonly database"), "STATE_NOT_WRITABLE", READ_ONLY),
    (_sqlite("w", "SQLITE_PERM"), "STATE_NOT_WRITABLE", READ_ONLY),
    (_sqlite("database or disk is full"), "STATE_DISK_FULL", FULL),
    (_sqlite("w", "SQLITE_FULL"), "STATE_DISK_FULL", FULL),
    (_sqlite("disk I/O error"), "STATE_IO_ERROR", IO),
    (_sqlite("w", "SQLITE_IOERR_WRITE"), "STATE_IO_ERROR", IO),
    (_sqlite("unable to open database file"), "STATE_NOT_WRITABLE", CANT_OPEN),
    (_sqlite("w", "SQLITE_CANTOPEN_ISDIR"), "STATE_NOT_WRITABLE", CANT_OPEN),
])
def test_each_sqlite_error_is_quoted_in_sqlites_words(err, reason, text):
    e = unusable_state(err, "/var/lib/kv")
    assert e.reason == reason
    assert e.message == text.format(d="/var/lib/kv", what=f"SQLite: {err}")


@pytest.mark.parametrize("err", [OSError(errno.ENOENT, "No such file"), OSError(errno.EEXIST, "exists"), OSError(),
                                 _sqlite("w", "SQLITE_BUSY"), _sqlite("database is locked"), KeyError("x")])
def test_other_errors_are_not_named(err):
    assert unusable_state(err, "/d") is None
