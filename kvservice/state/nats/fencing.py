"""The writer identity in every journal message, and what a publish acknowledgement must say.

Message ids are unique per writer incarnation (epoch, random writer token drawn at each fence), so
JetStream's duplicate detection can only ever match a writer's own retry; an acknowledgement counts
only if it puts the message right after the sequence the writer expected. docs/HA.md gives the
safety argument these serve; tests/unit/test_ha_model.py checks them in a model of two writers.
"""

from __future__ import annotations

from kvservice.state.nats.config import Fenced


def message_id(epoch: int, writer: str, seq: int, part: int) -> str:
    """Nats-Msg-Id of part `part` of journal entry `seq`, written by the writer incarnation (epoch, writer).

    writer: the random token a store draws each time it fences (``NatsStore.fence``). A retried
    publish keeps its id (the server answers "duplicate" with the first copy's sequence instead of
    storing it twice); two writers never share one, even at the same epoch and position.
    """
    return f"{epoch}.{writer}.{seq}.{part}"


def fence_id(epoch: int, writer: str) -> str:
    """Nats-Msg-Id of the fence that starts writer incarnation (epoch, writer)."""
    return f"fence.{epoch}.{writer}"


def check_ack(seq: int, duplicate: bool, sent_before: bool, expected_last: int) -> int:
    """The stream sequence a publish acknowledgement confirms for this writer, else Fenced.

    seq, duplicate: the server's answer; sent_before: this very message (same id) was sent by this
    writer before (a retry); expected_last: the Nats-Expected-Last-Sequence it carried. "duplicate"
    is success only for a retry: the id is this writer's own, so the stored copy is its own earlier
    publish. Either way the message must sit right after expected_last: the server checked that
    before storing it (a server that did not would be caught here, not trusted).
    """
    if duplicate and not sent_before:
        raise Fenced(f"NATS answered a first publish as a duplicate of stream message {seq}: another writer used "
                     "this message id; this manager does not count it as written")
    if seq != expected_last + 1:
        raise Fenced(f"NATS stored the journal message at stream sequence {seq}, not right after {expected_last}: "
                     "another writer appended in between")
    return seq
