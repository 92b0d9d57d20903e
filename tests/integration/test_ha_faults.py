"""The fault suite (CI, bounded): 3 managers on 3 NATS nodes under Step load, one fault after another.

tests/integration/fault_harness.py builds the lab: every connection between the processes runs
through a loopback link the test can cut, the loaders are scheduler-like clients on the public
LeaderClient whose models are the independent record of every acknowledged Step. After each
fault the replicated state is recovered from NATS and compared exactly with that record (each
sequence's token count and pages; nothing acknowledged lost, nothing applied twice); at the
end every epoch was acknowledged by one manager process only, and no recovery replayed more
than compact_every entries. Nothing here is timed; the long run with figures is bench/bench_ha.py
(bench/results/ha.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from ..natsutil import require_nats_server
from .fault_harness import FaultLab, summary

pytestmark = pytest.mark.integration
COMPACT_EVERY = 400                  # snapshots due every 300 entries: several in the run
LEASE = ("--leader-ttl", "1.0", "--leader-renew", "0.25", "--compact-every", str(COMPACT_EVERY))


def test_no_acknowledged_step_is_lost_through_kills_pauses_crashes_and_partitions(tmp_path):
    require_nats_server()
    lab = FaultLab(tmp_path, managers=3, loaders=3, extra=LEASE)
    rng = np.random.default_rng(20)
    try:
        lab.start()                                  # three managers started at the same instant
        for _ in range(2):
            lab.kill_leader(rng)
        lab.pause_leader()
        lab.kill_nats()                              # the node leading the journal stream
        lab.partition_manager(4.0)                   # the leader cut off from NATS, past its lease
        lab.partition_nats(seconds=4.0)              # the stream's leader node cut off from everyone
        lab.kill_all_nats()                          # coordinated crash: fsync before ack keeps everything
        lab.kill_leader(rng)
        lab.system.raise_loader_errors()
        bad = summary(lab.outcomes)
        assert not bad, bad
        assert not lab.epochs_with_two_writers()
        assert all(o.new_epoch > o.old_epoch for o in lab.outcomes if o.fault.startswith(("kill -9 leader",
                                                                                          "partition: the leader")))
        # compact_every bounds every recovery while snapshots can be stored; a snapshot write that failed (NATS
        # timed out storing it during a fault) is retried half an interval later, and calls went on meanwhile
        replays, failed = lab.replays(), lab.failed_snapshots()
        assert replays and max(replays) <= COMPACT_EVERY + failed * (COMPACT_EVERY // 2), (replays, failed)
        assert min(ld.acked for ld in lab.system.loaders) > 20
        assert sum(ld.client.stale_replies for ld in lab.system.loaders) == 0
    finally:
        lab.stop()
