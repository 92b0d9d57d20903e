"""Recovery reading is not strict (kvservice/state/nats/reader.py, poll: "else pass it on, and the journal refuses
the gap (recovery: entries missing)"): NatsStore.entries_after passes on an entry that does not follow the last one
read, where a standby's strict catch_up raises JournalGap."""

from __future__ import annotations

import pytest

from kvservice.state.nats.config import JournalGap
from kvservice.state.nats.journal import NatsStore

from .test_mut_m28c_nats import _stream, _writer, call
from .test_nats_store import link  # noqa: F401  (fixture)


def test_entries_after_passes_entries_after_a_gap_on_while_a_strict_catch_up_refuses_them(link):  # noqa: F811
    """Stream purged below entry 4's first message (no snapshot) -> entries_after(0) gives entries 4.. as they are;
    catch_up() (strict) raises JournalGap naming entry 4 after position 0."""
    from .test_journal import run, setup_pools, step_req

    j = _writer(link)
    try:
        setup_pools(j)
        for i in range(4):
            run(j, "Step", step_req("a", admit=[i + 1], n=[i + 2]))
        _, msgs = _stream(link, link.config.stream)
        first_of = {int(m.headers["Kvs-Seq"]): m.seq for m in msgs
                    if m.headers["Kvs-Kind"] == "entry" and m.headers["Kvs-Part"].startswith("0/")}
        last = j.seq
        assert last >= 5 and sorted(first_of) == list(range(1, last + 1))
        call(link, link.js.purge_stream(link.config.stream, seq=first_of[4]))
        got = [e.seq for e in NatsStore(link, readonly=True).entries_after(0)]
        assert got == list(range(4, last + 1))
        with pytest.raises(JournalGap, match=r"journal entry 4 follows 0: "):
            list(NatsStore(link, readonly=True).catch_up())
    finally:
        j.close(snapshot=False)
