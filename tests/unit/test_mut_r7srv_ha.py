"""kvservice/server/ha.py HAController._reload: every recovery from a newer snapshot counts one more reload (the
kvservice_standby_reloads_total counter: "Times this standby recovered again"), each one restarts the reader
first and replays inside one KV-event transaction (the batches show once the reload is done).

Fakes stand in for the store, lease and journal: only the controller's own logic is checked.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np

from kvservice.server.ha import HACollector, HAController
from kvservice.state.nats.journal import JournalGap


def test_each_recovery_from_a_newer_snapshot_counts_one_more_reload() -> None:
    """Three compactions overtake the standby one after the other: each _reload restarts the reader, replays inside
    a transaction, returns True, and the count (and its counter series) goes 1, 2, 3."""
    rng = np.random.default_rng(23)
    ev: list[str] = []

    @contextlib.contextmanager
    def transaction():
        ev.append("begin")
        yield
        ev.append("end")

    def reload() -> int:
        ev.append("reload")
        return int(rng.integers(1, 100))

    journal = SimpleNamespace(manager=SimpleNamespace(events=SimpleNamespace(transaction=transaction)),
                              reload=reload, snapshot_seq=11, seq=40, _fail=lambda why: ev.append(f"fail {why}"))
    store = SimpleNamespace(restart_reading=lambda: ev.append("restart"))
    ha = HAController(journal, store, SimpleNamespace(config=SimpleNamespace(poll_seconds=0.5)), None)
    for n in (1, 2, 3):
        assert ha._reload(JournalGap(f"entry {n} was purged")) is True
        assert ha.reloads == n
    assert ev == ["restart", "begin", "reload", "end"] * 3
    assert (ha.role, ha.failed) == ("standby", None)
    ha.lease = SimpleNamespace(held=False, remaining_seconds=0.0, renewals=0, renew_failures=0)
    ha.store = SimpleNamespace(max_epoch=0, epoch=0, append_retries=0, link=SimpleNamespace(disconnects=0))
    (series,) = [m for m in HACollector(ha).collect() if m.name == "kvservice_standby_reloads"]
    assert [s.value for s in series.samples if s.name == "kvservice_standby_reloads_total"] == [3.0]
