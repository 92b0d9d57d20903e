"""The snapshot bucket as a standby reads it: of its ``snap-<seq, 20 digits>`` objects (journal.py's module docstring)
the newest by name is the one loaded and the one newest_snapshot_seq names, whatever order they were stored in,
whatever else the bucket holds, and however many older ones a writer that died mid-write left behind."""

from __future__ import annotations

import hashlib
import io
import json
import secrets

import numpy as np
from nats.js import api

from kvservice.state.nats.journal import NatsStore

from .test_nats_store import (
    call,
    link,  # noqa: F401  (fixture)
)


def _put(store, name, blob, meta):
    call(store.link, store._obs.put(name, blob, meta=api.ObjectMeta(name=name, description=json.dumps(meta))))


def test_the_newest_of_several_snapshots_is_loaded_and_named_whatever_else_the_bucket_holds(link):  # noqa: F811
    """Three snapshots stored newest first, a foreign object whose name sorts after them all, and a deleted newer
    snapshot: newest_snapshot_seq is the newest live snap- position, and load_snapshot gives that position and its
    bytes and reads on after its stream sequence (first_stream_seq = stream_seq + 1, max_epoch from its header)."""
    rng = np.random.default_rng(20261203)
    NatsStore(link)                                            # the stream and the bucket
    store = NatsStore(link, readonly=True)
    seqs = sorted(int(s) for s in rng.choice(np.arange(10, 10 ** 9), size=3, replace=False))
    blobs = {s: secrets.token_bytes(int(rng.integers(50, 400))) for s in seqs}
    metas = {s: {"format": 2, "seq": s, "stream_seq": s + int(rng.integers(1, 1000)),
                 "epoch": int(rng.integers(2, 1 << 20)), "lineage": f"{int(rng.integers(1, 1 << 62)):016x}",
                 "at": 1.5, "bytes": len(blobs[s]), "digest": hashlib.blake2b(blobs[s], digest_size=16).hexdigest()}
             for s in seqs}
    for s in (seqs[2], seqs[0], seqs[1]):                      # the newest first: name order, not store order
        _put(store, f"snap-{s:020d}", blobs[s], metas[s])
    _put(store, "zz-not-a-snapshot", b"junk", {"note": "not kvservice's"})
    gone = seqs[2] + 1
    _put(store, f"snap-{gone:020d}", b"deleted", metas[seqs[2]])
    call(link, store._obs.delete(f"snap-{gone:020d}"))

    newest = seqs[2]
    assert store.newest_snapshot_seq() == newest
    assert store._snapshot_newer_than(newest - 1) and not store._snapshot_newer_than(newest)
    assert store.load_snapshot() == (newest, blobs[newest])
    m = metas[newest]
    assert (store.seq, store.last_stream_seq, store.first_stream_seq) == (newest, m["stream_seq"], m["stream_seq"] + 1)
    assert store.max_epoch == m["epoch"]
    assert store.snapshot_where == f"bucket {link.config.snapshot_bucket}, snap-{newest:020d}"
    out = io.BytesIO()
    call(link, store._obs.get("zz-not-a-snapshot", writeinto=out))
    assert out.getvalue() == b"junk"                           # left alone
