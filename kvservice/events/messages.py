"""Proto side of WatchEvents: KV event batches as messages and back (ScorePrefix's is manager/routing.py).

No gRPC here: messages in, domain calls, messages out (the servicer streams them).
"""

from __future__ import annotations

from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.core.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, event_pages
from kvservice.manager.event_log import LoggedBatch
from kvservice.v1 import block_manager_pb2 as pb

#: Pages per WatchEvents message: a reset of a big cache is split into messages of the same sequence.
MESSAGE_PAGES = 16_384


def event_to_proto(e: object) -> pb.KVEvent:
    if isinstance(e, BlockStored):
        return pb.KVEvent(block_stored=pb.BlockStored(
            block_hashes=to_tensor(e.block_hashes), parent_block_hash=e.parent_block_hash,
            token_ids=to_tensor(e.token_ids), block_size=e.block_size, group_idx=e.group,
            kv_cache_spec_kind=e.kind, kv_cache_spec_sliding_window=e.sliding_window,
            extra_keys=[pb.BlockExtraKeys(keys=list(k)) for k in e.extra_keys or ()]))
    if isinstance(e, BlockRemoved):
        return pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=to_tensor(e.block_hashes), group_idx=e.group))
    assert isinstance(e, AllBlocksCleared), f"unknown event {type(e).__name__}"
    return pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared())


def batch_to_protos(lb: LoggedBatch) -> list[pb.KVEventBatch]:
    """One batch as one message, or several of the same sequence (`more` on all but the last) when big."""
    b = lb.batch
    reason = str(lb.encoded.get("reset_reason", ""))
    out, chunk, pages = [], [], 0
    for e in b.events:
        n = event_pages(e)
        if chunk and pages + n > MESSAGE_PAGES:
            out.append(chunk)
            chunk, pages = [], 0
        chunk.append(e)
        pages += n
    out.append(chunk)
    return [pb.KVEventBatch(sequence=b.seq, timestamp=lb.ts, events=[event_to_proto(e) for e in part],
                            reset=b.reset, more=i + 1 < len(out), reset_reason=reason)
            for i, part in enumerate(out)]


def proto_to_events(msg: pb.KVEventBatch) -> list[object]:
    """A received batch's events as domain events (clients and tests)."""
    out: list[object] = []
    for ev in msg.events:
        kind = ev.WhichOneof("event")
        if kind == "block_stored":
            s = ev.block_stored
            out.append(BlockStored(s.group_idx, from_tensor(s.block_hashes, "block_hashes"), s.parent_block_hash,
                                   from_tensor(s.token_ids, "token_ids"), s.block_size, s.kv_cache_spec_kind,
                                   s.kv_cache_spec_sliding_window,
                                   tuple(tuple(k.keys) for k in s.extra_keys) or None))
        elif kind == "block_removed":
            r = ev.block_removed
            out.append(BlockRemoved(r.group_idx, from_tensor(r.block_hashes, "block_hashes")))
        else:
            out.append(AllBlocksCleared())
    return out
