"""Greedy generation with the tiny model: the manager plans pages, workers hold the cache and attend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .client import BlockManagerClient
from .tiny_model import TinyModel
from .worker_client import WorkerClient


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: np.ndarray   # int64 [B, max_new]: generated tokens
    logits: np.ndarray   # float32 [B, max_new, vocab]: logits that chose them


def generate(client: BlockManagerClient, pool: str, workers: Sequence[tuple[range, WorkerClient]],
             model: TinyModel, prompts: Sequence[Sequence[int]], max_new: int, first_seq_id: int,
             page_size: int) -> Generation:
    """Prefill every prompt in one step, then decode max_new - 1 steps of +1 token each; frees at the end."""
    b = len(prompts)
    ids = np.arange(first_seq_id, first_seq_id + b, dtype=np.uint64)
    step = client.step(pool, admit=ids, admit_tokens=[len(p) for p in prompts])
    logits = model.forward_paged(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]), step, workers,
                                 page_size)
    last = logits[step.new_token_indptr[1:] - 1]
    tokens = np.zeros((b, max_new), dtype=np.int64)
    all_logits = np.zeros((b, max_new, logits.shape[1]), dtype=np.float32)
    try:
        for i in range(max_new):
            all_logits[:, i] = last
            tokens[:, i] = last.argmax(axis=1)
            if i + 1 == max_new:
                break
            step = client.step(pool, extend=ids, extend_tokens=1)
            last = model.forward_paged(tokens[:, i], step, workers, page_size)
    finally:
        client.step(pool, free=ids)
    return Generation(tokens, all_logits)
