"""The idempotency window: a retried request_id answered with the original reply, a reused one refused.

Kept in the journal's snapshots (WindowState) so that a retry after a restart is recognised too.
"""

from __future__ import annotations

from collections import OrderedDict

from google.protobuf.message import DecodeError, Message

from kvservice.contract.errors import AlreadyExists, InvalidArgument, StateError
from kvservice.state import snapshot as snap
from kvservice.state.journal_config import REPLIES, JournalConfig


class IdempotencyWindow:
    """request_id -> (method, digest, journal seq, wall time) for the last N ids / T seconds, and recent replies.

    A retry of a known id gets its stored reply; an id whose reply was dropped from the
    (byte-bounded) cache is refused ALREADY_EXISTS (reason REQUEST_ALREADY_APPLIED), never applied twice.
    """

    def __init__(self, config: JournalConfig) -> None:
        self.config = config
        self.ids: OrderedDict[str, tuple[str, bytes, int, float]] = OrderedDict()
        self.replies: OrderedDict[str, tuple[Message, int]] = OrderedDict()
        self.reply_bytes = 0
        self.hits = 0

    def lookup(self, rid: str, method: str, fingerprint: bytes) -> Message | None:
        """The stored reply of a retried request, None for a new id; KVError for a reused or expired id."""
        known = self.ids.get(rid)
        if known is None:
            return None
        k_method, k_digest, _, _ = known    # no error names the earlier request's position: it may be another tenant's
        if k_method != method or k_digest != fingerprint:
            raise InvalidArgument(f"request_id {rid!r} was already used by a different {k_method} request; use a "
                                  "fresh id per request", reason="REQUEST_ID_REUSED", request_id=rid)
        stored = self.replies.get(rid)
        if stored is None:
            raise AlreadyExists(f"{method} {rid!r} was already applied; its reply is no longer kept (the reply "
                                f"cache keeps {self.config.reply_cache_bytes} bytes; a restart rebuilds the replies "
                                f"of the last {self.config.replay_replies} Steps)", reason="REQUEST_ALREADY_APPLIED",
                                request_id=rid)
        self.hits += 1
        return stored[0]

    def remember(self, rid: str, method: str, fingerprint: bytes, seq: int, at: float, reply: Message | None) -> None:
        """Record an applied request (at: wall-clock seconds) and keep its reply while the byte budget allows."""
        self.ids[rid] = (method, fingerprint, seq, at)
        if reply is not None:
            size = reply.ByteSize()
            self.replies[rid] = (reply, size)
            self.reply_bytes += size
        self.evict(at)

    def evict(self, now: float) -> None:
        c = self.config
        oldest = now - c.id_window_seconds
        while self.ids and (len(self.ids) > c.id_window or next(iter(self.ids.values()))[3] < oldest):
            rid, _ = self.ids.popitem(last=False)
            self._drop_reply(rid)
        while self.replies and self.reply_bytes > c.reply_cache_bytes:
            self._drop_reply(next(iter(self.replies)))

    def _drop_reply(self, rid: str) -> None:
        stored = self.replies.pop(rid, None)
        if stored is not None:
            self.reply_bytes -= stored[1]

    def capture(self) -> tuple[list[tuple[str, str, bytes, int, float]], list[tuple[str, str, Message]]]:
        """Every id and the most recent `snapshot_replies` replies (cheap: the journal lock is held)."""
        ids = [(rid, m, d, s, t) for rid, (m, d, s, t) in self.ids.items()]
        n = self.config.snapshot_replies
        recent = list(self.replies.items())[-n:] if n else []
        return ids, [(rid, self.ids[rid][0], msg) for rid, (msg, _) in recent]

    def load(self, state: snap.WindowState) -> None:
        self.ids = OrderedDict((rid, (m, d, s, t)) for rid, m, d, s, t in state.ids)
        for rid, method, data in state.replies:
            try:
                msg = REPLIES[method].FromString(data)
            except (KeyError, DecodeError) as err:
                raise StateError(f"snapshot: stored reply of {rid!r} cannot be read ({err})") from None
            self.replies[rid] = (msg, len(data))
            self.reply_bytes += len(data)


# ---- which pool an uncommitted change touches ------------------------------------------------------------
