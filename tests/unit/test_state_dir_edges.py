"""State-dir edges the integrity tests do not reach: a dir holding only its ACKED mark, the MANIFEST's `running`
flag while a manager serves, a database SQLite cannot read, one flipped bit inside a WAL frame's page, a
snapshot written before lineages, and a configured pool's prefix hash settings.

Oracles: docs/DURABILITY.md (the MANIFEST fields and what each check refuses), SQLite's documented file formats
(the b-tree page header at byte 100 of page 1; the WAL frame layout and its checksum word order from the
magic), the snapshot layout in kvservice/state/snapshot.py's docstring (rebuilt here with struct and hashlib).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.state import snapshot as snap
from kvservice.state.ackmark import AckMark
from kvservice.state.journal import Journal
from kvservice.state.journal_config import METHODS
from kvservice.state.sqlite.wal import check_wal
from kvservice.state.startup import create_request

from .test_journal import run, setup_pools, step_req
from .test_state_integrity import CONFIG, _small_wal, crash_copy, flip, make_state


def test_a_dir_with_only_its_acked_mark_is_not_a_fresh_start(tmp_path):
    d, _, seq, _ = make_state(tmp_path, crashed=False)
    assert AckMark(d / "ACKED", writable=False).found.seq == seq
    for name in ("MANIFEST", "state.db"):
        (d / name).unlink()
    shutil.rmtree(d / "snapshots")
    left = sorted(p.name for p in d.iterdir())
    assert "ACKED" in left and set(left) <= {"ACKED", "lock"}
    with pytest.raises(StateError, match=f"MANIFEST and state.db are missing, but ACKED says {seq} changes"):
        Journal.open(d, config=CONFIG)
    assert sorted(p.name for p in d.iterdir()) == left            # refused without creating anything


def test_the_manifest_says_running_while_a_manager_serves_and_a_lost_wal_is_then_refused(tmp_path):
    d = tmp_path / "s"
    j = Journal.open(d, config=CONFIG)
    assert json.loads((d / "MANIFEST").read_text())["running"] is True
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[5], n=[3]))
    assert j.snapshot_seq == 0                                    # nothing but the begin() wrote the MANIFEST
    image = crash_copy(d, tmp_path / "crashed")
    j.close(snapshot=False)
    assert json.loads((d / "MANIFEST").read_text())["running"] is False
    (image / "state.db-wal").unlink()
    with pytest.raises(StateError, match=r"state\.db-wal is missing after an unclean stop of incarnation 1"):
        Journal.open(image, config=CONFIG)


def test_a_database_sqlite_cannot_read_is_refused_as_damaged(tmp_path):
    d, *_ = make_state(tmp_path, crashed=False)
    db = bytearray((d / "state.db").read_bytes())
    assert db[100] in (0x05, 0x0D)          # page 1's b-tree page type (sqlite_schema: table interior or leaf)
    db[100] = 0xFF                          # no such page type
    (d / "state.db").write_bytes(bytes(db))
    with pytest.raises(StateError, match=r"state\.db: cannot be read") as e:
        Journal.open(d, config=CONFIG)
    assert e.value.reason == "STATE_DAMAGED"


@pytest.mark.parametrize("seed", [3, 4])
def test_one_flipped_bit_in_the_last_frames_page_is_named_by_word_and_bit(tmp_path, seed):
    """The checksummed words of a frame are its header's first 8 bytes, then the page, 32-bit words in the
    byte order the WAL magic names (0x377F0683: big-endian, 0x377F0682: little-endian).

    Only the low 16 bits of a word are flipped: a flip of bit b adds +-2^b, which the checksum scales by odd or
    even coefficients mod 2^32, so high bits of different words can explain the same mismatch (bit 31 always)."""
    wal, page = _small_wal(tmp_path, f"wal-page-bit-{seed}")
    rep = check_wal(wal, page)
    assert rep.problem is None and rep.frames > 2
    big = struct.unpack(">I", wal.read_bytes()[:4])[0] == 0x377F0683
    rng = np.random.default_rng(seed)
    for _ in range(3):
        p, j = 4 * int(rng.integers(0, page // 4)) + int(rng.integers(2, 4) if big else rng.integers(0, 2)), \
            int(rng.integers(0, 8))
        at = 32 + (rep.frames - 1) * (24 + page) + 24 + p
        covered = 8 + p                                       # byte offset among the checksummed bytes
        word, byte = divmod(covered, 4)
        bit = ((3 - byte) if big else byte) * 8 + j
        flip(wal, 8 * at + j)
        assert f"one flipped bit (bit {bit} of checksummed word {word})" in check_wal(wal, page).problem
        flip(wal, 8 * at + j)
        assert check_wal(wal, page).problem is None


def _without_lineage(blob: bytes) -> bytes:
    """The snapshot as a release before lineages wrote it: the same header without its "lineage" key."""
    hlen = struct.unpack_from("<I", blob, 12)[0]
    header = json.loads(blob[32:32 + hlen])
    base = 32 + hlen + (-(32 + hlen) % 64)
    del header["lineage"]
    new = json.dumps(header, separators=(",", ":")).encode()
    head = b"KVSNAP\r\n" + struct.pack("<II", 1, len(new)) + hashlib.blake2b(new, digest_size=16).digest() + new
    return head + bytes(-len(head) % 64) + blob[base:]


def test_a_snapshot_written_before_lineages_decodes_with_lineage_0():
    window = snap.WindowState([("r-1", "Step", bytes(range(16)), 7, 1.5)], [])
    enc = snap.encode(9, 2, 1.25, {}, [], window, METHODS, lineage=0x5EED_1234_ABCD)
    blob = b"".join(bytes(c) for c in enc.chunks)
    assert snap.decode(blob).lineage == 0x5EED_1234_ABCD
    old = snap.decode(_without_lineage(blob))
    assert (old.seq, old.incarnation, old.created, old.lineage) == (9, 2, 1.25, 0)


def test_a_configured_pool_request_carries_its_prefix_hash_settings():
    req = create_request("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=8, max_seq_len=64), (),
                         prefix_caching=True, model="m-7", prefix_hash="sha256_cbor", prefix_hash_seed="s-93")
    assert (req.prefix_hash, req.prefix_hash_seed, req.model, req.enable_prefix_caching) == \
        ("sha256_cbor", "s-93", "m-7", True)


def test_the_manifest_is_written_in_its_canonical_key_order(tmp_path):
    """The MANIFEST file lists its keys sorted, the canonical form its digest is taken over (not the order the
    writer happened to pass its fields in): the same witness gives the same bytes."""
    d = tmp_path / "s"
    j = Journal.open(d, config=CONFIG)
    setup_pools(j)
    j.close(snapshot=False)
    pairs = json.loads((d / "MANIFEST").read_text(), object_pairs_hook=list)
    keys = [k for k, _ in pairs]
    assert {"format", "incarnation", "lineage", "running", "last_seq", "snapshot_seq", "digest"} <= set(keys)
    assert keys == sorted(keys)
    # exactly the fields docs/DURABILITY.md's MANIFEST row lists
    row = next(ln for ln in (Path(__file__).parents[2] / "docs" / "DURABILITY.md").read_text().splitlines()
               if ln.startswith("| `MANIFEST` |"))
    assert set(keys) == set(re.findall(r"`([a-z_]+)`", row.split("|")[2]))       # (not the file ACKED)
    assert isinstance(dict(pairs)["updated"], float)


def test_refusals_carry_their_documented_reason_codes(tmp_path):
    """docs/DURABILITY.md's refusals, each with its reason code: no state at all (read-only open), a MANIFEST of
    another format, a state.db whose 16-byte SQLite magic ("SQLite format 3\\0", SQLite's file format doc) is
    damaged."""
    from kvservice.state.sqlite.store import SqliteStore
    with pytest.raises(StateError, match="no kvservice state here") as e:
        SqliteStore.open(tmp_path / "empty", readonly=True)
    assert e.value.reason == "STATE_MISSING"

    d, *_ = make_state(tmp_path, crashed=False, name="fmt")
    m = json.loads((d / "MANIFEST").read_text())
    m["format"] = 7
    body = {k: v for k, v in m.items() if k != "digest"}
    m["digest"] = hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    (d / "MANIFEST").write_text(json.dumps(m))
    with pytest.raises(StateError, match=r"state format 7 is not 2") as e:
        Journal.open(d, config=CONFIG)
    assert e.value.reason == "STATE_FORMAT"

    d, *_ = make_state(tmp_path, crashed=False, name="magic")
    db = bytearray((d / "state.db").read_bytes())
    assert db[:16] == b"SQLite format 3\x00"
    db[7] ^= 0x20                               # 'f' -> 'F': the magic no longer matches
    (d / "state.db").write_bytes(bytes(db))
    with pytest.raises(StateError, match=r"state\.db is not an SQLite database") as e:
        Journal.open(d, config=CONFIG)
    assert e.value.reason == "STATE_DAMAGED"


def test_a_flip_the_checksum_cannot_place_names_every_candidate_not_a_guess(tmp_path):
    """Bit 31 of any page word changes both checksum words by 2^31 times an odd or even coefficient: every word
    whose coefficients share that parity explains the mismatch alike, so the message names candidates, the flipped
    one among them, and says the checksum cannot tell them apart."""
    wal, page = _small_wal(tmp_path, "wal-bit-31")
    rep = check_wal(wal, page)
    big = struct.unpack(">I", wal.read_bytes()[:4])[0] == 0x377F0683
    rng = np.random.default_rng(31)
    p = 4 * int(rng.integers(64, page // 4))
    at = 32 + (rep.frames - 1) * (24 + page) + 24 + p + (0 if big else 3)      # the byte holding bit 31
    word = (8 + p) // 4
    flip(wal, 8 * at + 7)
    problem = check_wal(wal, page).problem
    assert "one flipped bit (bit 31 of checksummed word " in problem
    assert "other places the checksum cannot tell apart" in problem
    named = [int(w) for w in re.findall(r"bit 31 of (?:checksummed )?word (\d+)", problem)]
    more = re.search(r"and (\d+) more\)", problem)
    assert word in named or more is not None, problem
    flip(wal, 8 * at + 7)
    assert check_wal(wal, page).problem is None
