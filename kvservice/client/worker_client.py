"""Client of one Worker: kernels on a remote KV cache, NumPy in and out.

Errors come back as ClientError whose message names the worker (id and
address), so a scheduler knows which shard failed: a killed worker is
UNAVAILABLE "worker w1 at 127.0.0.1:5001 is unreachable: ...".

Deadlines: ``timeout`` is the deadline of each call, as gRPC means it. The channel's service config
(kvservice/client/deadline.py) lets gRPC resend, within that deadline, the calls that change nothing
(Info, DecodeAttention, ValidatePageTable, CheckGuards) after UNAVAILABLE; a call that writes the cache
or the worker's tables is sent once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvservice.client.client import TLSOptions, auth_metadata, make_channel
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.contract.pagetable import PageTable
from kvservice.contract.transport import EPOCH_METADATA
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

POLICIES = {"nan": wpb.POLICY_NAN, "zeros": wpb.POLICY_ZEROS, "error": wpb.POLICY_ERROR}
SERVICE = wpb.DESCRIPTOR.services_by_name["Worker"]
#: Worker calls gRPC may resend after UNAVAILABLE: those that change nothing on the worker.
RESENDABLE = frozenset({"Info", "DecodeAttention", "ValidatePageTable", "CheckGuards"})


@dataclass(frozen=True, slots=True)
class Attention:
    """out: float32 [B, q_heads, head_dim]; lse: float32 [B, q_heads]; violation of this call."""

    out: np.ndarray
    lse: np.ndarray
    violation: wpb.ViolationRecord


def _cache_tensor(a: np.ndarray, dtype: str | None) -> cpb.Tensor:
    """dtype None: the array's own (float16/float32); "bfloat16": a holds raw uint16 bit patterns."""
    if dtype == "bfloat16":
        return to_tensor(np.ascontiguousarray(a).view(np.uint16), cpb.BFLOAT16)
    return to_tensor(np.ascontiguousarray(a, dtype=dtype))


class WorkerClient:
    """Talks to one worker. timeout: the deadline of each call, seconds; only calls that change nothing are
    resent within it (RESENDABLE).

    tls / token: for a worker started with --tls-* / --tokens-file (the shipped manifests need a
    token). pool_incarnation: sent with every kernel call (PoolInfo.incarnation or
    StepReply.pool_incarnation); a worker planned for another incarnation of its pool refuses the
    call FAILED_PRECONDITION (reason STALE_INCARNATION). 0 = not checked.

    leader_epoch: with a replicated manager (docs/HA.md), the leader epoch the call's tables come
    from, sent as the metadata ``kvservice-leader-epoch`` with every call that carries slots or
    tables: an int, or a callable read at each call (``lambda: leader_client.epoch``, the highest
    epoch a kvservice.client.ha.LeaderClient has seen). A worker that has seen a higher epoch refuses the
    call FAILED_PRECONDITION (reason STALE_LEADER_EPOCH); one of a replicated manager refuses a call
    without it (LEADER_EPOCH_REQUIRED). 0 = none sent (an unreplicated manager).
    """

    def __init__(self, address: str, worker_id: str = "", timeout: float = 30.0, *, tls: TLSOptions | None = None,
                 token: str | None = None, pool_incarnation: int = 0,
                 leader_epoch: int | Callable[[], int] = 0) -> None:
        self.address = address
        self.leader_epoch = leader_epoch
        self.worker_id = worker_id or address
        self.timeout = timeout
        self.pool_incarnation = pool_incarnation
        self._metadata = auth_metadata(token)
        self._channel = make_channel(address, tls, RetryPolicy().service_config(SERVICE, RESENDABLE))
        self._stub = wpb_grpc.WorkerStub(self._channel)

    def __repr__(self) -> str:
        return f"WorkerClient({self.address!r}, token={'set' if self._metadata else 'none'})"

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            if hasattr(request, "pool_incarnation"):
                request.pool_incarnation = self.pool_incarnation
            epoch = self.leader_epoch() if callable(self.leader_epoch) else self.leader_epoch
            metadata = (*(self._metadata or ()), (EPOCH_METADATA, str(epoch))) if epoch else self._metadata
            return method(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            err = ClientError.from_rpc(exc)
            what = {grpc.StatusCode.UNAVAILABLE: "is unreachable",
                    grpc.StatusCode.DEADLINE_EXCEEDED: f"did not answer within the {self.timeout:g} s deadline"}.get(
                err.code, "refused the call")
            raise ClientError(err.code, f"worker {self.worker_id} at {self.address} {what}: {err.message}",
                              err.reason, err.metadata) from None

    def info(self) -> wpb.WorkerStatus:
        return self._call(self._stub.Info, wpb.WorkerInfoRequest())

    def append_kv(self, layer: int, k: np.ndarray, v: np.ndarray | None, slot_mapping: np.ndarray | None = None,
                  dtype: str | None = None, policy: str = "nan", table_id: str = "",
                  slot_generations: np.ndarray | None = None) -> wpb.KernelReply:
        """k, v: [n, kv_heads, head_dim] in the cache dtype (v None for a K-only layer: an MLA layer's
        latents, [n, 1, kv_lora_rank + qk_rope_head_dim], go in k); slot_mapping: int64 [n] of the layer's
        index space, or None with table_id: the new tokens of the worker's persistent tables (update_tables).

        slot_generations: uint32 [n] (SpaceTables.slot_generations of the same reply): the worker records each
        page's generation and refuses stale writes (stale_page); None = not checked. With table_id they come
        from the table. dtype: None sends the arrays' own dtype; "bfloat16" sends uint16 arrays as bfloat16 bits.
        """
        req = wpb.AppendKVRequest(layer=layer, k=_cache_tensor(k, dtype), policy=POLICIES[policy],
                                  table_id=table_id)
        if v is not None:
            req.v.CopyFrom(_cache_tensor(v, dtype))
        if slot_mapping is not None:
            req.slot_mapping.CopyFrom(to_tensor(np.asarray(slot_mapping, dtype=np.int64)))
        if slot_generations is not None:
            req.slot_generations.CopyFrom(to_tensor(np.asarray(slot_generations, dtype=np.uint32)))
        return self._call(self._stub.AppendKV, req)

    def decode_attention(self, layer: int, q: np.ndarray, table: PageTable | None = None, dtype: str | None = None,
                         sm_scale: float = 0.0, policy: str = "nan", table_id: str = "",
                         generations: np.ndarray | None = None) -> Attention:
        """q: [B, q_heads, head_dim] in the cache dtype; table: CSR of the layer's index space (int32), or None
        with table_id: the batch of the worker's persistent tables (update_tables).

        generations: uint32 [nnz] (SpaceTables.generations): each page is read only if the worker wrote it
        under that generation (else stale_page); None = not checked. With table_id they come from the table."""
        req = wpb.DecodeAttentionRequest(layer=layer, q=_cache_tensor(q, dtype), sm_scale=sm_scale,
                                         policy=POLICIES[policy], table_id=table_id)
        if table is not None:
            req.indptr.CopyFrom(to_tensor(np.asarray(table.indptr, dtype=np.int32)))
            req.indices.CopyFrom(to_tensor(np.asarray(table.indices, dtype=np.int32)))
            req.last_page_len.CopyFrom(to_tensor(np.asarray(table.last_page_len, dtype=np.int32)))
        if generations is not None:
            req.generations.CopyFrom(to_tensor(np.asarray(generations, dtype=np.uint32)))
        reply = self._call(self._stub.DecodeAttention, req)
        return Attention(from_tensor(reply.out, "out", "f"), from_tensor(reply.lse, "lse", "f"), reply.violation)

    def update_tables(self, table_id: str, reply: pb.StepReply, replace: bool = False) -> wpb.UpdateTablesReply:
        """Apply a StepStream reply (full, or incremental on the copy's last one) to the persistent tables
        `table_id` (in this client's token's namespace) on the worker's device. replace: a full reply of another
        stream takes the table over (else STALE_TABLE)."""
        return self._call(self._stub.UpdateTables,
                          wpb.UpdateTablesRequest(table_id=table_id, step=reply, replace=replace))

    def copy_blocks(self, group: int, pairs: np.ndarray, policy: str = "nan",
                    generations: np.ndarray | None = None) -> wpb.KernelReply:
        """pairs: int64 [n, 2] of (src_slot, dst_slot); generations: uint32 [n, 2] (StepResult.copy_generations):
        checked and recorded by the worker (a later write or read of dst through a table needs them)."""
        req = wpb.CopyBlocksRequest(group=group, pairs=to_tensor(np.asarray(pairs, dtype=np.int64).reshape(-1, 2)),
                                    policy=POLICIES[policy])
        if generations is not None:
            req.generations.CopyFrom(to_tensor(np.asarray(generations, dtype=np.uint32).reshape(-1, 2)))
        return self._call(self._stub.CopyBlocks, req)

    def validate(self, layer: int, table: PageTable, generations: np.ndarray | None = None) -> wpb.WorkerValidateReply:
        req = wpb.WorkerValidateRequest(
            layer=layer, indptr=to_tensor(np.asarray(table.indptr, dtype=np.int32)),
            indices=to_tensor(np.asarray(table.indices, dtype=np.int32)),
            last_page_len=to_tensor(np.asarray(table.last_page_len, dtype=np.int32)))
        if generations is not None:
            req.generations.CopyFrom(to_tensor(np.asarray(generations, dtype=np.uint32)))
        return self._call(self._stub.ValidatePageTable, req)

    def check_guards(self) -> wpb.CheckGuardsReply:
        return self._call(self._stub.CheckGuards, wpb.CheckGuardsRequest())

    def corrupt_guard(self, buffer: str, after: bool = False, offset: int = 0) -> None:
        """Test hook: flip one canary byte (the worker must run with --enable-test-hooks)."""
        self._call(self._stub.CorruptGuard, wpb.CorruptGuardRequest(buffer=buffer, after=after, offset=offset))
