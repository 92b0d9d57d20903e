"""gRPC adapter of the BlockManager: proto in, domain call, proto out. No logic of its own."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from . import convert
from .errors import InvalidArgument, KVError
from .manager import BlockManager
from .metrics import ManagerMetrics
from .pagetable import PageTable, validate_page_table
from .planner import plan
from .status import to_status
from .v1 import block_manager_pb2 as pb
from .v1 import block_manager_pb2_grpc as pb_grpc
from .wire import field_array, to_tensor

log = logging.getLogger("kvservice")


def _rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map domain errors to statuses, anything else to INTERNAL; time the call."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: BlockManagerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, request, context)
        except KVError as err:
            context.abort_with_status(to_status(err))
        except Exception:
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the manager's log")
        finally:
            self.metrics.rpc_duration.labels(name).observe(time.perf_counter() - start)
    return wrapper


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, manager: BlockManager, metrics: ManagerMetrics) -> None:
        self.manager = manager
        self.metrics = metrics

    @_rpc
    def Plan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanReply:
        spec = convert.cache_spec_from_proto(request.cache)
        return convert.plan_to_proto(plan(spec, convert.sizing_from_proto(request.sizing), tuple(request.backends)))

    @_rpc
    def CreatePool(self, request: pb.CreatePoolRequest, context: grpc.ServicerContext) -> pb.PoolInfo:
        spec = convert.cache_spec_from_proto(request.cache)
        self.manager.create_pool(request.name, spec, convert.sizing_from_proto(request.sizing),
                                 tuple(request.backends))
        with self.manager.locked(request.name) as pool:
            return convert.pool_info(pool)

    @_rpc
    def GetPool(self, request: pb.GetPoolRequest, context: grpc.ServicerContext) -> pb.PoolInfo:
        with self.manager.locked(request.pool) as pool:
            return convert.pool_info(pool)

    @_rpc
    def ListPools(self, request: pb.ListPoolsRequest, context: grpc.ServicerContext) -> pb.ListPoolsReply:
        reply = pb.ListPoolsReply()
        for name in self.manager.pool_names():
            with self.manager.locked(name) as pool:
                reply.pools.append(convert.pool_info(pool))
        return reply

    @_rpc
    def DeletePool(self, request: pb.DeletePoolRequest, context: grpc.ServicerContext) -> pb.DeletePoolReply:
        self.manager.delete_pool(request.pool, request.force)
        return pb.DeletePoolReply()

    @_rpc
    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepReply:
        args = {f: field_array(request, f) for f in ("free_seq_ids", "extend_seq_ids", "extend_num_tokens",
                                                      "admit_seq_ids", "admit_num_tokens")}
        with self.manager.locked(request.pool) as pool:
            res = pool.step(args["free_seq_ids"], args["extend_seq_ids"], args["extend_num_tokens"],
                            args["admit_seq_ids"], args["admit_num_tokens"], tables=not request.omit_tables,
                            block_table=request.include_block_table)
            layer_space = pool.plan.geometry.layer_space.tolist()
        reply = pb.StepReply(seq_ids=to_tensor(res.seq_ids), num_tokens=to_tensor(res.num_tokens),
                             new_token_indptr=to_tensor(res.new_token_indptr), layer_index_space=layer_space,
                             num_free_slots=res.num_free_slots)
        for st in res.tables:
            sp = st.space
            out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                                   upper_bound=sp.upper_bound, slot_mapping=to_tensor(st.slot_mapping))
            if st.table is not None:
                out.indptr.CopyFrom(to_tensor(st.table.indptr))
                out.indices.CopyFrom(to_tensor(st.table.indices))
                out.last_page_len.CopyFrom(to_tensor(st.table.last_page_len))
            if st.block_table is not None:
                out.block_table.CopyFrom(to_tensor(st.block_table))
        return reply

    @_rpc
    def ListSequences(self, request: pb.ListSequencesRequest,
                      context: grpc.ServicerContext) -> pb.ListSequencesReply:
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

    @_rpc
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        names = [request.pool] if request.pool else self.manager.pool_names()
        reply = pb.StatsReply()
        for name in names:
            with self.manager.locked(name) as pool:
                reply.pools[name].CopyFrom(convert.pool_stats(pool))
        return reply

    @_rpc
    def ValidatePageTable(self, request: pb.ValidatePageTableRequest,
                          context: grpc.ServicerContext) -> pb.ValidatePageTableReply:
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

    def Echo(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoReply:
        return pb.EchoReply(payload=request.payload)

    @_rpc
    def RegisterWorker(self, request: pb.RegisterWorkerRequest,
                       context: grpc.ServicerContext) -> pb.RegisterWorkerReply:
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

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        self.manager.workers.heartbeat(request.worker_id, request.epoch)
        return pb.HeartbeatReply(lease_seconds=self.manager.workers.lease_seconds)

    @_rpc
    def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.ServicerContext) -> pb.ListWorkersReply:
        reg = self.manager.workers
        return pb.ListWorkersReply(workers=[convert.worker_info(w, reg.seconds_since_heartbeat(w))
                                            for w in reg.workers(request.pool)])

