"""PositionTracker.seen() snapshots (kvservice/client/position.py: "_seen: lineage -> highest seq; replaced, never
mutated"): a reply that moves no lineage's highest seq leaves the snapshot a caller already holds as it is (the
same object: no copy per reply in a steady loop); a higher seq replaces it with a new mapping and leaves the old
one unchanged. Oracle: the mappings written out by hand.
"""

from __future__ import annotations

from kvservice.client.position import PositionTracker
from tests.support_client import at_position


def test_a_reply_at_a_seen_position_keeps_the_snapshot_and_a_higher_one_replaces_it():
    t = PositionTracker()
    t.check("GetPool", at_position(0xC1, 40), t.seen(), None)
    first = t.seen()
    for seq in (40, 40):                          # the same position again: nothing moved
        t.check("GetPool", at_position(0xC1, seq), t.seen(), None)
        assert t.seen() is first
    t.check("GetPool", at_position(0xC1, 41), t.seen(), None)
    assert dict(first) == {0xC1: 40} and dict(t.seen()) == {0xC1: 41} and t.seen() is not first
    assert (t.lineage, t.incarnation, t.seq, t.rollbacks, t.lineage_changes) == (0xC1, 2, 41, 0, 0)
