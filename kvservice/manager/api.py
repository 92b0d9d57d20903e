"""The BlockManager API as plain methods (proto in, domain call, proto out). No gRPC here."""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvservice.contract import convert
from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.pagetable import PageTable, validate_page_table
from kvservice.contract.wire import field_array
from kvservice.core.hashing import DEFAULT_MODE, VLLM_DEFAULT_SEED
from kvservice.core.limits import (
    ReplyBound,
    ReplyModel,
    StepShape,
    check_step_counts,
    exact_sum,
    extend_bound,
    pages_after,
    step_reply_bound,
)
from kvservice.core.planner import plan
from kvservice.core.pool import Pool, StepResult
from kvservice.manager import replies
from kvservice.manager.delta import TablesHolder, encode_delta, held_from_full
from kvservice.manager.pools import BlockManager
from kvservice.manager.replies import step_reply
from kvservice.manager.routing import score_prefix_reply
from kvservice.manager.step_input import DecodedStep, decode_step
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice")
#: Violations a ValidatePageTable reply lists at most (max_reports above it is lowered to this).
MAX_REPORTS = 1000
#: Bytes of one SequenceInfo in a ListSequencesReply, at most (three varints and framing).
SEQUENCE_INFO_BYTES = 36


class StepCost(NamedTuple):
    """What ManagerAPI.check_step_cost found: settled (the request alone settled the check: the same request
    on the same pool passes again) and reply_bytes (the bound on its reply that passed; 0 = none computed)."""

    settled: bool
    reply_bytes: int


class ManagerAPI:
    """Every BlockManager RPC as a plain method: request message in, reply message out.

    Raises KVError subclasses for callers' mistakes; knows nothing of gRPC, so the
    journal can replay requests through it and tests can call it directly.
    """

    def __init__(self, manager: BlockManager, max_reply_bytes: int = 0, fence: bool = False) -> None:
        """max_reply_bytes: the transport's largest message; a request whose reply could be bigger
        is refused before it changes anything (0 = no limit).
        fence: check that a registering worker planned its memory for the pool's current incarnation
        and owns its worker_id (the server's API). False where a journal replays registrations that
        were accepted when they were made: a replay must not fail on a lease or a regenerated id.
        """
        self.manager = manager
        self.max_reply_bytes = max_reply_bytes
        self.fence = fence
        #: Called with a Step's reply bound (bytes) before the step is applied; raises to refuse it (the
        #: server's memory budget: kvservice/server/admission.py). None: nothing reserved.
        self.reserve_reply: Callable[[int], None] | None = None
        self._models: weakref.WeakKeyDictionary[Pool, ReplyModel] = weakref.WeakKeyDictionary()

    def Plan(self, request: pb.PlanRequest) -> pb.PlanReply:
        spec = convert.cache_spec_from_proto(request.cache)
        return convert.plan_to_proto(plan(spec, convert.sizing_from_proto(request.sizing), tuple(request.backends)))

    def CreatePool(self, request: pb.CreatePoolRequest) -> pb.PoolInfo:
        spec = convert.cache_spec_from_proto(request.cache)
        self.manager.create_pool(request.name, spec, convert.sizing_from_proto(request.sizing),
                                 tuple(request.backends), request.enable_prefix_caching,
                                 request.incarnation or derived_incarnation(request), request.model,
                                 request.prefix_hash or DEFAULT_MODE, request.prefix_hash_seed or VLLM_DEFAULT_SEED)
        return self._pool_info(request.name)

    def GetPool(self, request: pb.GetPoolRequest) -> pb.PoolInfo:
        return self._pool_info(request.pool)

    def ListPools(self, request: pb.ListPoolsRequest) -> pb.ListPoolsReply:
        reply = pb.ListPoolsReply()
        for name in self.manager.pool_names():
            reply.pools.append(self._pool_info(name))
        return reply

    def _pool_info(self, name: str) -> pb.PoolInfo:
        incarnation = self.manager.incarnation(name)
        with self.manager.locked(name) as pool:
            return replies.pool_info(pool, incarnation)

    def DeletePool(self, request: pb.DeletePoolRequest) -> pb.DeletePoolReply:
        self.manager.delete_pool(request.pool, request.force)
        return pb.DeletePoolReply()

    def Step(self, request: pb.StepRequest, step: DecodedStep | None = None) -> pb.StepReply:
        """step: the request decoded (decode_step) by the caller, which then owns its bytes; None: decoded here."""
        if step is None:
            step = decode_step(request)
        pool, lock = self.manager.pool_and_lock(step.pool)
        incarnation = self.manager.incarnation(step.pool)
        with lock:
            res = self.run_step(pool, step)
        reply = step_reply(pool, res)
        reply.pool_incarnation = incarnation
        return reply

    # ---- the step service: one way to run a Step (run_step), three encoders of its reply ------------------------
    # Step: full tables (a unary Step, a stream's first reply); step_delta: what changed since the client's last
    # reply (a StepStream with delta_tables); apply_step: no reply at all (a replay whose reply nobody reads).

    def step_delta(self, request: pb.StepRequest, step: DecodedStep, holder: TablesHolder) -> pb.StepReply:
        """A StepStream request's step and reply: incremental tables (manager/delta.py) when the request asks for
        them and the client holds the reply holder.held describes, else full tables; holder.held is updated (the
        stream's session keeps it). step: the request decoded (decode_step) by the caller."""
        delta = request.delta_tables
        if delta and (request.omit_tables or request.include_block_table):
            raise InvalidArgument("delta_tables asks for incremental tables; omit_tables and include_block_table "
                                  "do not go with it (the client's mirror builds block tables): set one or the other")
        seq = request.stream_seq
        pool, lock = self.manager.pool_and_lock(step.pool)
        incarnation = self.manager.incarnation(step.pool)
        with lock:
            held = holder.held
            if delta and held is not None and held.usable(pool, request.delta_base):
                res = self.run_step(pool, step, tables=False, mappings=False)    # its changes are all a delta needs
                reply, holder.held = encode_delta(pool, res, held, seq, derive=request.accept_tokens_added)
                reply.pool_incarnation = incarnation
                return reply
            res = self.run_step(pool, step)
            holder.held = held_from_full(seq, pool, res) if delta else None
        reply = step_reply(pool, res)
        reply.stream_seq = seq
        reply.pool_incarnation = incarnation
        return reply

    def apply_step(self, request: pb.StepRequest) -> None:
        """Step without a reply, for a journal replay whose reply nobody will read (state/journal.py: the entries
        before a restart's last ``replay_replies``; a rebuild of the manager alone): the same checks and the same
        change, but no page tables, slot mappings or reply are built (Pool.step's tables=False, mappings=False)."""
        step = decode_step(request)
        pool, lock = self.manager.pool_and_lock(step.pool)
        with lock:
            self.run_step(pool, step, tables=False, mappings=False)

    def run_step(self, pool: Pool, step: DecodedStep, cost_checked: bool = False, tables: bool | None = None,
                 mappings: bool = True) -> StepResult:
        """Under the pool's lock: refuse a step whose cost is over the limits before it changes anything
        (check_step_cost, unless the caller did: cost_checked), run it, and record its KV events. Step and
        StepStream both come through here. tables: replaces the request's (None: the request's); the
        stream's incremental tables ask for tables=False, mappings=False (Pool.step)."""
        if not cost_checked:
            self.check_step_cost(pool, step)
        try:
            res = pool.step(step.free_seq_ids, step.extend_seq_ids, step.extend_num_tokens, step.admit_seq_ids,
                            step.admit_num_tokens, step.tables if tables is None else tables, step.block_table,
                            step.fork_parent_ids, step.fork_child_ids, step.admit_token_ids, step.admit_salts,
                            step.admit_extra_keys, mappings, step.count_ranges)
        finally:
            flush_fleet(pool)
        self.manager.events.after_step(pool, step.admit_num_tokens, step.admit_token_ids is not None)
        return res

    def check_step_cost(self, pool: Pool, step: DecodedStep) -> StepCost:
        """Refuse, before the pool changes, a step whose counts could overflow or whose reply could not be sent.

        Runs under the pool's lock. The bound from the request alone (extended rows at their longest)
        settles almost every step, from the request's count summary (a few scalars); one over the limit
        is bounded again with the pool's token total, then with its rows' own tokens, and refused only
        if that is over too. Returns whether the request alone settled it and the reply bound that did;
        that bound is passed to `reserve_reply` (the server's memory budget, which may refuse the step).
        """
        sums = check_step_counts(pool.name, pool.max_seq_len, pool.plan.num_slots, pool.page_size,
                                 (("extend_num_tokens", step.extend_num_tokens),
                                  ("admit_num_tokens", step.admit_num_tokens)),
                                 (step.extend_counts, step.admit_counts))
        if not self.max_reply_bytes:
            return StepCost(True, 0)
        model = self._model(pool)
        ext = sums[0]
        e_ids = step.extend_seq_ids
        if (step.admit_seq_ids is None and step.admit_num_tokens is None and step.fork_child_ids is None
                and step.fork_parent_ids is None
                and e_ids is not None and ext is not None and ext[0] > 0 and e_ids.ndim == 1
                and e_ids.dtype.kind in "iu" and len(e_ids) == len(step.extend_num_tokens)):
            c0, ce, cs = extend_bound(model, step.tables, step.block_table)     # an extend-only step
            total = c0 + ce * len(e_ids) + cs * ext[2]
        else:
            shape = _quick_shape(model, step, sums)
            if shape is None:
                return StepCost(False, 0)
            total = step_reply_bound(model, shape, step.tables, step.block_table).total
        if total <= self.max_reply_bytes:
            return self._reserved(StepCost(True, total))
        for level in (1, 2):
            found = _step_reply_bound(pool, model, step, level)
            if found is None:
                return StepCost(False, 0)
            if found[0].total <= self.max_reply_bytes:
                return self._reserved(StepCost(False, found[0].total))
        bound, new_tokens = found
        raise _reply_too_large(pool.name, bound, self.max_reply_bytes, new_tokens, model.num_spaces, step)

    def _reserved(self, cost: StepCost) -> StepCost:
        if self.reserve_reply is not None:
            self.reserve_reply(cost.reply_bytes)
        return cost

    def _model(self, pool: Pool) -> ReplyModel:
        """The reply size model of a pool, kept per pool object (hashing its plan costs more than the check)."""
        model = self._models.get(pool)
        if model is None:
            model = self._models[pool] = ReplyModel.of(pool.plan)
        return model

    def step_reply_bound(self, request: pb.StepRequest, level: int = 2) -> ReplyBound | None:
        """Upper bound on the bytes of this Step's reply in the pool's current state, without running it.

        level 0: from the request alone (extended rows and fork children at max_pages); 1: extended
        rows bounded by the pool's token total; 2: by their own tokens. Each is >= the next. None for a
        request the pool would refuse (malformed arrays, unknown ids).
        """
        step = decode_step(request)
        with self.manager.locked(step.pool) as pool:
            model = self._model(pool)
            if level == 0:
                sums = check_step_counts(pool.name, pool.max_seq_len, pool.plan.num_slots, pool.page_size,
                                         (("extend_num_tokens", step.extend_num_tokens),
                                          ("admit_num_tokens", step.admit_num_tokens)),
                                         (step.extend_counts, step.admit_counts))
                shape = _quick_shape(model, step, sums)
                return None if shape is None else step_reply_bound(model, shape, step.tables, step.block_table)
            found = _step_reply_bound(pool, model, step, level)
        return None if found is None else found[0]

    def ListSequences(self, request: pb.ListSequencesRequest) -> pb.ListSequencesReply:
        with self.manager.locked(request.pool) as pool:
            ids, tokens = pool.sequences()
            total = len(ids)
            if request.limit:
                ids, tokens = ids[:request.limit], tokens[:request.limit]
            per_seq = SEQUENCE_INFO_BYTES + 11 * len(pool.allocators)     # + one varint per layer group
            fits = (self.max_reply_bytes - 64) // per_seq
            if self.max_reply_bytes and len(ids) > fits:
                raise ResourceExhausted(f"pool {request.pool!r} holds {total} sequences; listing {len(ids)} of them "
                                        f"could pass this server's message limit of {self.max_reply_bytes} bytes; "
                                        f"pass limit <= {fits}", reason="REPLY_TOO_LARGE",
                                        limit=self.max_reply_bytes, fits=fits)
            held = pool.slots_held(ids)
        return pb.ListSequencesReply(total=total, sequences=[
            pb.SequenceInfo(seq_id=i, num_tokens=n, num_slots=h[0], num_slots_per_group=h)
            for i, n, h in zip(ids.tolist(), tokens.tolist(), held.tolist(), strict=True)])

    def GetStats(self, request: pb.GetStatsRequest) -> pb.StatsReply:
        names = [request.pool] if request.pool else self.manager.pool_names()
        reply = pb.StatsReply()
        for name in names:
            with self.manager.locked(name) as pool:
                reply.pools[name].CopyFrom(replies.pool_stats(pool))
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
            ps, pool_pages = pool.page_size, pool.plan.geometry.pool_pages
        report = validate_page_table(PageTable(**arrays), space, ps, min(request.max_reports or 100, MAX_REPORTS),
                                     pool_pages=pool_pages)
        return pb.ValidatePageTableReply(
            ok=report.ok, num_violations=report.num_violations, index_space=convert.index_space_to_proto(space),
            violations=[pb.Violation(reason=v.reason, row=v.row, position=v.position, value=v.value,
                                     detail=v.detail) for v in report.violations])

    def Echo(self, request: pb.EchoRequest) -> pb.EchoReply:
        return pb.EchoReply(payload=request.payload)

    def RegisterWorker(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerReply:
        rec = self.manager.register_worker(
            request.worker_id, request.pool, incarnation=request.incarnation, owner=request.registered_by,
            enforce=self.fence, layer_begin=request.layer_begin, layer_end=request.layer_end,
            tp_rank=request.tp_rank, tp_size=request.tp_size, backend=request.backend,
            device_name=request.device_name, device_memory_bytes=request.device_memory_bytes,
            address=request.address)
        info = self._pool_info(request.pool)
        log.info("worker %s registered for pool %s (incarnation %d) layers [%d, %d) epoch %d at %s", rec.worker_id,
                 rec.pool, rec.incarnation, rec.layer_begin, rec.layer_end, rec.epoch, rec.address)
        return pb.RegisterWorkerReply(epoch=rec.epoch, lease_seconds=self.manager.workers.lease_seconds, pool=info)

    def Heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.manager.heartbeat(request.worker_id, request.epoch, request.pool, request.incarnation)
        return pb.HeartbeatReply(lease_seconds=self.manager.workers.lease_seconds)

    def ScorePrefix(self, request: pb.ScorePrefixRequest,
                    readable: frozenset[str] | None = None) -> pb.ScorePrefixReply:
        """readable: the pools the caller's token may read (None = every pool): no other pool is scored."""
        return score_prefix_reply(self.manager, request, readable)

    def ListWorkers(self, request: pb.ListWorkersRequest) -> pb.ListWorkersReply:
        reg = self.manager.workers
        return pb.ListWorkersReply(workers=[replies.worker_info(w, reg.seconds_since_heartbeat(w))
                                            for w in reg.workers(request.pool)])


def _quick_shape(model: ReplyModel, step: DecodedStep,
                 sums: list[tuple[int, int, int] | None]) -> StepShape | None:
    """The shape of a step from its request alone (every extended row and fork child at max_pages):
    a few scalars, for the hot path. None if the arrays are malformed (the pool refuses them)."""
    ids = (step.extend_seq_ids, step.admit_seq_ids, step.fork_parent_ids, step.fork_child_ids)
    for x in ids:
        if x is not None and (x.ndim != 1 or x.dtype.kind not in "iu"):
            return None
    e, a, p, c = [0 if x is None else len(x) for x in ids]
    e_k, a_n = step.extend_num_tokens, step.admit_num_tokens
    if (0 if e_k is None else len(e_k)) != e or (0 if a_n is None else len(a_n)) != a or p != c:
        return None
    ext, adm = sums                                             # (min, max, sum) of each count array
    if (ext is not None and ext[0] <= 0) or (adm is not None and adm[0] <= 0):
        return None
    e_sum = ext[2] if ext else 0
    a_top, a_sum = (adm[1], adm[2]) if adm else (0, 0)
    ps, top_pages = model.page_size, model.max_pages
    admitted = (a_sum + a * (ps - 1)) // ps                     # >= sum of ceil(n / ps)
    pages = (e + c) * top_pages + admitted
    widest = top_pages if e or c else -(-a_top // ps)
    return StepShape(e + a + c, e, a, e_sum + a_sum, (pages,) * len(model.index_bytes), widest)


def _step_reply_bound(pool: Pool, model: ReplyModel, step: DecodedStep,
                      level: int) -> tuple[ReplyBound, int] | None:
    """(reply bound, new tokens) of a step; None if its arrays are malformed or (level 2) name unknown rows.

    level 1: extended rows bounded by the pool's token total; 2: by their own tokens (O(N log N)).
    The pool refuses such a step anyway, with a message naming the field or sequence.
    """
    ids = (step.extend_seq_ids, step.admit_seq_ids, step.fork_parent_ids, step.fork_child_ids)
    if any(a is not None and (a.ndim != 1 or a.dtype.kind not in "iu")
           for a in (*ids, step.extend_num_tokens, step.admit_num_tokens)):
        return None
    e_ids, a_ids, parents, children = (_or_empty(a) for a in ids)
    e_k, a_n = (_or_empty(a).astype(np.int64) for a in (step.extend_num_tokens, step.admit_num_tokens))
    if len(e_k) != len(e_ids) or len(a_n) != len(a_ids) or len(parents) != len(children):
        return None
    if (len(e_k) and int(e_k.min()) <= 0) or (len(a_n) and int(a_n.min()) <= 0):
        return None
    e_old = c_tokens = None
    if level == 2:
        live_ids, live_tokens = pool.sequences()
        e_old, found_e = _tokens_of(live_ids, live_tokens, e_ids)
        c_tokens, found_p = _tokens_of(live_ids, live_tokens, parents)
        if not (found_e and found_p):
            return None
    new_tokens = exact_sum(e_k) + exact_sum(a_n)
    pages, widest = pages_after(model.page_size, model.max_pages, model.windows, e_old, e_k, a_n, c_tokens,
                                len(children), pool.num_tokens_total)
    shape = StepShape(len(e_ids) + len(a_ids) + len(children), len(e_ids), len(a_ids), new_tokens, pages, widest)
    return step_reply_bound(model, shape, step.tables, step.block_table), new_tokens


def derived_incarnation(request: pb.CreatePoolRequest) -> int:
    """The incarnation of a creation that carries none (a configured pool): a hash of the request, so that
    a replay of the same request creates the same incarnation. In [1, 2^63)."""
    data = request.SerializeToString(deterministic=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1 or 1


def _or_empty(a: np.ndarray | None) -> np.ndarray:
    return np.zeros(0, dtype=np.int64) if a is None else a


def _tokens_of(live_ids: np.ndarray, live_tokens: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, bool]:
    """(tokens held by each of ids (int64), whether all are live); live_ids sorted uint64."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64), True
    if not len(live_ids) or (ids.dtype.kind == "i" and int(ids.min()) < 0):
        return np.zeros(0, dtype=np.int64), False
    keys = ids.astype(np.uint64)
    pos = np.minimum(np.searchsorted(live_ids, keys), len(live_ids) - 1)
    return live_tokens[pos].astype(np.int64), bool((live_ids[pos] == keys).all())


def _reply_too_large(pool: str, bound: ReplyBound, limit: int, new_tokens: int, spaces: int,
                     step: DecodedStep) -> ResourceExhausted:
    """RESOURCE_EXHAUSTED naming the limit, what the reply holds, and what would make it fit."""
    parts = (f"slot mappings {bound.slot_mappings} ({new_tokens} new tokens x {spaces} index spaces x 12 bytes: "
             "slot and generation)")
    if bound.tables:
        parts += f", page tables {bound.tables}"
    if bound.block_tables:
        parts += f", block tables {bound.block_tables}"
    if bound.block_tables and bound.total - bound.block_tables <= limit:
        advice = "leave include_block_table off (the CSR tables carry the same pages)"
    elif bound.total - bound.block_tables - bound.tables <= limit:
        advice = "set omit_tables (the reply then carries slot mappings only), or split the step into smaller batches"
    else:
        per_step = max(1, new_tokens * (limit - bound.rest) // max(1, bound.total - bound.rest))
        advice = (f"split it into smaller steps (at most about {per_step} new tokens per step for this pool), "
                  "or raise the message limit of server and client (--max-message-bytes)")
    return ResourceExhausted(
        f"pool {pool!r}: the reply to this Step could take {bound.total} bytes ({parts}), more than this server's "
        f"message limit of {limit} bytes; nothing was changed: {advice}", reason="REPLY_TOO_LARGE",
        reply_bytes=bound.total, limit=limit, new_tokens=new_tokens,
        omit_tables=not step.tables, include_block_table=step.block_table)


def flush_fleet(pool: object) -> None:
    """After a step of `pool` (under its lock): bring the fleet index up to date with its prefix cache, if
    that cache is a member. The step service runs it after every Step, applied or refused."""
    prefix = getattr(pool, "prefix", None)
    member = getattr(prefix, "fleet", None) if prefix is not None else None
    if member is not None:
        member.flush()
