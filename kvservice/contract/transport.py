"""What the manager, the worker and their clients agree on below the messages: size limit, metadata keys.

The one way a kvservice gRPC server is built lives beside it, in kvservice/contract/serving.py (clients need
none of it).
"""

from __future__ import annotations

from kvservice.contract.errors import ResourceExhausted

#: Largest request or reply, bytes. A Step for 4096 sequences of 128k tokens carries
#: ~32M int32 indices per index space; raise it for bigger batches.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Call metadata naming a StepStream (1-64 characters); a stream resumed under the same id continues it.
STREAM_ID_KEY = "kvservice-stream-id"
#: Call metadata carrying a replicated manager's leader epoch (replies from the leader; kernel calls to workers).
EPOCH_METADATA = "kvservice-leader-epoch"
#: ... and the node id (--node-id) of the process that answered (clients and fault tests record who acknowledged).
NODE_METADATA = "kvservice-leader-node"


def check_reply_bytes(nbytes: int, limit: int, what: str, advice: str) -> None:
    """ResourceExhausted (REPLY_TOO_LARGE) if a reply of nbytes would pass the message limit (0 = none),
    raised before the work that would build it."""
    if limit and nbytes > limit:
        raise ResourceExhausted(f"the reply to {what} would take {nbytes} bytes, more than the message limit of "
                                f"{limit} bytes; {advice}", reason="REPLY_TOO_LARGE", reply_bytes=nbytes, limit=limit)
