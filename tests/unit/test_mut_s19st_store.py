"""SqliteStore's refusals carry the reason docs/DURABILITY.md's remedies hang on: a state dir whose acknowledged
changes are lost or cannot be rebuilt is STATE_DAMAGED (not the generic STATE_ERROR), with the remedy in its
message (restore from a backup; where accepting the loss is possible, check-state --repair)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.sqlite.store import SqliteStore

from .test_mut_m28e_store import Enc, refused, started, stopped, write_manifest_by_hand

RESTORE = "restore the state dir from a backup"
REPAIR = "run `kvservice check-state DIR --repair` to accept the state dir as it is"


def test_a_wal_missing_after_an_unclean_stop_is_state_damaged(tmp_path):
    rng = np.random.default_rng(19_139)
    d, _ = stopped(tmp_path, "unclean", rng, int(rng.integers(2, 9)))
    write_manifest_by_hand(d, running=True)
    (d / "state.db-wal").unlink(missing_ok=True)
    err = refused(d)
    assert err.reason == "STATE_DAMAGED"
    assert err.message == (f"{d}: state.db-wal is missing after an unclean stop of incarnation 1: the changes "
                           f"acknowledged since its last checkpoint are lost. {RESTORE}, or {REPAIR}")


@pytest.mark.parametrize("readonly", [False, True])
def test_a_recorded_snapshot_whose_file_is_gone_is_state_damaged(tmp_path, readonly):
    rng = np.random.default_rng(19_45 + readonly)
    d = tmp_path / "s"
    n = int(rng.integers(5, 12))
    st, _ = started(d, rng, n)
    at = int(rng.integers(2, n))
    st.write_snapshot(at, Enc(rng))
    st.close(clean=True, seq=n)
    f = d / "snapshots" / f"snapshot-{at:012d}.kvs"
    f.unlink()
    st = SqliteStore.open(d, readonly=True) if readonly else SqliteStore.open(d, sync="normal")
    try:
        assert st.snapshot_seq == at
        with pytest.raises(StateError) as ei:
            st.load_snapshot()
    finally:
        st.close(clean=True, seq=n)
    assert ei.value.reason == "STATE_DAMAGED"
    assert not st.live                                      # no manager runs on the dir: no "run the check again"
    assert ei.value.message == (f"{f}: the snapshot at {at} is missing; the entries it covers were dropped, "
                                f"so the state cannot be rebuilt without it. {RESTORE}")
