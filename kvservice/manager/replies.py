"""Reply messages: a step's full reply (StepReply with full tables, its copy-on-write pairs), a pool's and a
worker's state (PoolStats, PoolInfo, WorkerInfo)."""

from __future__ import annotations

from kvservice.contract.convert import cache_spec_to_proto, plan_to_proto
from kvservice.contract.wire import fill_tensor, to_tensor
from kvservice.core.pool import Pool, StepResult
from kvservice.manager.workers import WorkerRecord
from kvservice.v1 import block_manager_pb2 as pb


def pool_stats(pool: Pool) -> pb.PoolStats:
    cache = pool.prefix
    return pb.PoolStats(num_slots=pool.plan.num_slots, num_free_slots=pool.num_free_slots,
                        peak_used_slots=pool.peak_used_slots, num_sequences=pool.num_sequences,
                        num_tokens=pool.num_tokens_total, steps=pool.steps, admitted=pool.admitted,
                        refused=pool.refused, prefix_caching=cache is not None,
                        prefix_cache_hits=cache.hits if cache else 0,
                        prefix_cache_evictions=cache.allocator.evictions if cache else 0,
                        cached_slots=cache.allocator.num_cached if cache else 0,
                        event_sequence=pool.events.seq)


def pool_info(pool: Pool, incarnation: int) -> pb.PoolInfo:
    return pb.PoolInfo(name=pool.name, plan=plan_to_proto(pool.plan), stats=pool_stats(pool),
                       cache=cache_spec_to_proto(pool.plan.geometry.spec), incarnation=incarnation,
                       model=pool.model, prefix_hash=pool.prefix_hash,
                       prefix_hash_seed=pool.prefix_hash_seed if pool.prefix_hash != "kvservice" else "")


def worker_info(w: WorkerRecord, seconds_since_heartbeat: float) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=w.worker_id, pool=w.pool, layer_begin=w.layer_begin, layer_end=w.layer_end,
                         tp_rank=w.tp_rank, tp_size=w.tp_size, backend=w.backend, device_name=w.device_name,
                         device_memory_bytes=w.device_memory_bytes, address=w.address, epoch=w.epoch,
                         alive=w.alive, seconds_since_heartbeat=seconds_since_heartbeat, incarnation=w.incarnation)


def step_reply(pool: Pool, res: StepResult, tables: bool = True) -> pb.StepReply:
    """The StepReply of a step's result; tables=False leaves out every SpaceTables (a caller adds its own)."""
    reply = pb.StepReply(layer_index_space=pool.layer_space, num_free_slots=res.num_free_slots)
    fill_tensor(reply.seq_ids, res.seq_ids)
    fill_tensor(reply.num_tokens, res.num_tokens)
    fill_tensor(reply.new_token_indptr, res.new_token_indptr)
    if res.cached_tokens is not None:
        reply.admit_cached_tokens.CopyFrom(to_tensor(res.cached_tokens))
    add_copies(reply, pool, res)
    if not tables:
        return reply
    for st in res.tables:
        sp = st.space
        out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound, base=sp.base)
        fill_tensor(out.slot_mapping, st.slot_mapping)
        if st.slot_generations is not None:
            fill_tensor(out.slot_generations, st.slot_generations)
        if st.table is not None:
            fill_tensor(out.indptr, st.table.indptr)
            fill_tensor(out.indices, st.table.indices)
            fill_tensor(out.last_page_len, st.table.last_page_len)
            if st.generations is not None:
                fill_tensor(out.generations, st.generations)
        if st.block_table is not None:
            fill_tensor(out.block_table, st.block_table)
    return reply


def add_copies(reply: pb.StepReply, pool: Pool, res: StepResult) -> None:
    """The step's copy-on-write pairs per layer group, each with the generations of its two slots (read right
    after the step: both slots are held then)."""
    for g, pairs in enumerate(res.copies):
        if len(pairs):
            c = reply.copies.add(group=g, pairs=to_tensor(pairs))
            fill_tensor(c.generations, pool.allocators[g].generation.take(pairs))
