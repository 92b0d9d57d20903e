"""Proto side of the router-facing RPCs: KV event batches (WatchEvents) and prefix scores (ScorePrefix).

No gRPC here: messages in, domain calls, messages out (the servicer streams them).
"""

from __future__ import annotations

import numpy as np

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.core.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, event_pages
from kvservice.events.hub import LoggedBatch
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import MAX_SCORE_TOKENS
from kvservice.manager.routing import score_prefix as _score
from kvservice.v1 import block_manager_pb2 as pb

#: Pages per WatchEvents message: a reset of a big cache is split into messages of the same sequence.
MESSAGE_PAGES = 16_384
_ITEMSIZE = {10: 4, 11: 8}          # INT32, INT64


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


def score_prefix(manager: BlockManager, request: pb.ScorePrefixRequest) -> pb.ScorePrefixReply:
    """ScorePrefix: decode (size checked before decoding), score, encode."""
    if not request.HasField("token_ids"):
        raise InvalidArgument("token_ids is required: the prompt's token ids, INT32 or INT64")
    t = request.token_ids
    if t.dtype not in _ITEMSIZE:
        raise InvalidArgument("token_ids must be INT32 or INT64")
    if len(t.data) // _ITEMSIZE[t.dtype] > MAX_SCORE_TOKENS:
        raise InvalidArgument(f"token_ids has {len(t.data) // _ITEMSIZE[t.dtype]} tokens; ScorePrefix takes at most "
                              f"{MAX_SCORE_TOKENS}", reason="LIMIT_EXCEEDED", limit=MAX_SCORE_TOKENS)
    tok = from_tensor(t, "token_ids")
    if tok.ndim != 1:
        raise InvalidArgument(f"token_ids must be 1-D, got shape {list(tok.shape)}")
    scores = _score(manager, np.asarray(tok), request.cache_salt, request.extra_key, list(request.pools),
                    request.model)
    return pb.ScorePrefixReply(num_tokens=len(tok), scores=[
        pb.PrefixScore(pool=s.pool, cached_tokens=s.cached_tokens, cached_pages=s.cached_pages, page_size=s.page_size,
                       prefix_caching=s.prefix_caching, worker_ids=[w for w, _ in s.workers],
                       worker_addresses=[a for _, a in s.workers]) for s in scores])
