"""The Worker gRPC service: checks every tensor against the geometry, runs the kernel, reports violations."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from kvservice.contract.auth import current_principal
from kvservice.contract.errors import FailedPrecondition, InvalidArgument, KVError
from kvservice.contract.status import to_status
from kvservice.contract.transport import MAX_MESSAGE_BYTES, check_reply_bytes
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import cancel, ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.fencing import LeaderEpochFence, MemoryGate, check_incarnation
from kvservice.worker.kernel_api import (
    REASONS,
    SKIP_SLOT,
    KernelViolationError,
    Policy,
    ViolationRecord,
    check_copy_pairs,
)
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.tables import MAX_TABLE_ROWS, MAX_TABLES, DeviceTables, TablePlan

log = logging.getLogger("kvworker")
WIRE_DTYPE = {"float16": cpb.FLOAT16, "bfloat16": cpb.BFLOAT16, "float32": cpb.FLOAT32}
KERNELS = ("append_kv", "decode_attention", "copy_blocks", "validate_page_table")


class OutOfRange(KVError):
    reason = "OUT_OF_RANGE"


#: The RPCs that carry manager-issued slots or page tables: fenced by leader epoch
#: (kvservice.worker.fencing.LeaderEpochFence).
EPOCH_FENCED = frozenset({"AppendKV", "DecodeAttention", "CopyBlocks", "UpdateTables"})


def _rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    fenced = fn.__name__ in EPOCH_FENCED

    @functools.wraps(fn)
    def wrapper(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        remaining = context.time_remaining()
        try:
            # the call's deadline, and its end for any reason, reach the kernel loop: abandoned work stops
            with self.memory.shared(), cancel.bounded(None if remaining is None else time.monotonic() + remaining) \
                    as bound:                  # a re-plan swaps the caches only between calls
                context.add_callback(bound.cancel)
                check_incarnation(self.identity, request)
                if fenced:
                    self.leader_fence.check(context.invocation_metadata(), self.identity, fn.__name__)
                return fn(self, request, context)
        except cancel.KernelCancelled as err:
            self.metrics.kernels_stopped.inc()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{err}; blocks run before the stop may have written "
                          "their slots: retry the call")
        except OutOfRange as err:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, err.message)
        except KVError as err:
            context.abort_with_status(to_status(err))
        except (ValueError, TypeError) as err:          # the kernel wrappers' argument checks
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{fn.__name__}: {err}")
        except Exception:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the worker's log")
    return wrapper


def table_plan(caches: CacheSet, max_table_rows: int = MAX_TABLE_ROWS) -> TablePlan:
    """What a persistent table of the pool the caches are planned for may be (kvservice.worker.tables)."""
    return TablePlan(caches.geometry, caches.max_seq_len, max(1, min(max_table_rows, caches.geometry.num_slots)))


class WorkerServicer(wpb_grpc.WorkerServicer):
    """max_table_rows, max_tables, table_quota_bytes: bounds of the persistent tables (kvservice.worker.tables;
    0 quota = 4 x the most one table of the pool holds, per tenant)."""

    def __init__(self, caches: CacheSet, metrics: WorkerMetrics, identity: dict[str, Any],
                 test_hooks: bool = False, leader_epoch: Callable[[], int] | None = None, *,
                 max_table_rows: int = MAX_TABLE_ROWS, max_tables: int = MAX_TABLES,
                 table_quota_bytes: int = 0) -> None:
        self.caches = caches
        self.ops = caches.ops
        self.metrics = metrics
        self.identity = identity        # worker_id, pool, epoch, incarnation, backend, device_name
        self.test_hooks = test_hooks
        self.memory = MemoryGate()
        # leader_epoch: the highest leader epoch the worker's manager client has seen (replicated managers)
        self.leader_fence = LeaderEpochFence(
            leader_epoch, on_refuse=lambda reason: metrics.leader_epoch_refusals.labels(reason).inc())
        self.max_table_rows = max_table_rows
        # persistent page tables (UpdateTables), bound to this incarnation and plan
        self.tables = DeviceTables(table_plan(caches, max_table_rows), identity.get("incarnation", 0), caches.xp,
                                   max_tables, table_quota_bytes)
        self.max_reply_bytes = MAX_MESSAGE_BYTES    # the worker's gRPC limit (kvservice.contract.serving.grpc_server)
        self._zero_series(caches)

    def _zero_series(self, caches: CacheSet) -> None:
        """Every series this worker can report starts at 0, so "nothing happened" is visible and
        Prometheus' increase() sees the first violation."""
        metrics = self.metrics
        metrics.cache_bytes.labels(metrics.pool).set(caches.cache_bytes)
        for kernel in KERNELS:
            for layer in range(caches.layer_begin, caches.layer_end):
                for reason in REASONS[1:]:
                    metrics.violations.labels(kernel, str(layer), reason)
        for name in caches.buffers:
            metrics.guard_corruptions.labels(name)
        for reason in ("STALE_LEADER_EPOCH", "LEADER_EPOCH_REQUIRED"):
            metrics.leader_epoch_refusals.labels(reason)
        for kernel in KERNELS:                       # the duration panels read 0 calls, not "no data"
            metrics.kernel_duration.labels(kernel)

    def replan(self, caches: CacheSet, incarnation: int) -> None:
        """Serve from caches planned for another incarnation of the pool (after in-flight calls end)."""
        with self.memory.exclusive():
            caches.forget_generations()         # kept or new, its pages hold nothing of the new incarnation
            self.caches, self.ops = caches, caches.ops
            self.identity["incarnation"] = incarnation
            self.tables.rebind(table_plan(caches, self.max_table_rows), incarnation)   # every table held is stale
            self._zero_series(caches)

    # ---- helpers ---------------------------------------------------------------------
    def _layer(self, layer: int) -> None:
        if not self.caches.holds(layer):
            raise OutOfRange(f"worker {self.identity['worker_id']} holds layers [{self.caches.layer_begin}, "
                             f"{self.caches.layer_end}) of pool {self.identity['pool']!r}, not layer {layer}")

    def _tensor(self, msg: Any, field: str, dtype: str, shape: tuple[int | None, ...], doc: str,
                device: bool = True) -> Any:
        if not msg.HasField(field):
            raise InvalidArgument(f"{field} is required: {doc}")
        t = getattr(msg, field)
        want = WIRE_DTYPE.get(dtype, {"int32": cpb.INT32, "int64": cpb.INT64, "uint32": cpb.UINT32}.get(dtype))
        if t.dtype != want:
            raise InvalidArgument(f"{field} must be {cpb.DType.Name(want)} {doc}, got "
                                  f"{cpb.DType.Name(t.dtype) if t.dtype in cpb.DType.values() else t.dtype}")
        a = from_tensor(t, field, kinds="iuf")
        if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape, strict=True)):
            raise InvalidArgument(f"{field} must have shape {doc}, got {list(a.shape)}")
        a = np.ascontiguousarray(a)
        return self.caches.xp.asarray(a) if device else a

    def _csr(self, msg: Any) -> tuple[Any, Any, Any]:
        ip, idx, lpl, _ = self._csr_bounded(msg)
        return ip, idx, lpl

    def _csr_bounded(self, msg: Any) -> tuple[Any, Any, Any, int]:
        """The request's CSR table on the device, and the most pages of one row read off the host copy
        of indptr before it moves (the kernels' split planning then needs no device read back)."""
        host = self._tensor(msg, "indptr", "int32", (None,), "[B + 1]", device=False)
        if host.shape[0] < 1:
            raise InvalidArgument("indptr must have B + 1 >= 1 entries")
        b = host.shape[0] - 1
        rows = np.diff(host.astype(np.int64))
        max_pages = int(max(0, rows.max())) if b else 0
        return self.caches.xp.asarray(host), self._tensor(msg, "indices", "int32", (None,), "[nnz]"), \
            self._tensor(msg, "last_page_len", "int32", (b,), f"[B] = [{b}]"), max_pages

    def _gens(self, msg: Any, field: str, shape: tuple[int, ...], doc: str) -> Any:
        """An optional UINT32 generations tensor of a request (None when absent)."""
        return self._tensor(msg, field, "uint32", shape, doc) if msg.HasField(field) else None

    def _record(self, rec: ViolationRecord, layer: int, reasons: dict[str, int]) -> wpb.ViolationRecord:
        stale = rec.count - sum(reasons.values())       # the table rules' reasons are counted; the rest is time
        if stale > 0:
            reasons = {**reasons, "stale_page": stale}
        for reason, n in reasons.items():
            self.metrics.violations.labels(rec.kernel, str(layer), reason).inc(n)
        return wpb.ViolationRecord(kernel=rec.kernel, layer=layer, count=rec.count, row=rec.row,
                                   position=rec.position, value=rec.value, reason=rec.reason or "",
                                   counts_by_reason=reasons)

    def _csr_reasons(self, rec: ViolationRecord, layer: int, ip: Any, idx: Any, lpl: Any) -> dict[str, int]:
        if not rec.count:
            return {}
        host = [_host(a) for a in (ip, idx, lpl)]
        found, _ = ops_numpy.csr_violations(*host, self.caches.layouts[layer])
        return _count_reasons(found.codes.tolist())

    def _timed(self, kernel: str, fn: Callable[[], Any],
               on_violation: Callable[[ViolationRecord], None] | None = None) -> tuple[Any, float]:
        """Run a kernel and time it. Under POLICY_ERROR a violation is counted (on_violation), then refused."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except KernelViolationError as err:
            if on_violation is not None:
                on_violation(err.record)
            raise FailedPrecondition(str(err), reason="BOUNDS_VIOLATION", kernel=err.record.kernel,
                                     row=err.record.row, position=err.record.position,
                                     value=err.record.value, violation=err.record.reason) from None
        finally:
            dt = time.perf_counter() - t0
            self.metrics.kernel_duration.labels(kernel).observe(dt)
        return out, dt

    # ---- RPCs -------------------------------------------------------------------------
    @_rpc
    def Info(self, request: wpb.WorkerInfoRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        c = self.caches
        return wpb.WorkerStatus(worker_id=self.identity["worker_id"], pool=self.identity["pool"],
                                epoch=self.identity.get("epoch", 0), layer_begin=c.layer_begin,
                                pool_incarnation=self.identity.get("incarnation", 0),
                                layer_end=c.layer_end, backend=self.identity["backend"],
                                device_name=self.identity.get("device_name", ""), cache_bytes=c.cache_bytes,
                                guard_bytes=c.guard_bytes, buffers=sorted(c.buffers))

    @_rpc
    def AppendKV(self, request: wpb.AppendKVRequest, context: grpc.ServicerContext) -> wpb.KernelReply:
        self._layer(request.layer)
        layout = self.caches.layouts[request.layer]
        if request.table_id:
            sm, sg = self.tables.slot_mapping(current_principal(), request.table_id, request.layer)
        else:
            sm = self._tensor(request, "slot_mapping", "int64", (None,), "[n]")
            sg = self._gens(request, "slot_generations", (sm.shape[0],), f"[n] = [{sm.shape[0]}]")
        shape = (sm.shape[0], layout.kv_heads, layout.head_dim)
        doc = f"[n, kv_heads, head_dim] = {list(shape)}"
        k = self._tensor(request, "k", layout.dtype, shape, doc)
        if layout.k_only:                  # an MLA latent cache: the latent vectors go in k, no v
            if request.HasField("v") and len(request.v.data):
                raise InvalidArgument(f"layer {request.layer} caches multi-head latent attention (MLA) latents "
                                      "(K only): send them as k and leave v empty")
            v = None
        else:
            v = self._tensor(request, "v", layout.dtype, shape, doc)

        def reasons() -> dict[str, int]:
            host = _host(sm)
            host = host[host != SKIP_SLOT]                # written nowhere, never a violation
            pages = np.where(host < 0, -1, host // layout.page_size)
            return _count_reasons(int(r) for r in layout.reasons(pages) if r)

        pg = self.caches.page_gen(request.layer) if sg is not None else None
        call, dt = self._timed("append_kv", lambda: self.ops.append_kv(
            self.caches.cache(request.layer), layout, k, v, sm, policy=Policy(request.policy),
            slot_generations=sg, page_gen=pg),
            lambda rec: self._record(rec, request.layer, reasons()))
        reply = wpb.KernelReply(kernel_seconds=dt)
        if call.record.count:
            reply.violations.append(self._record(call.record, request.layer, reasons()))
        return reply

    @_rpc
    def DecodeAttention(self, request: wpb.DecodeAttentionRequest,
                        context: grpc.ServicerContext) -> wpb.DecodeAttentionReply:
        self._layer(request.layer)
        layout = self.caches.layouts[request.layer]
        if layout.k_only:
            raise FailedPrecondition(
                f"layer {request.layer} caches multi-head latent attention (MLA) latents; decode attention for "
                "MLA is not implemented on this worker (its kernels attend K and V per head): run an MLA decode "
                "kernel (FlashMLA, FlashInfer's MLA) on the same page tables", reason="MLA_DECODE_UNSUPPORTED",
                layer=request.layer)
        if request.table_id:  # the copy's width bounds its rows: no device read back either way
            ip, idx, lpl, gens = self.tables.csr(current_principal(), request.table_id, request.layer)
            max_pages = self.tables.max_pages(current_principal(), request.table_id, request.layer)
        else:
            ip, idx, lpl, max_pages = self._csr_bounded(request)
            gens = self._gens(request, "generations", (idx.shape[0],), f"[nnz] = [{idx.shape[0]}]")
        b = ip.shape[0] - 1
        q = self._tensor(request, "q", layout.dtype, (b, None, layout.head_dim), f"[B, q_heads, {layout.head_dim}]")
        check_reply_bytes(4 * b * q.shape[1] * (layout.head_dim + 1) + 256, self.max_reply_bytes, "DecodeAttention",
                          "send fewer rows per call (out is float32 whatever the dtype of q)")
        window = self.caches.spec.layers[request.layer].sliding_window
        call, dt = self._timed("decode_attention", lambda: self.ops.decode_attention(
            q, self.caches.cache(request.layer), layout, ip, idx, lpl, sm_scale=request.sm_scale or None,
            window=window, policy=Policy(request.policy), max_pages=max_pages, generations=gens,
            page_gen=self.caches.page_gen(request.layer) if gens is not None else None),
            lambda rec: self._record(rec, request.layer, self._csr_reasons(rec, request.layer, ip, idx, lpl)))
        rec = call.record
        return wpb.DecodeAttentionReply(out=to_tensor(_host(call.out)), lse=to_tensor(_host(call.lse)),
                                        kernel_seconds=dt, violation=self._record(
                                            rec, request.layer, self._csr_reasons(rec, request.layer, ip, idx, lpl)))

    @_rpc
    def CopyBlocks(self, request: wpb.CopyBlocksRequest, context: grpc.ServicerContext) -> wpb.KernelReply:
        """pairs are (src_slot, dst_slot). Slots are range-checked BEFORE any arithmetic: a slot
        outside [0, num_slots) of the group is out_of_bounds (value = the slot as sent) and its pair is skipped;
        duplicate destinations, or a slot both source and destination, are INVALID_ARGUMENT."""
        layers = self.caches.group_layers(request.group)
        if not layers:
            raise OutOfRange(f"worker {self.identity['worker_id']} holds no layer of group {request.group}")
        slots = self._tensor(request, "pairs", "int64", (None, 2), "[n, 2]", device=False)
        gens = self._gens(request, "generations", (slots.shape[0], 2), f"[n, 2] = [{slots.shape[0]}, 2]")
        check_copy_pairs(np, slots, "slot")
        bad = (slots < 0) | (slots >= self.caches.geometry.groups[request.group].num_slots)
        # Bad slots become distinct negative pages (out_of_bounds everywhere, never equal to each other).
        sentinel = -1 - np.arange(slots.size, dtype=np.int64).reshape(slots.shape)
        safe = np.where(bad, 0, slots)
        counts = {"out_of_bounds": int(bad.sum())} if bad.any() else {}

        def as_slots(rec: ViolationRecord) -> ViolationRecord:
            return dataclasses.replace(rec, value=int(slots[rec.row, rec.position])) if rec.count else rec

        reply = wpb.KernelReply()
        for layer in layers:
            layout = self.caches.layouts[layer]
            pages = self.caches.xp.asarray(np.where(bad, sentinel, layout.page_index(safe)))

            def run(layer: int = layer, layout: Any = layout, pages: Any = pages) -> Any:
                try:
                    return self.ops.copy_blocks([self.caches.cache(layer)], layout, pages,
                                                policy=Policy(request.policy), generations=gens,
                                                page_gens=None if gens is None else [self.caches.page_gen(layer)])
                except KernelViolationError as err:
                    raise KernelViolationError(as_slots(err.record)) from None

            call, dt = self._timed("copy_blocks", run, lambda rec, layer=layer: self._record(rec, layer, counts))
            reply.kernel_seconds += dt
            if call.record.count:
                reply.violations.append(self._record(as_slots(call.record), layer, counts))
        return reply

    @_rpc
    def ValidatePageTable(self, request: wpb.WorkerValidateRequest,
                          context: grpc.ServicerContext) -> wpb.WorkerValidateReply:
        self._layer(request.layer)
        layout = self.caches.layouts[request.layer]
        ip, idx, lpl = self._csr(request)
        gens = self._gens(request, "generations", (idx.shape[0],), f"[nnz] = [{idx.shape[0]}]")
        res, _ = self._timed("validate_page_table", lambda: self.ops.validate_page_table(
            ip, idx, lpl, layout, generations=gens,
            page_gen=self.caches.page_gen(request.layer) if gens is not None else None))
        rec = res.record
        return wpb.WorkerValidateReply(ok=rec.count == 0, row_status=to_tensor(_host(res.row_status)),
                                       violation=self._record(rec, request.layer,
                                                              self._csr_reasons(rec, request.layer, ip, idx, lpl)))

    @_rpc
    def UpdateTables(self, request: wpb.UpdateTablesRequest, context: grpc.ServicerContext) -> wpb.UpdateTablesReply:
        tenant = current_principal()
        t = self.tables.update(tenant, request.table_id, request.step, request.replace)
        m = t.mirror
        held = sum(m.num_pages(sid) for sid in m.spaces)
        return wpb.UpdateTablesReply(stream_seq=m.seq, batch_size=m.batch_size, pages_held=held,
                                     pool_incarnation=t.incarnation, table_bytes=t.nbytes,
                                     max_table_bytes=self.tables.plan.max_table_bytes,
                                     tenant_bytes=self.tables.tenant_bytes(tenant),
                                     tenant_quota_bytes=self.tables.quota_bytes)

    @_rpc
    def CheckGuards(self, request: wpb.CheckGuardsRequest, context: grpc.ServicerContext) -> wpb.CheckGuardsReply:
        reply = wpb.CheckGuardsReply(ok=True)
        for name, buf in sorted(self.caches.buffers.items()):
            rep = self.ops.guard_check(buf.raw, self.caches.guard_bytes)
            if rep.corrupted_bytes:
                reply.ok = False
                self.metrics.guard_corruptions.labels(name).inc(rep.corrupted_bytes)
                log.error("guard corruption around %s: %d bytes, first at offset %d", name, rep.corrupted_bytes,
                          rep.first_offset)
            reply.buffers.add(buffer=name, corrupted_bytes=rep.corrupted_bytes, first_offset=rep.first_offset)
        return reply

    @_rpc
    def CorruptGuard(self, request: wpb.CorruptGuardRequest,
                     context: grpc.ServicerContext) -> wpb.CorruptGuardReply:
        if not self.test_hooks:
            raise FailedPrecondition("CorruptGuard is a test hook; start the worker with --enable-test-hooks")
        buf = self.caches.buffers.get(request.buffer)
        if buf is None:
            raise InvalidArgument(f"no buffer {request.buffer!r}; buffers: {', '.join(sorted(self.caches.buffers))}")
        g = self.caches.guard_bytes
        if request.offset >= g:
            raise InvalidArgument(f"offset {request.offset} is outside the {g}-byte guard")
        at = (buf.raw.shape[0] - g + request.offset) if request.after else request.offset
        buf.raw[at] = buf.raw[at] ^ 0xFF
        return wpb.CorruptGuardReply()


def _host(a: Any) -> np.ndarray:
    """A NumPy view of a NumPy or CuPy array (CuPy copies device -> host)."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def _count_reasons(codes: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[REASONS[c]] = out.get(REASONS[c], 0) + 1
    return out
