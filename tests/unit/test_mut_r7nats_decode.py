"""StreamReader._decode's whole contract on hand-made stream messages (kvservice/state/nats/reader.py module doc and
journal.py's message layout: Kvs-Kind entry|fence, Kvs-Seq, Kvs-Method, Kvs-At, Kvs-Part i/n, Kvs-Digest hex,
Kvs-Epoch, Kvs-Lineage): a redelivered message is skipped; a fence raises max_epoch, voids an unfinished entry and
carries the lineage; an entry in parts is reassembled (its checksum as written, its stream sequence recorded); a
part whose entry began before the reader is skipped; an entry the snapshot covers is skipped; an entry that does
not follow is a JournalGap for a strict reader and passed on otherwise; a stream gap while a newer snapshot exists
is "compacted past" for a non-strict reader."""

from __future__ import annotations

import secrets
import threading
from types import SimpleNamespace

import pytest

from kvservice.contract.errors import StateError
from kvservice.state.nats.config import JournalGap
from kvservice.state.nats.reader import StreamReader

PATH = "nats://h:1 (stream KVS_t)"


def _msg(n, headers, data=b""):
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=n)), headers=headers, data=data)


def _entry(n, seq, part, data, at="17.25", digest="00" * 16, method="Step"):
    return _msg(n, {"Kvs-Kind": "entry", "Kvs-Seq": str(seq), "Kvs-Method": method, "Kvs-At": at,
                    "Kvs-Part": part, "Kvs-Digest": digest, "Kvs-Epoch": "3"}, data)


def _reader(seq=0, last=0, lineage=0, newer=False):
    r = StreamReader()
    r.path, r.seq, r.last_stream_seq, r.lineage, r.max_epoch = PATH, seq, last, lineage, 2
    r._parts, r._stream_at, r._at_lock = None, {}, threading.Lock()
    r.asked = []
    r._snapshot_newer_than = lambda s: r.asked.append(s) or newer
    return r


def test_an_entry_in_parts_is_reassembled_with_its_checksum_and_stream_sequence():
    r = _reader(seq=4, last=10)
    digest = secrets.token_bytes(16)
    chunks = [secrets.token_bytes(5), secrets.token_bytes(7), b"z"]
    assert r._decode(_entry(11, 5, "0/3", chunks[0], digest=digest.hex())) is None
    assert r._decode(_entry(12, 5, "1/3", chunks[1], digest=digest.hex())) is None
    assert (r.seq, r.last_stream_seq, r._stream_at) == (4, 12, {})
    e = r._decode(_entry(13, 5, "2/3", chunks[2], digest=digest.hex(), method="CreatePool"))
    assert (e.seq, e.method, e.request, e.created, e.checksum) == (5, "Step", b"".join(chunks), 17.25, digest)
    assert (r.seq, r.last_stream_seq, r._stream_at, r._parts) == (5, 13, {5: 13}, None)
    assert r._decode(_entry(13, 6, "0/1", b"again")) is None and r.seq == 5          # redelivered: skipped


def test_a_fence_raises_the_epoch_voids_an_unfinished_entry_and_carries_the_lineage():
    r = _reader(seq=4, last=10)
    assert r._decode(_entry(11, 5, "0/2", b"a")) is None and r._parts is not None
    fence = _msg(12, {"Kvs-Kind": "fence", "Kvs-Epoch": "9", "Kvs-Lineage": "00000000000000ab"})
    assert r._decode(fence) is None
    assert (r._parts, r.max_epoch, r.lineage, r.last_stream_seq) == (None, 9, 0xAB, 12)
    assert r._decode(_entry(13, 5, "1/2", b"b")) is None and r.seq == 4              # its first part is void
    assert r._decode(_msg(14, {"Kvs-Kind": "fence", "Kvs-Epoch": "3"})) is None and r.max_epoch == 9
    with pytest.raises(StateError) as err:
        r._decode(_msg(15, {"Kvs-Kind": "fence", "Kvs-Epoch": "10", "Kvs-Lineage": "00000000000000cd"}))
    assert err.value.message == (f"{PATH}: fence 15 belongs to lineage 00000000000000cd, the state to "
                                 "00000000000000ab: parts of two different states (damaged)")


def test_entries_the_snapshot_covers_are_skipped_and_a_gap_is_refused_only_when_strict():
    r = _reader(seq=4, last=10)
    assert r._decode(_entry(11, 3, "0/1", b"old")) is None and (r.seq, r.last_stream_seq) == (4, 11)
    assert r._decode(_entry(12, 4, "0/1", b"old")) is None and (r.seq, r.last_stream_seq) == (4, 12)
    with pytest.raises(JournalGap) as err:
        r._decode(_entry(13, 7, "0/1", b"x"))
    assert err.value.message == (f"{PATH}: journal entry 7 follows 4: the entries between were compacted into a "
                                 "newer snapshot; recover again from it")
    loose = _reader(seq=4, last=10)
    e = loose._decode(_entry(11, 7, "0/1", b"x"), strict=False)
    assert e.seq == 7 and loose.seq == 7 and loose.asked == []     # the journal refuses the gap itself


def test_a_stream_gap_while_a_newer_snapshot_exists_is_compacted_past_for_a_recovery():
    r = _reader(seq=4, last=10, newer=True)
    assert r._decode(_entry(11, 5, "0/2", b"x"), strict=False) is None and r.asked == []    # the next one
    with pytest.raises(JournalGap) as err:
        r._decode(_entry(13, 5, "1/2", b"x"), strict=False)                             # one message missing
    assert err.value.message == (f"{PATH}: the stream was compacted past position 4 while it was read (a newer "
                                 "snapshot was stored meanwhile); recover again from it")
    assert r.asked == [4] and r.last_stream_seq == 11
    strict = _reader(seq=4, last=10, newer=True)
    assert strict._decode(_entry(13, 5, "0/1", b"x")).seq == 5 and strict.asked == []
    none_newer = _reader(seq=4, last=10, newer=False)
    assert none_newer._decode(_entry(13, 5, "0/1", b"x"), strict=False).seq == 5 and none_newer.asked == [4]
