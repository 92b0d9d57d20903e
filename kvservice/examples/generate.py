"""Greedy generation with the tiny model: the manager plans pages, workers hold the cache and attend.

`Cluster` is what a scheduler needs besides the manager client: the workers
(each with the layers it holds), the layer -> layer group map (for
copy-on-write) and the page size. Copy-on-write pairs returned by a Step are
run on every worker holding a layer of that group before the step's kernels,
automatically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.client.client import BlockManagerClient
from kvservice.client.codec import ClientError, StepResult
from kvservice.client.stream import StepStream
from kvservice.client.worker_client import WorkerClient
from kvservice.examples.tiny_model import TinyModel


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: np.ndarray          # int64 [B, max_new]: generated tokens
    logits: np.ndarray          # float32 [B, max_new, vocab]: logits that chose them
    cached_tokens: np.ndarray   # int64 [B]: prompt tokens served by the prefix cache


@dataclass(frozen=True, slots=True)
class Cluster:
    workers: Sequence[tuple[range, WorkerClient]]   # layers held, client
    layer_groups: Sequence[int]                     # layer -> layer group
    page_size: int

    @classmethod
    def of(cls, client: BlockManagerClient, pool: str, workers: Sequence[tuple[range, WorkerClient]]) -> Cluster:
        info = client.get_pool(pool)
        return cls(workers, [la.group for la in info.plan.layers], info.plan.page_size)

    def copy(self, step: StepResult) -> None:
        """Run the step's copy-on-write pairs on every worker that holds a layer of the group."""
        gens = step.copy_generations or {}
        for group, pairs in (step.copies or {}).items():
            for layers, worker in self.workers:
                if any(self.layer_groups[la] == group for la in layers):
                    worker.copy_blocks(group, pairs, generations=gens.get(group))    # dst recorded under its own

    def update_tables(self, stream: StepStream) -> None:
        """Forward the stream's last reply to every worker's persistent tables (UpdateTables, named by the
        stream id); a worker whose copy is out of step gets the full tables of the scheduler's mirror."""
        reply = stream.last_reply
        if reply is None or reply.HasField("error") or not stream.mirror.seq:
            return
        for _, worker in self.workers:
            try:
                worker.update_tables(stream.stream_id, reply)
            except ClientError as err:
                if err.reason != "TABLES_OUT_OF_SYNC":
                    raise
                worker.update_tables(stream.stream_id, stream.mirror.full_reply())

    def forward(self, model: TinyModel, tokens: np.ndarray, step: StepResult,
                skip: np.ndarray | None = None, table_id: str = "") -> np.ndarray:
        """table_id: a decode step's kernels use the workers' persistent tables of that name (update_tables)."""
        self.copy(step)
        return model.forward_paged(tokens, step, self.workers, self.page_size, skip, table_id)


def _stepper(client: BlockManagerClient, pool: str, stream: StepStream | None,
             cluster: Cluster | None = None) -> Callable[..., StepResult]:
    """step(**kwargs) of `pool`: over the stream when one is given (its pool), else unary Step calls.
    cluster: forward every stream reply to its workers' persistent tables."""
    if stream is None:
        return lambda **kw: client.step(pool, **kw)
    if stream.pool != pool:
        raise ValueError(f"the stream drives pool {stream.pool!r}, not {pool!r}")
    if cluster is None:
        return stream.step

    def step(**kw: object) -> StepResult:
        try:
            return stream.step(**kw)
        finally:
            cluster.update_tables(stream)
    return step


def _prefill(client: BlockManagerClient, pool: str, cluster: Cluster, model: TinyModel,
             prompts: Sequence[Sequence[int]], ids: np.ndarray, prefix: bool,
             stream: StepStream | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Admit and run the prompts; returns (logits of each prompt's last token [B, vocab], cached tokens [B])."""
    extra = {"admit_token_ids": np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])} if prefix else {}
    device = cluster if stream is not None and stream.deltas else None
    step = _stepper(client, pool, stream, device)(admit=ids, admit_tokens=[len(p) for p in prompts], **extra)
    cached = step.cached_tokens if step.cached_tokens is not None else np.zeros(len(prompts), dtype=np.int64)
    computed = np.concatenate([np.asarray(p, dtype=np.int64)[int(c):] for p, c in zip(prompts, cached,
                                                                                      strict=True)])
    logits = cluster.forward(model, computed, step, cached)
    ends = np.cumsum([len(p) - int(c) for p, c in zip(prompts, cached, strict=True)]) - 1
    return logits[ends], cached


def generate(client: BlockManagerClient, pool: str, cluster: Cluster, model: TinyModel,
             prompts: Sequence[Sequence[int]], max_new: int, first_seq_id: int, prefix: bool = False,
             free: bool = True, on_step: Callable[[StepResult], None] | None = None,
             stream: StepStream | None = None) -> Generation:
    """Prefill every prompt in one step, then decode max_new - 1 steps of +1 token each.

    prefix: send the prompts' token ids so cached prompt pages are reused (and not recomputed).
    free: free the sequences at the end. on_step: called with every decode step's result.
    stream: step over this StepStream of `pool` instead of unary Steps. With incremental tables, every
        reply also goes to the workers' persistent tables and decode steps run their kernels on those
        (only the delta reaches the workers' devices).
    """
    b = len(prompts)
    ids = np.arange(first_seq_id, first_seq_id + b, dtype=np.uint64)
    device = stream is not None and stream.deltas
    step_fn = _stepper(client, pool, stream, cluster if device else None)
    last, cached = _prefill(client, pool, cluster, model, prompts, ids, prefix, stream)
    tokens = np.zeros((b, max_new), dtype=np.int64)
    all_logits = np.zeros((b, max_new, last.shape[1]), dtype=np.float32)
    try:
        for i in range(max_new):
            all_logits[:, i] = last
            tokens[:, i] = last.argmax(axis=1)
            if i + 1 == max_new:
                break
            step = step_fn(extend=ids, extend_tokens=1)
            if on_step is not None:
                on_step(step)
            last = cluster.forward(model, tokens[:, i], step, table_id=stream.stream_id if device else "")
    finally:
        if free:
            step_fn(free=ids)
    return Generation(tokens, all_logits, cached)


def sample_parallel(client: BlockManagerClient, pool: str, cluster: Cluster, model: TinyModel,
                    prompt: Sequence[int], n: int, max_new: int, first_seq_id: int) -> Generation:
    """Parallel sampling: one prefill, then n samples forked from it sharing the prompt's pages.

    Sample i starts with the i-th most likely token, then decodes greedily; appends
    into the shared last page are copied first (copy-on-write). Returns [n, max_new].
    """
    parent = np.array([first_seq_id], dtype=np.uint64)
    ids = np.arange(first_seq_id, first_seq_id + n, dtype=np.uint64)
    last, cached = _prefill(client, pool, cluster, model, [prompt], parent, False)
    client.step(pool, fork=[(first_seq_id, int(c)) for c in ids[1:]])
    tokens = np.zeros((n, max_new), dtype=np.int64)
    all_logits = np.zeros((n, max_new, last.shape[1]), dtype=np.float32)
    all_logits[:, 0] = last[0]
    tokens[:, 0] = np.argsort(-last[0], kind="stable")[:n]
    try:
        for i in range(1, max_new):
            step = client.step(pool, extend=ids, extend_tokens=1)
            out = cluster.forward(model, tokens[:, i - 1], step)
            all_logits[:, i] = out
            tokens[:, i] = out.argmax(axis=1)
    finally:
        client.step(pool, free=ids)
    return Generation(tokens, all_logits, np.repeat(cached, n))
