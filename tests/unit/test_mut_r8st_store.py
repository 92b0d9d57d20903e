"""SqliteStore.write_snapshot when its transaction fails part-way: the database error itself reaches the caller,
the transaction is rolled back (nothing of it recorded, the connection left outside a transaction) and the store
keeps working. Oracles: SQLite's transaction semantics (a ROLLBACK undoes every statement since BEGIN; Python's
sqlite3 refuses to bind a parameter of an unsupported type with a sqlite3.Error and reports
Connection.in_transaction), and the state dir's tables read back by hand with sqlite3."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from kvservice.state.sqlite.store import SqliteStore

from .test_mut_m28e_store import Enc, started


def test_a_snapshot_whose_record_fails_is_rolled_back_and_the_store_goes_on(tmp_path):
    rng = np.random.default_rng(8123)
    d = tmp_path / "s"
    n = int(rng.integers(6, 12))
    st, es = started(d, rng, n)
    bad = Enc(rng)
    bad.header_digest = object()                 # SQLite cannot bind it: the INSERT fails inside the transaction
    with pytest.raises(sqlite3.Error) as err:
        st.write_snapshot(int(rng.integers(2, n)), bad)
    assert not isinstance(err.value, TypeError)
    assert st.db.in_transaction is False and st.snapshot_seq == 0
    at = int(rng.integers(2, n))
    good = Enc(rng)
    st.write_snapshot(at, good)                  # a BEGIN now: it would fail inside a transaction left open
    assert st.snapshot_seq == at
    st.close(clean=True, seq=n)
    db = sqlite3.connect(d / "state.db")
    try:
        rows = db.execute("SELECT seq, file, header_digest, nbytes FROM snapshots").fetchall()
        left = [r[0] for r in db.execute("SELECT seq FROM entries ORDER BY seq")]
    finally:
        db.close()
    assert rows == [(at, f"snapshot-{at:012d}.kvs", good.header_digest, good.nbytes)]
    assert left == [e.seq for e in es if e.seq > at]
    again = SqliteStore.open(d, sync="normal")
    try:
        assert again.load_snapshot() == (at, b"".join(good.chunks))
    finally:
        again.close(clean=True, seq=n)
