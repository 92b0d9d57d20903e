"""NatsStore.restart_reading (a standby about to recover again: Journal.reload): it forgets the read position, and
the same store then reads the journal again from the start, exactly as a fresh reader does (the entries and the
journal-position -> stream-sequence map a later snapshot is cut at)."""

from __future__ import annotations

import numpy as np

from kvservice.state.nats.journal import NatsStore

from .test_mut_m28c_nats import _writer
from .test_nats_store import link  # noqa: F401  (fixture)


def test_a_restarted_reader_reads_every_entry_again_like_a_fresh_one(link):  # noqa: F811
    """Read all, restart_reading -> positions 0; read all again -> the same entries and stream positions as the
    first read and as a new reader's."""
    from .test_journal import run, setup_pools, step_req

    rng = np.random.default_rng(20261203)
    j = _writer(link)
    try:
        setup_pools(j)
        for i in range(3):
            run(j, "Step", step_req("a", admit=[i + 1], n=[int(rng.integers(1, 60))]))
        reader = NatsStore(link, readonly=True)
        first = [(e.seq, e.method, e.request, e.created, e.digest) for e in reader.entries_after(0)]
        at_first = dict(reader._stream_at)
        assert [e[0] for e in first] == list(range(1, j.seq + 1)) and reader.seq == j.seq
        reader.restart_reading()
        assert (reader.seq, reader.last_stream_seq, reader.first_stream_seq) == (0, 0, 0)
        again = [(e.seq, e.method, e.request, e.created, e.digest) for e in reader.entries_after(0)]
        assert again == first and reader._stream_at == at_first
        fresh = NatsStore(link, readonly=True)
        assert [(e.seq, e.method, e.request, e.created, e.digest) for e in fresh.entries_after(0)] == first
        assert fresh._stream_at == at_first
    finally:
        j.close(snapshot=False)
