"""snapshot.decode names the snapshot "snapshot" in every refusal when the caller gives no name, and each header
refusal says exactly what is wrong. Blobs are built by hand from the byte layout in docs/DURABILITY.md ("Snapshot
format (version 1)"): bytes 0-7 ``KVSNAP\\r\\n``, 8-11 container version (uint32 LE, 1), 12-15 header length H,
16-31 blake2b-128 of the header, then the JSON header."""

import hashlib
import json
import struct

import pytest

from kvservice.contract.errors import StateError
from kvservice.state.snapshot import decode


def b2(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def blob(magic=b"KVSNAP\r\n", container=1, header=b"{}", hlen=None, digest=None, tail=b""):
    hlen = len(header) if hlen is None else hlen
    return (magic + struct.pack("<II", container, hlen) + (b2(header) if digest is None else digest) + header
            + tail)


HEADER = json.dumps({"format": "other-format", "version": 1}).encode()


@pytest.mark.parametrize(("data", "message"), [
    (b"", "snapshot: 0 bytes, too short to be a snapshot (truncated)"),
    (blob()[:31], "snapshot: 31 bytes, too short to be a snapshot (truncated)"),
    (blob(magic=b"KVSNAP\n\n"), "snapshot: not a kvservice snapshot (magic b'KVSNAP\\n\\n'): damaged or another file"),
    (blob(container=2), "snapshot: container version 2 is not 1: damaged or written by another kvservice release"),
    (blob(header=b"{}", hlen=40), "snapshot: header length 40 does not fit the 34-byte file (damaged)"),
    (blob(header=b"{}", digest=bytes(16)), "snapshot: header fails its checksum (damaged)"),
    (blob(header=HEADER), "snapshot: format 'other-format' is not 'kvservice-snapshot'"),
], ids=["empty", "31-bytes", "magic", "container", "header-length", "header-digest", "format"])
def test_decode_refusals_name_the_snapshot_and_what_is_wrong(data, message):
    """With no `where`, every refusal starts "snapshot: " and gives the exact finding (a StateError)."""
    with pytest.raises(StateError) as err:
        decode(data)
    assert err.value.message == message and str(err.value) == message


def test_decode_names_the_given_place_instead():
    """A caller's name replaces "snapshot" (the same 5-byte refusal, another name)."""
    with pytest.raises(StateError) as err:
        decode(b"KVSNA", "dir/snapshots/snapshot-7.kvs")
    assert err.value.message == "dir/snapshots/snapshot-7.kvs: 5 bytes, too short to be a snapshot (truncated)"
