"""A pool's and a worker's state as reply messages (PoolStats, PoolInfo, WorkerInfo)."""

from __future__ import annotations

from kvservice.contract.convert import cache_spec_to_proto, plan_to_proto
from kvservice.core.pool import Pool
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
