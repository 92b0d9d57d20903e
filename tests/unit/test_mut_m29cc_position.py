"""The clients' rollback check (kvservice/client/position.py) against a plain-Python model of docs/DURABILITY.md
("Journal positions and the clients"), on random histories, and its error's whole text and metadata.

The model: per lineage the highest seq seen (at most MAX_LINEAGES lineages, oldest forgotten first); a reply below
what was seen *before its call was sent* is refused (DATA_LOSS, STATE_ROLLED_BACK, counted) and its lineage stays
refused (seen_seq -1) until reset; a lineage not seen before is accepted and reported (lineage_changes, the hook
with the old and new lineage); equal positions are fine; the last accepted position is (lineage, incarnation, seq)."""

from __future__ import annotations

import random

import grpc
import pytest

from kvservice.client.position import MAX_LINEAGES, PositionTracker, StateRolledBack
from kvservice.v1 import block_manager_pb2 as pb


def reply(lineage: int, seq: int, incarnation: int) -> pb.StepReply:
    return pb.StepReply(position=pb.JournalPosition(lineage=lineage, incarnation=incarnation, seq=seq))


class Model:
    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.refused: dict[int, int] = {}
        self.rollbacks = self.changes = 0
        self.pos = (0, 0, 0)

    def check(self, lin: int, inc: int, seq: int, before: dict[int, int]) -> int | None:
        """None if accepted, else the seen_seq the refusal carries."""
        if lin in self.refused:
            self.rollbacks += 1
            return -1
        if lin in before and seq < before[lin]:
            self.rollbacks += 1
            self.refused[lin] = before[lin]
            if len(self.refused) > MAX_LINEAGES:
                del self.refused[next(iter(self.refused))]
            return before[lin]
        if lin not in self.seen:
            if self.seen or self.pos[0]:
                self.changes += 1
            self.seen[lin] = seq
            if len(self.seen) > MAX_LINEAGES:
                del self.seen[next(iter(self.seen))]
            self.pos = (lin, inc, seq)
        elif seq >= self.seen[lin]:
            self.seen[lin] = seq
            self.pos = (lin, inc, seq)
        return None


@pytest.mark.parametrize("seed", range(6))
def test_the_tracker_follows_the_documented_model_on_random_histories(seed):
    rng = random.Random(seed)
    lineages = [rng.getrandbits(64) | 1 for _ in range(rng.choice([3, MAX_LINEAGES + 4]))]
    rolled, changed = [], []
    t = PositionTracker(on_rollback=rolled.append, on_new_lineage=lambda old, new: changed.append((old, new)))
    m = Model()
    snapshots = [t.seen()]
    for i in range(400):
        lin = rng.choice(lineages[:rng.randint(1, len(lineages))])
        base = m.seen.get(lin, rng.randint(0, 50))
        seq = max(0, base + rng.choice([-3, -1, 0, 0, 1, 1, 2, 5]))
        inc = rng.randint(1, 9)
        # usually what was seen just before this call; sometimes an older snapshot (a call sent earlier)
        seen = snapshots[-1] if rng.random() < 0.8 else rng.choice(snapshots[-5:])
        before = dict(seen)
        pos_before = (t.lineage, t.incarnation, t.seq)
        want_changes = m.changes
        refused = m.check(lin, inc, seq, before)
        if refused is None:
            t.check("Step", reply(lin, seq, inc), seen, f"r{i}")
            assert len(changed) == m.changes
            if m.changes > want_changes:
                assert changed[-1] == (pos_before[0], lin)
        else:
            with pytest.raises(StateRolledBack) as err:
                t.check("Step", reply(lin, seq, inc), seen, f"r{i}")
            e = err.value
            assert rolled[-1] is e and len(rolled) == m.rollbacks
            assert (e.code, e.reason, e.request_id, e.seen, e.got) == (
                grpc.StatusCode.DATA_LOSS, "STATE_ROLLED_BACK", f"r{i}", refused, (lin, inc, seq))
            assert e.metadata == {"lineage": f"{lin:016x}", "seen_seq": str(refused), "seq": str(seq),
                                  "incarnation": str(inc), "rollbacks": str(m.rollbacks), "request_id": f"r{i}"}
        assert (t.rollbacks, t.lineage_changes) == (m.rollbacks, m.changes)
        assert (t.lineage, t.incarnation, t.seq) == m.pos
        assert dict(t.seen()) == m.seen
        snapshots.append(t.seen())
        if rng.random() < 0.01:
            t.reset()
            m.seen, m.refused, m.pos = {}, {}, (0, 0, 0)
            assert (t.lineage, t.incarnation, t.seq, dict(t.seen())) == (0, 0, 0, {})
    assert m.rollbacks > 0


def test_a_refused_lineage_is_refused_again_and_each_refusal_counts_one():
    lin = 0x0123_4567_89AB_CDEF
    t = PositionTracker()
    t.check("Step", reply(lin, 50, 1), t.seen(), None)
    with pytest.raises(StateRolledBack):
        t.check("Step", reply(lin, 10, 2), t.seen(), None)
    for n in range(2, 7):
        with pytest.raises(StateRolledBack) as err:
            t.check("Step", reply(lin, 60 + n, 2), t.seen(), None)
        assert t.rollbacks == n and err.value.metadata["rollbacks"] == str(n)


def test_the_refusals_say_what_happened_and_what_to_do():
    lin = 0x00AB_CDEF_0123_4567
    t = PositionTracker()
    t.check("Step", reply(lin, 812, 3), t.seen(), "rid-a")
    with pytest.raises(StateRolledBack) as first:
        t.check("Step", reply(lin, 799, 4), t.seen(), "rid-b")
    advice = ("Its state contradicts replies this client acted on: do not use it. Check the manager "
              "(`kvservice check-state`, docs/DURABILITY.md); once the scheduler has resynchronised with the "
              "manager's present state, call reset_position() to accept it. Until then every reply of this "
              "lineage is refused")
    assert first.value.message == (
        "Step: the manager answered at journal position 799 of state lineage 00abcdef01234567 (incarnation 4), "
        "but this client had already seen position 812 of that lineage: the manager's state was rolled back and "
        "lost changes it had acknowledged (a restored backup, a journal that lost its tail). " + advice)
    with pytest.raises(StateRolledBack) as again:
        t.check("GetStats", pb.StatsReply(position=pb.JournalPosition(lineage=lin, incarnation=4, seq=900)),
                t.seen(), None)
    assert again.value.message == (
        "GetStats: the manager answered at journal position 900 of state lineage 00abcdef01234567, a lineage this "
        "client already found rolled back. " + advice)
    assert again.value.reply.position.seq == 900 and again.value.seen == -1


def test_the_tracker_remembers_the_refusals_of_the_last_max_lineages_lineages():
    rng = random.Random(77)
    lineages = [rng.getrandbits(63) | 1 for _ in range(MAX_LINEAGES + 1)]
    t = PositionTracker()
    for lin in lineages:                             # each seen at 10, then answering at 5: refused
        t.check("Step", reply(lin, 10, 1), t.seen(), None)
        with pytest.raises(StateRolledBack):
            t.check("Step", reply(lin, 5, 2), t.seen(), None)
    # the oldest refusal is forgotten (its lineage is then a new one to this client); the last MAX_LINEAGES stay
    t.check("Step", reply(lineages[0], 20, 3), t.seen(), None)
    assert (t.lineage, t.seq) == (lineages[0], 20)
    for lin in lineages[1:]:
        with pytest.raises(StateRolledBack) as err:
            t.check("Step", reply(lin, 20, 3), t.seen(), None)
        assert err.value.seen == -1
    assert t.rollbacks == 2 * MAX_LINEAGES + 1
