"""What the journal records (the mutating methods) and how (JournalConfig: fsync, compaction, idempotency window)."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from kvservice.contract.errors import InvalidArgument
from kvservice.v1 import block_manager_pb2 as pb

SYNC_MODES = ("full", "normal")
#: The mutating methods the journal records, their request and reply messages.
REQUESTS: dict[str, type[Message]] = {"CreatePool": pb.CreatePoolRequest, "DeletePool": pb.DeletePoolRequest,
                                      "Step": pb.StepRequest, "RegisterWorker": pb.RegisterWorkerRequest}
REPLIES: dict[str, type[Message]] = {"CreatePool": pb.PoolInfo, "DeletePool": pb.DeletePoolReply,
                                     "Step": pb.StepReply, "RegisterWorker": pb.RegisterWorkerReply}
METHODS = list(REQUESTS)


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """Knobs of the journal.

    sync: SQLite `synchronous` in WAL mode. "full" fsyncs every commit (survives power loss);
        "normal" survives a process crash (kill -9) but may lose the last commits on an OS crash.
    compact_every: the most entries (acknowledged mutating RPCs) a recovery replays: a snapshot is
        captured once the tail after the newest *stored* snapshot reaches ``snapshot_due_tail`` (3/4 of
        it), so the last quarter is room for that snapshot to be written while calls go on.
    compact_bytes: serialized request bytes between snapshots (the other bound).
    id_window: request ids remembered for idempotency (most recent).
    id_window_seconds: ... and for at most this long, seconds.
    reply_cache_bytes: serialized bytes of replies kept for retries (most recent first kept).
    snapshot_replies: replies written into each snapshot (the most recent ones).
    replay_replies: Step replies a recovery rebuilds: those of the last this many entries it replays (at most
        ``reply_cache_bytes`` of their requests); the earlier Steps are replayed without tables or reply (their
        ids stay in the window: a retry of one is refused REQUEST_ALREADY_APPLIED, never applied twice).
    background_snapshots: encode and write compaction snapshots on a thread (False: inline, tests).
    """

    sync: str = "full"
    compact_every: int = 10_000
    compact_bytes: int = 256 << 20
    id_window: int = 100_000
    id_window_seconds: float = 600.0
    reply_cache_bytes: int = 64 << 20
    snapshot_replies: int = 256
    replay_replies: int = 1024
    background_snapshots: bool = True

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise InvalidArgument(f"sync must be one of {', '.join(SYNC_MODES)}, got {self.sync!r}")
        if self.compact_every < 1 or self.id_window < 1:
            raise InvalidArgument("compact_every and id_window must be >= 1")
        if self.replay_replies < 0 or self.snapshot_replies < 0:
            raise InvalidArgument(f"replay_replies and snapshot_replies must be >= 0, got {self.replay_replies} "
                                  f"and {self.snapshot_replies}")

    @property
    def snapshot_due_tail(self) -> int:
        """Entries after the newest stored snapshot at which the next one is captured (see compact_every)."""
        return max(1, self.compact_every - self.compact_every // 4)


# ---- idempotency ---------------------------------------------------------------------------------------
