"""Journal positions seen by a client: a manager whose state was rolled back is refused, never believed.

Replies of mutating calls and of state reads carry the manager's journal position: (lineage,
incarnation, seq). Positions of one lineage (one history of acknowledged changes, docs/DURABILITY.md)
only grow; a manager that answers in a lineage with a seq below one this client had already seen
before it sent the call came back behind what it acknowledged (a restored backup, a write-ahead log
that lost its tail, a replicated journal that lost entries). Its state contradicts replies the
client already acted on, so the reply is refused: :class:`StateRolledBack` (DATA_LOSS, reason
``STATE_ROLLED_BACK``), counted, and every later reply of that lineage is refused too until the
scheduler has resynchronised and calls ``reset()`` (a lineage that went back cannot be trusted when
it moves forward again: its new positions name other changes than the ones the client saw).

A reply of a lineage not seen before is accepted and reported (counted, logged): the manager's state
starts from nothing or could not be proved to continue the old history (docs/DURABILITY.md), so
positions of different lineages are never compared. Equal positions are fine (a retried request,
a read with nothing committed in between).

Positions are only ever learned from replies of the manager this client called: no request field
or metadata carries one, so nobody else (another tenant) can raise what a client remembers.
The tracker keeps at most MAX_LINEAGES lineages (oldest forgotten first), whatever a manager sends.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import grpc

from kvservice.client.codec import ClientError

log = logging.getLogger("kvservice.client")
#: Lineages a tracker remembers (a client meets one per manager state it talks to; more only by churn).
MAX_LINEAGES = 16
_EMPTY: Mapping[int, int] = MappingProxyType({})


class JournalPos(NamedTuple):
    """A reply's journal position: lineage (0 = a manager from before lineages), start count, acknowledged changes."""

    lineage: int
    incarnation: int
    seq: int


def journal_position(reply: object) -> JournalPos | None:
    """The journal position a reply carries, None if its message has none or it is not set."""
    fields = reply.DESCRIPTOR.fields_by_name                                                   # type: ignore[attr-defined]
    if "position" not in fields or not reply.HasField("position"):                            # type: ignore[attr-defined]
        return None
    p = reply.position                                                                         # type: ignore[attr-defined]
    return JournalPos(int(p.lineage), int(p.incarnation), int(p.seq))


class StateRolledBack(ClientError):
    """A reply from a manager whose state is behind what this client already saw in the same lineage.

    reply: the refused reply (what that manager did is in it; do not act on it). seen: the highest seq of
    that lineage this client had seen before the call (-1 if the lineage was refused earlier); got: the
    reply's position. metadata: lineage, seen_seq, seq, incarnation, rollbacks (this client's count so far).
    """

    def __init__(self, name: str, got: JournalPos, seen: int, reply: Any, request_id: str | None,
                 rollbacks: int) -> None:
        lin = f"{got.lineage:016x}"
        if seen >= 0:
            what = (f"{name}: the manager answered at journal position {got.seq} of state lineage {lin} (incarnation "
                    f"{got.incarnation}), but this client had already seen position {seen} of that lineage: the "
                    "manager's state was rolled back and lost changes it had acknowledged (a restored backup, a "
                    "journal that lost its tail)")
        else:
            what = (f"{name}: the manager answered at journal position {got.seq} of state lineage {lin}, a lineage "
                    "this client already found rolled back")
        super().__init__(grpc.StatusCode.DATA_LOSS,
                         f"{what}. Its state contradicts replies this client acted on: do not use it. Check the "
                         "manager (`kvservice check-state`, docs/DURABILITY.md); once the scheduler has "
                         "resynchronised with the manager's present state, call reset_position() to accept it. "
                         "Until then every reply of this lineage is refused",
                         "STATE_ROLLED_BACK",
                         {"lineage": lin, "seen_seq": str(seen), "seq": str(got.seq),
                          "incarnation": str(got.incarnation), "rollbacks": str(rollbacks)}, request_id)
        self.reply = reply
        self.seen = seen
        self.got = got


class PositionTracker:
    """The highest journal position this client saw, per lineage (thread-safe; one per client).

    Use: ``seen = tracker.seen()`` before sending a call, ``tracker.check(name, reply, seen, request_id)`` on
    its reply (raises StateRolledBack). lineage / incarnation / seq: the position last recorded.
    rollbacks: replies refused so far; lineage_changes: lineages met after the first one.
    on_rollback(err) / on_new_lineage(old, new): hooks (metrics), called outside the lock.
    """

    def __init__(self, on_rollback: Callable[[StateRolledBack], None] | None = None,
                 on_new_lineage: Callable[[int, int], None] | None = None) -> None:
        self.on_rollback = on_rollback
        self.on_new_lineage = on_new_lineage
        self._lock = threading.Lock()
        self.rollbacks = self.lineage_changes = 0
        self._seen: Mapping[int, int] = _EMPTY         # lineage -> highest seq; replaced, never mutated
        self._refused: dict[int, int] = {}              # lineage -> the seq seen when it went back
        self.lineage = self.incarnation = self.seq = 0

    def reset(self) -> None:
        """Forget every position and refusal (after the scheduler resynchronised with the manager)."""
        with self._lock:
            self._seen = _EMPTY
            self._refused = {}
            self.lineage = self.incarnation = self.seq = 0

    def seen(self) -> Mapping[int, int]:
        """What was seen so far (lineage -> highest seq): take it before sending a call, pass it to check()."""
        return self._seen

    def check(self, name: str, reply: Any, seen_before: Mapping[int, int], request_id: str | None) -> None:
        """Record a reply's position; StateRolledBack if its lineage went below what was seen before the call."""
        pos = journal_position(reply)
        if pos is None:
            return
        err: StateRolledBack | None = None
        new_from: int | None = None
        with self._lock:
            before = seen_before.get(pos.lineage)
            if pos.lineage in self._refused:
                self.rollbacks += 1
                err = StateRolledBack(name, pos, -1, reply, request_id, self.rollbacks)
            elif before is not None and pos.seq < before:
                self.rollbacks += 1
                self._refused[pos.lineage] = before
                while len(self._refused) > MAX_LINEAGES:
                    del self._refused[next(iter(self._refused))]
                err = StateRolledBack(name, pos, before, reply, request_id, self.rollbacks)
            else:
                top = self._seen.get(pos.lineage)
                if top is None:
                    if self._seen or self.lineage:
                        self.lineage_changes += 1
                        new_from = self.lineage
                    kept = dict(list(self._seen.items())[-(MAX_LINEAGES - 1):])
                    kept[pos.lineage] = pos.seq
                    self._seen = MappingProxyType(kept)
                elif pos.seq > top:
                    self._seen = MappingProxyType({**self._seen, pos.lineage: pos.seq})
                if top is None or pos.seq >= top:
                    self.lineage, self.incarnation, self.seq = pos
        if err is not None:
            log.error("%s", err.message)
            if self.on_rollback is not None:
                self.on_rollback(err)
            raise err
        if new_from is not None:
            log.warning("%s: the manager's state is of lineage %016x, not %016x seen before: a state that does not "
                        "continue the history this client saw (started from nothing, or repaired); positions "
                        "start over", name, pos.lineage, new_from)
            if self.on_new_lineage is not None:
                self.on_new_lineage(new_from, pos.lineage)


class ClientMetrics:
    """Counters a client exports through a prometheus_client registry (one set per registry, shared by its
    clients): kvservice_client_state_rollbacks_total and kvservice_client_lineage_changes_total."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[Any, ClientMetrics]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter
        self.rollbacks = Counter("kvservice_client_state_rollbacks_total",
                                 "Manager replies refused because the manager's state was behind what this process "
                                 "had already seen in the same lineage (STATE_ROLLED_BACK).", registry=registry)
        self.lineage_changes = Counter("kvservice_client_lineage_changes_total",
                                       "Manager replies of a state lineage this process had not seen before (state "
                                       "that started from nothing or was repaired).", registry=registry)

    @classmethod
    def of(cls, registry: Any) -> ClientMetrics:
        """The counters of `registry` (registered on first use)."""
        with cls._lock:
            got = cls._by_registry.get(registry)
            if got is None:
                got = cls._by_registry[registry] = cls(registry)
            return got

    def attach(self, tracker: PositionTracker) -> None:
        tracker.on_rollback = lambda _err: self.rollbacks.inc()
        tracker.on_new_lineage = lambda _old, _new: self.lineage_changes.inc()


__all__ = ["MAX_LINEAGES", "ClientMetrics", "JournalPos", "PositionTracker", "StateRolledBack", "journal_position"]
