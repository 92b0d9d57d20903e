"""An exhaustive model of the replicated journal's write protocol (docs/HA.md, "Why two writers are impossible").

The model keeps what safety rests on and nothing the argument does not need:

- the stream, as JetStream keeps it: messages in order; a publish carries the expected last
  sequence and a message id; the server answers a known id with "duplicate" and the sequence of
  the stored copy (before any other check, as nats-server does), refuses a wrong expected last
  sequence, else stores it;
- managers that take over *whenever they like*: there is no lease in the model at all (the worst
  a non-atomic compare-and-set could do is let several managers believe they lead at once). A
  takeover reads the stream to its end (one step), then publishes its fence (a later step:
  others may act in between), with epoch = the highest it saw + 1, as ``HAController._fence``;
- publishes whose reply is lost (the message stored or not) and retried with the same id, before
  or after the server's duplicate window forgot the id; a writer that is refused stops writing
  (fail-stop); crashes (a restart comes back as standby);
- a writer's state is the list of entries it applied; an entry is acknowledged when its publish
  is answered as stored.

The message ids and the acceptance of an acknowledgement are the real ones
(``kvservice.state.nats.fencing.message_id``, ``fence_id``, ``check_ack``), or the ones before
issue 20 (ids ``epoch.seq.part`` / ``fence.epoch``, any "duplicate" taken as success).
Checked in every reachable state: every acknowledged entry is in the stream at its position
(nothing acknowledged lost), every entry in the stream was written on a state equal to the
stream before it (the journal replays), and each epoch's acknowledgements come from one writer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import pytest

from kvservice.state.nats.config import Fenced
from kvservice.state.nats.fencing import check_ack, fence_id, message_id


@dataclass(frozen=True)
class Msg:
    kind: str              # "fence" | "entry"
    epoch: int
    pos: int               # journal position (an entry's); a fence: the position it follows
    value: tuple           # an entry's content: (writer, n)
    basis: tuple           # the entries the writer had applied when it wrote this one
    mid: str               # Nats-Msg-Id


@dataclass(frozen=True)
class Mgr:
    role: str = "standby"          # standby | reading | leader | stopped
    epoch: int = 0                 # the epoch it writes under (leader) or will fence (reading)
    token: str = ""                # writer incarnation token
    last: int = 0                  # expected last stream sequence (what it read or wrote last)
    log: tuple = ()                # entries it applied: its state
    pending: tuple | None = None   # a publish whose reply was lost: (msg, expected_last)
    fences: int = 0                # takeovers so far (bounds the search)


@dataclass(frozen=True)
class State:
    stream: tuple = ()             # of Msg
    mgrs: tuple = ()               # of Mgr
    acks: tuple = ()               # (epoch, writer token, manager, pos, value)
    writes: int = 0                # entries published so far (bounds the search)
    forgotten: int = 0             # leading messages whose ids the server's duplicate window dropped


def new_ids(epoch: int, token: str, pos: int) -> str:
    return message_id(epoch, token, pos, 0)


def old_ids(epoch: int, token: str, pos: int) -> str:
    return f"{epoch}.{pos}.0"


def new_fence_id(epoch: int, token: str) -> str:
    return fence_id(epoch, token)


def old_fence_id(epoch: int, token: str) -> str:
    return f"fence.{epoch}"


def new_accept(seq: int, duplicate: bool, sent_before: bool, expected_last: int) -> int:
    return check_ack(seq, duplicate, sent_before, expected_last)


def old_accept(seq: int, duplicate: bool, sent_before: bool, expected_last: int) -> int:
    return seq                                   # `_publish_once` before: "duplicate" or not, success


def replay(stream: tuple) -> tuple:
    """What a reader applies: every entry at the next position (the journal's position check)."""
    log: tuple = ()
    for m in stream:
        if m.kind == "entry" and m.pos == len(log) + 1:
            log += (m.value,)
    return log


def server(stream: tuple, msg: Msg, expected_last: int, forgotten: int = 0) -> tuple[tuple, tuple[int, bool] | None]:
    """nats-server's answer to a publish: (new stream, (seq, duplicate)) or (stream, None) if refused."""
    for i, m in enumerate(stream):
        if m.mid == msg.mid and i >= forgotten:
            return stream, (i + 1, True)
    if expected_last != len(stream):
        return stream, None
    return (*stream, msg), (len(stream) + 1, False)


class Model:
    def __init__(self, ids, fence_ids, accept, managers: int = 2, max_writes: int = 3, max_fences: int = 2) -> None:
        self.ids, self.fence_ids, self.accept = ids, fence_ids, accept
        self.n, self.max_writes, self.max_fences = managers, max_writes, max_fences

    def initial(self) -> State:
        return State(mgrs=tuple(Mgr() for _ in range(self.n)))

    def successors(self, s: State):
        if s.forgotten < len(s.stream):                                    # the duplicate window moves on
            yield f"the server forgets id {s.stream[s.forgotten].mid}", replace(s, forgotten=s.forgotten + 1)
        for i, m in enumerate(s.mgrs):
            if m.role == "standby" and m.fences < self.max_fences:        # a takeover begins: read to the end
                seen = max((x.epoch for x in s.stream), default=0)
                yield f"m{i} reads to {len(s.stream)}", self._set(s, i, replace(
                    m, role="reading", epoch=seen + 1, token=f"w{i}.{m.fences}", last=len(s.stream),
                    log=replay(s.stream), fences=m.fences + 1))
            if m.role == "reading" and m.pending is None:                  # ... and fences later
                msg = Msg("fence", m.epoch, len(m.log), (), m.log, self.fence_ids(m.epoch, m.token))
                yield from self._publish(s, i, msg, f"m{i} fences epoch {m.epoch}")
            if m.role == "leader" and m.pending is None and s.writes < self.max_writes:
                pos = len(m.log) + 1
                msg = Msg("entry", m.epoch, pos, (f"m{i}", s.writes), m.log, self.ids(m.epoch, m.token, pos))
                yield from self._publish(replace(s, writes=s.writes + 1), i, msg, f"m{i} appends {pos}")
            if m.pending is not None:                                      # the retry of a lost reply
                yield from self._publish(s, i, m.pending[0], f"m{i} retries {m.pending[0].mid}", retry=True)
            if m.role != "standby":
                yield f"m{i} crashes", self._set(s, i, Mgr(fences=m.fences))

    def _publish(self, s: State, i: int, msg: Msg, what: str, retry: bool = False):
        m = s.mgrs[i]
        expected = m.pending[1] if retry else m.last
        stream, reply = server(s.stream, msg, expected, s.forgotten)
        # the reply is lost: the writer knows nothing and will retry with the same id
        yield what + " (reply lost)", replace(self._set(s, i, replace(m, pending=(msg, expected))), stream=stream)
        if reply is None:
            yield what + ": refused", self._set(s, i, replace(m, role="stopped", pending=None))
            return
        try:
            seq = self.accept(reply[0], reply[1], retry, expected)
        except Fenced:
            yield what + ": not accepted", replace(self._set(s, i, replace(m, role="stopped", pending=None)),
                                                   stream=stream)
            return
        if msg.kind == "fence":
            done = replace(m, role="leader", last=seq, pending=None)
            yield what + f": stored at {seq}", replace(self._set(s, i, done), stream=stream)
        else:
            done = replace(m, last=seq, log=(*m.log, msg.value), pending=None)
            ack = (m.epoch, m.token, i, msg.pos, msg.value)
            yield what + f": acknowledged at {seq}", replace(self._set(s, i, done), stream=stream,
                                                            acks=(*s.acks, ack))

    @staticmethod
    def _set(s: State, i: int, m: Mgr) -> State:
        return replace(s, mgrs=(*s.mgrs[:i], m, *s.mgrs[i + 1:]))

    @staticmethod
    def violation(s: State) -> str | None:
        log = replay(s.stream)
        for epoch, _, i, pos, value in s.acks:
            if pos > len(log) or log[pos - 1] != value:
                return f"m{i}'s acknowledged entry {pos} {value} (epoch {epoch}) is not in the journal {log}"
        applied: tuple = ()
        for m in s.stream:
            if m.kind == "entry" and m.pos == len(applied) + 1:
                if m.basis != applied:
                    return f"entry {m.pos} {m.value} was written on {m.basis}, the journal before it is {applied}"
                applied += (m.value,)
        writers: dict[int, set] = {}
        for epoch, token, *_ in s.acks:
            writers.setdefault(epoch, set()).add(token)
        split = {e: w for e, w in writers.items() if len(w) > 1}
        return f"epoch(s) acknowledged by two writers: {split}" if split else None

    def explore(self) -> tuple[int, list[str] | None]:
        """Breadth-first over every reachable state: (states seen, the shortest trace to a violation or None)."""
        start = self.initial()
        parent: dict[State, tuple[State, str] | None] = {start: None}
        queue = deque([start])
        while queue:
            s = queue.popleft()
            bad = self.violation(s)
            if bad is not None:
                trace = [bad]
                while parent[s] is not None:
                    s, step = parent[s]
                    trace.append(step)
                return len(parent), trace[::-1]
            for step, t in self.successors(s):
                if t not in parent:
                    parent[t] = (s, step)
                    queue.append(t)
        return len(parent), None


def test_the_protocol_never_splits_with_unique_message_ids_and_checked_acks():
    states, trace = Model(new_ids, new_fence_id, new_accept, managers=2, max_writes=2, max_fences=2).explore()
    assert trace is None, "\n".join(trace)
    assert states > 50_000                        # the search really branched (lost replies, crashes, races)


def test_three_managers_never_split_either():
    states, trace = Model(new_ids, new_fence_id, new_accept, managers=3, max_writes=2, max_fences=1).explore()
    assert trace is None, "\n".join(trace)
    assert states > 10_000


def test_the_old_message_ids_split_the_journal():
    """Ids shared by two writers at one epoch, and any "duplicate" taken as success (before issue 20):
    the explorer finds two managers acknowledging under one epoch and an acknowledged entry lost."""
    _, trace = Model(old_ids, old_fence_id, old_accept, managers=2, max_writes=2, max_fences=1).explore()
    assert trace is not None
    assert any("reads to 0" in t for t in trace) and any("fences epoch 1" in t for t in trace)
    assert "not in the journal" in trace[-1] or "two writers" in trace[-1] or "written on" in trace[-1], trace


def test_unique_ids_alone_keep_the_journal_whole():
    """Even taking any "duplicate" as success: with ids unique per writer incarnation a duplicate is always
    the writer's own earlier publish."""
    _, trace = Model(new_ids, new_fence_id, old_accept, managers=2, max_writes=2, max_fences=2).explore()
    assert trace is None, "\n".join(trace)


def test_checked_acks_alone_do_not_save_shared_ids():
    """check_ack alone is not enough: a writer whose fence reply was lost retries, and the server answers its
    retry with the *other* writer's fence (same id), right after the expected sequence. The id rule is what
    makes two writers impossible; check_ack is the second line."""
    _, trace = Model(old_ids, old_fence_id, new_accept, managers=2, max_writes=2, max_fences=2).explore()
    assert trace is not None and any("(reply lost)" in t for t in trace)
    assert "not in the journal" in trace[-1] or "two writers" in trace[-1] or "written on" in trace[-1], trace


def test_the_ack_check_refuses_a_foreign_duplicate_and_a_gap():
    assert check_ack(8, False, False, 7) == 8
    assert check_ack(8, True, True, 7) == 8         # our own retry, stored the first time
    with pytest.raises(Fenced, match="another writer used this message id"):
        check_ack(8, True, False, 7)
    with pytest.raises(Fenced, match="not right after 6"):
        check_ack(8, False, False, 6)
    assert message_id(3, "ab", 9, 1) != message_id(3, "cd", 9, 1) and fence_id(3, "ab") != fence_id(3, "cd")
