"""A state dir that holds only snapshot files (no MANIFEST, no state.db) is not a fresh dir: opening it refuses,
counting the snapshot files, and deletes nothing (kvservice/state/sqlite/store.py module doc: the dir holds
MANIFEST, state.db and snapshots/snapshot-<seq>.kvs; without MANIFEST how much was acknowledged is unknown)."""

import pytest

from kvservice.contract.errors import StateError
from kvservice.state.sqlite.store import SqliteStore

REPAIR = "run `kvservice check-state DIR --repair` to accept the state dir as it is"
RESTORE = "restore the state dir from a backup"


@pytest.mark.parametrize("count", [1, 3])
def test_snapshot_files_without_manifest_or_database_are_refused_not_started_over(tmp_path, count):
    """StateError STATE_DAMAGED naming the dir, "no state.db" and the number of snapshot files; the files stay."""
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    for i in range(count):
        (snaps / f"snapshot-{1000 + 17 * i:020d}.kvs").write_bytes(b"KVSNAP\r\n" + bytes([i]) * 100)
    before = {p.name: p.read_bytes() for p in snaps.iterdir()}
    with pytest.raises(StateError) as err:
        SqliteStore.open(tmp_path)
    assert err.value.reason == "STATE_DAMAGED"
    assert err.value.message == (f"{tmp_path}: MANIFEST is missing but the dir holds kvservice state (no state.db, "
                                 f"{count} snapshot files): how much it acknowledged is unknown. {REPAIR}, or "
                                 f"{RESTORE}")
    assert not (tmp_path / "state.db").exists()
    assert {p.name: p.read_bytes() for p in snaps.iterdir()} == before
