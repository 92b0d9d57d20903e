"""open_journal (kvservice.server.ha): a recovery overtaken by a compaction (a JournalGap: a fault injected into the
first Journal.recover, the real one runs after it) is recovered again, logging the gap's message, and the journal
it returns holds the pool the writer created. NATS is the shared module-scoped server (`nats1`)."""

from __future__ import annotations

import logging
import uuid

import numpy as np

from kvservice.state.journal import JournalConfig


def test_a_recovery_overtaken_once_is_recovered_again_and_logs_the_gap(nats1, caplog, monkeypatch) -> None:
    from kvservice.client.codec import create_pool_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.server import ha
    from kvservice.state.nats.journal import JournalGap, NatsConfig

    cfg = JournalConfig(sync="normal", compact_every=1000, background_snapshots=False)
    config = NatsConfig(tuple(nats1.urls), name="s18" + uuid.uuid4().hex[:10])
    writer = ha.open_sole_writer(config, journal_config=cfg, lease_seconds=24 * 3600.0, epoch=3)
    slots = int(np.random.default_rng().integers(4, 40))
    writer.execute("CreatePool", create_pool_request("p18", CacheSpec.uniform(2, 2, 32, "float16", 4),
                                                     Sizing(num_slots=slots)), writer.api.CreatePool)
    writer.close(snapshot=False)
    gap = f"entry {int(np.random.default_rng().integers(1, 10**6))} was purged"
    real, calls = ha.Journal.recover, []

    def overtaken_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise JournalGap(gap)
        return real(*args, **kw)

    monkeypatch.setattr(ha.Journal, "recover", overtaken_once)
    with caplog.at_level(logging.INFO, logger="kvservice.server.ha"):
        j = ha.open_journal(config, 24 * 3600.0, cfg)
    monkeypatch.undo()
    try:
        assert len(calls) == 2
        lines = [r.getMessage() for r in caplog.records if r.name == "kvservice.server.ha"]
        assert lines == [f"recovering again: {gap}"]
        pool = j.api.manager.pool_and_lock("p18")[0]
        assert pool.plan.num_slots == slots
    finally:
        j.close(snapshot=False)
