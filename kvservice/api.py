"""The BlockManager API as plain methods (proto in, domain call, proto out). No gRPC here."""

from __future__ import annotations

import logging

from . import convert
from .errors import InvalidArgument
from .manager import BlockManager
from .pagetable import PageTable, validate_page_table
from .planner import plan
from .pool import Pool, StepResult
from .v1 import block_manager_pb2 as pb
from .wire import field_array, fill_tensor, to_tensor

log = logging.getLogger("kvservice")
STEP_ARRAYS = ("free_seq_ids", "extend_seq_ids", "extend_num_tokens", "admit_seq_ids", "admit_num_tokens",
               "fork_parent_ids", "fork_child_ids", "admit_token_ids")


def step_kwargs(request: pb.StepRequest) -> dict[str, object]:
    """Pool.step keyword arguments of a StepRequest (arrays decoded; the pool checks them)."""
    a = {f: field_array(request, f) if request.HasField(f) else None for f in STEP_ARRAYS}
    return {"free_ids": a["free_seq_ids"], "extend_ids": a["extend_seq_ids"], "extend_tokens": a["extend_num_tokens"],
            "admit_ids": a["admit_seq_ids"], "admit_tokens": a["admit_num_tokens"], "tables": not request.omit_tables,
            "block_table": request.include_block_table, "fork_parents": a["fork_parent_ids"],
            "fork_children": a["fork_child_ids"], "admit_token_ids": a["admit_token_ids"],
            "admit_salts": list(request.admit_cache_salts) or None,
            "admit_extra_keys": list(request.admit_extra_keys) or None}


def step_reply(pool: Pool, res: StepResult, tables: bool = True) -> pb.StepReply:
    """The StepReply of a step's result; tables=False leaves out every SpaceTables (a caller adds its own)."""
    reply = pb.StepReply(layer_index_space=pool.layer_space, num_free_slots=res.num_free_slots)
    fill_tensor(reply.seq_ids, res.seq_ids)
    fill_tensor(reply.num_tokens, res.num_tokens)
    fill_tensor(reply.new_token_indptr, res.new_token_indptr)
    if res.cached_tokens is not None:
        reply.admit_cached_tokens.CopyFrom(to_tensor(res.cached_tokens))
    for g, pairs in enumerate(res.copies):
        if len(pairs):
            reply.copies.add(group=g, pairs=to_tensor(pairs))
    if not tables:
        return reply
    for st in res.tables:
        sp = st.space
        out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound)
        fill_tensor(out.slot_mapping, st.slot_mapping)
        if st.table is not None:
            fill_tensor(out.indptr, st.table.indptr)
            fill_tensor(out.indices, st.table.indices)
            fill_tensor(out.last_page_len, st.table.last_page_len)
        if st.block_table is not None:
            fill_tensor(out.block_table, st.block_table)
    return reply


class ManagerAPI:
    """Every BlockManager RPC as a plain method: request message in, reply message out.

    Raises KVError subclasses for callers' mistakes; knows nothing of gRPC, so the
    journal can replay requests through it and tests can call it directly.
    """

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def Plan(self, request: pb.PlanRequest) -> pb.PlanReply:
        spec = convert.cache_spec_from_proto(request.cache)
        return convert.plan_to_proto(plan(spec, convert.sizing_from_proto(request.sizing), tuple(request.backends)))

    def CreatePool(self, request: pb.CreatePoolRequest) -> pb.PoolInfo:
        spec = convert.cache_spec_from_proto(request.cache)
        self.manager.create_pool(request.name, spec, convert.sizing_from_proto(request.sizing),
                                 tuple(request.backends), request.enable_prefix_caching)
        with self.manager.locked(request.name) as pool:
            return convert.pool_info(pool)

    def GetPool(self, request: pb.GetPoolRequest) -> pb.PoolInfo:
        with self.manager.locked(request.pool) as pool:
            return convert.pool_info(pool)

    def ListPools(self, request: pb.ListPoolsRequest) -> pb.ListPoolsReply:
        reply = pb.ListPoolsReply()
        for name in self.manager.pool_names():
            with self.manager.locked(name) as pool:
                reply.pools.append(convert.pool_info(pool))
        return reply

    def DeletePool(self, request: pb.DeletePoolRequest) -> pb.DeletePoolReply:
        self.manager.delete_pool(request.pool, request.force)
        return pb.DeletePoolReply()

    def Step(self, request: pb.StepRequest) -> pb.StepReply:
        kwargs = step_kwargs(request)
        pool, lock = self.manager.pool_and_lock(request.pool)
        with lock:
            res = pool.step(**kwargs)
        return step_reply(pool, res)

    def ListSequences(self, request: pb.ListSequencesRequest) -> pb.ListSequencesReply:
        with self.manager.locked(request.pool) as pool:
            ids, tokens = pool.sequences()
            ps = pool.page_size
        total = len(ids)
        if request.limit:
            ids, tokens = ids[:request.limit], tokens[:request.limit]
        held = -(-tokens // ps)
        return pb.ListSequencesReply(total=total, sequences=[
            pb.SequenceInfo(seq_id=i, num_tokens=n, num_slots=h)
            for i, n, h in zip(ids.tolist(), tokens.tolist(), held.tolist(), strict=True)])

    def GetStats(self, request: pb.GetStatsRequest) -> pb.StatsReply:
        names = [request.pool] if request.pool else self.manager.pool_names()
        reply = pb.StatsReply()
        for name in names:
            with self.manager.locked(name) as pool:
                reply.pools[name].CopyFrom(convert.pool_stats(pool))
        return reply

    def ValidatePageTable(self, request: pb.ValidatePageTableRequest) -> pb.ValidatePageTableReply:
        arrays = {}
        for f in ("indptr", "indices", "last_page_len"):
            a = field_array(request, f)
            if a is None:
                raise InvalidArgument(f"{f} is required")
            arrays[f] = a
        with self.manager.locked(request.pool) as pool:
            space = pool.plan.geometry.space_of_layer(request.layer)
            ps = pool.page_size
        report = validate_page_table(PageTable(**arrays), space, ps, request.max_reports or 100)
        return pb.ValidatePageTableReply(
            ok=report.ok, num_violations=report.num_violations, index_space=convert.index_space_to_proto(space),
            violations=[pb.Violation(reason=v.reason, row=v.row, position=v.position, value=v.value,
                                     detail=v.detail) for v in report.violations])

    def Echo(self, request: pb.EchoRequest) -> pb.EchoReply:
        return pb.EchoReply(payload=request.payload)

    def RegisterWorker(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerReply:
        rec = self.manager.register_worker(
            request.worker_id, request.pool, layer_begin=request.layer_begin, layer_end=request.layer_end,
            tp_rank=request.tp_rank, tp_size=request.tp_size, backend=request.backend,
            device_name=request.device_name, device_memory_bytes=request.device_memory_bytes,
            address=request.address)
        with self.manager.locked(request.pool) as pool:
            info = convert.pool_info(pool)
        log.info("worker %s registered for pool %s layers [%d, %d) epoch %d at %s", rec.worker_id, rec.pool,
                 rec.layer_begin, rec.layer_end, rec.epoch, rec.address)
        return pb.RegisterWorkerReply(epoch=rec.epoch, lease_seconds=self.manager.workers.lease_seconds, pool=info)

    def Heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.manager.workers.heartbeat(request.worker_id, request.epoch)
        return pb.HeartbeatReply(lease_seconds=self.manager.workers.lease_seconds)

    def ListWorkers(self, request: pb.ListWorkersRequest) -> pb.ListWorkersReply:
        reg = self.manager.workers
        return pb.ListWorkersReply(workers=[convert.worker_info(w, reg.seconds_since_heartbeat(w))
                                            for w in reg.workers(request.pool)])

