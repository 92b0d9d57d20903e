"""ClientMetrics (kvservice/client/position.py) as a Prometheus scrape shows it: the two counters docs/DESIGN.md
names (kvservice_client_state_rollbacks_total, kvservice_client_lineage_changes_total), each a counter with its
help text, at 0 until the tracker they are attached to refuses a rolled-back reply or meets a new lineage (one
each time); one set per registry, shared by every client of that registry.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvservice.client.position import ClientMetrics, PositionTracker, StateRolledBack
from kvservice.v1 import block_manager_pb2 as pb

ROLLBACKS_HELP = ("Manager replies refused because the manager's state was behind what this process had already seen "
                  "in the same lineage (STATE_ROLLED_BACK).")
CHANGES_HELP = ("Manager replies of a state lineage this process had not seen before (state that started from "
                "nothing or was repaired).")


def _reply(lineage, seq):
    return pb.StepReply(position=pb.JournalPosition(lineage=lineage, incarnation=1, seq=seq))


def test_the_counters_scrape_with_their_names_types_and_help_and_count_what_the_tracker_reports():
    registry = CollectorRegistry()
    metrics = ClientMetrics.of(registry)
    assert ClientMetrics.of(registry) is metrics and ClientMetrics.of(CollectorRegistry()) is not metrics
    text = generate_latest(registry).decode()
    for name, help_text in (("kvservice_client_state_rollbacks_total", ROLLBACKS_HELP),
                            ("kvservice_client_lineage_changes_total", CHANGES_HELP)):
        assert f"# HELP {name} {help_text}\n" in text
        assert f"# TYPE {name} counter\n" in text
        assert f"\n{name} 0.0\n" in text
    t = PositionTracker()
    metrics.attach(t)
    t.check("Step", _reply(7, 10), t.seen(), None)
    t.check("Step", _reply(9, 3), t.seen(), None)                    # a new lineage: counted once
    t.check("Step", _reply(9, 3), t.seen(), None)                    # the same position again: nothing
    assert registry.get_sample_value("kvservice_client_lineage_changes_total") == 1
    assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 0
    for n in (1, 2):
        with pytest.raises(StateRolledBack):
            t.check("Step", _reply(9, 1), t.seen(), None)
        assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == n
    assert registry.get_sample_value("kvservice_client_lineage_changes_total") == 1


def test_a_lineage_after_replies_of_a_manager_from_before_lineages_counts_as_a_change():
    """Lineage 0 (a manager from before lineages) seen, then lineage 7: a new lineage, reported with the old one."""
    changes = []
    t = PositionTracker(on_new_lineage=lambda old, new: changes.append((old, new)))
    t.check("Step", _reply(0, 4), t.seen(), None)
    assert (t.lineage_changes, changes) == (0, [])
    t.check("Step", _reply(7, 2), t.seen(), None)
    assert (t.lineage_changes, changes, t.lineage, t.seq) == (1, [(0, 7)], 7, 2)


def test_a_refusal_is_logged_as_its_message_whatever_the_call_is_named(caplog):
    """The error log of a refused reply is the error's own text (a call name with "%s" in it too)."""
    t = PositionTracker()
    t.check("Step%s", _reply(5, 9), t.seen(), None)
    with caplog.at_level("ERROR", logger="kvservice.client"), pytest.raises(StateRolledBack) as err:
        t.check("Step%s", _reply(5, 8), t.seen(), "rid-1")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [("kvservice.client", "ERROR",
                                                                                err.value.message)]
    assert err.value.message.startswith("Step%s: the manager answered at journal position 8 of state lineage "
                                        "0000000000000005 (incarnation 1), but this client had already seen position 9")


def test_a_rollback_below_a_seen_position_zero_says_what_was_seen():
    """StateRolledBack's seen: the seq seen before (0 included); -1 only for a lineage refused earlier."""
    from kvservice.client.position import JournalPos
    err = StateRolledBack("Step", JournalPos(3, 1, 0), 0, None, None, 1)
    assert "but this client had already seen position 0 of that lineage" in err.message
    assert err.metadata["seen_seq"] == "0"
    again = StateRolledBack("Step", JournalPos(3, 1, 0), -1, None, None, 2)
    assert "a lineage this client already found rolled back" in again.message
