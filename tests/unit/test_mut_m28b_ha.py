"""kvservice/server/ha.py: HAController._fence's result and phases, and HACollector's help texts, on a real
nats-server on loopback (tests/natsutil.py: skipped where it is not installed, failing under CI=true).

Oracles: the module docstring's takeover rule (fence with ``highest epoch seen + 1``), the phases _take_over's log
line names, and the Prometheus convention the other series of the project keep (a help text is a sentence).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvservice.state.journal import JournalConfig


@pytest.fixture(scope="module")
def nats1(tmp_path_factory):
    from ..natsutil import NatsCluster, require_nats_server
    require_nats_server()
    cluster = NatsCluster(tmp_path_factory.mktemp("nats1"), 1)
    cluster.start()
    yield cluster
    cluster.stop()


def _controller(nats1, epoch: int):
    from kvservice.server.ha import HAController, LeaderGate, open_sole_writer
    from kvservice.state.nats.journal import NatsConfig
    from kvservice.state.nats.leader import Lease, LeaseConfig

    config = NatsConfig(tuple(nats1.urls), name="h" + uuid.uuid4().hex[:10])
    j = open_sole_writer(config, journal_config=JournalConfig(sync="normal", compact_every=1000,
                                                               background_snapshots=False),
                         lease_seconds=24 * 3600.0, epoch=epoch)
    lease = Lease(j.store.link, LeaseConfig(), "node-" + uuid.uuid4().hex[:6], "127.0.0.1:1")
    return j, HAController(j, j.store, lease, LeaderGate())


def test_fence_takes_the_next_epoch_above_the_highest_seen_and_names_its_phases(nats1) -> None:
    epoch = int(np.random.default_rng(41).integers(2, 50))
    j, ha = _controller(nats1, epoch)
    try:
        assert ha.store.max_epoch == epoch
        laps: list[str] = []
        assert ha._fence(laps.append) == epoch + 1
        assert laps == ["caught up", "fenced"]
        assert (ha.store.epoch, ha.store.max_epoch) == (epoch + 1, epoch + 1)
        assert ha._fence() == epoch + 2                       # the default lap: none recorded, fenced again
        assert ha.store.max_epoch == epoch + 2
    finally:
        j.close(snapshot=False)


def test_every_ha_series_has_a_help_sentence(nats1) -> None:
    from kvservice.server.ha import HACollector

    j, ha = _controller(nats1, 3)
    try:
        reg = CollectorRegistry()
        reg.register(HACollector(ha))
        helps = [ln.split(" ", 3)[3] for ln in generate_latest(reg).decode().splitlines() if ln.startswith("# HELP ")]
        assert len(helps) == 11
        bad = [h for h in helps if not (h[0].isupper() or h[0].isdigit()) or not h.endswith(".")]
        assert bad == []
    finally:
        j.close(snapshot=False)
