"""A tiny decoder-only transformer whose KV cache and attention live on kvservice workers.

Random weights from a fixed seed; RMSNorm, rotary positions, grouped-query
attention, a SiLU MLP. Every layer appends its new K/V through the manager's
slot mapping and attends through the manager's page table, both on the worker
that holds the layer. `reference_logits` computes the same network densely in
torch float64 with no paging at all: the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvservice.client.codec import StepResult
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import PageTable


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Model shape. `layers`: per layer (head_dim, sliding_window); empty = num_layers x (head_dim, 0)."""

    vocab: int = 256
    d_model: int = 128
    num_layers: int = 3
    q_heads: int = 4
    kv_heads: int = 2        # grouped-query attention: 2 q heads per kv head
    head_dim: int = 32
    ffn: int = 256
    seed: int = 0
    layers: tuple[tuple[int, int], ...] = ()

    def layer_shapes(self) -> tuple[tuple[int, int], ...]:
        return self.layers or ((self.head_dim, 0),) * self.num_layers

    def cache_spec(self, page_size: int = 16, dtype: str = "float32", layout: str = "per_layer") -> CacheSpec:
        """The KV cache this model needs."""
        return CacheSpec(tuple(LayerSpec(self.kv_heads, hd, dtype, w) for hd, w in self.layer_shapes()),
                         page_size, layout)


def new_tokens(step: StepResult, skip: np.ndarray | None = None) -> np.ndarray:
    """Indices into the step's new tokens (batch order) that must be computed: all but each row's
    first skip[b] (tokens whose K/V a prefix-cache hit already holds)."""
    ip = step.new_token_indptr
    keep = [np.arange(ip[b] + (int(skip[b]) if skip is not None else 0), ip[b + 1]) for b in range(len(ip) - 1)]
    return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)


def causal_rows(step: StepResult, layer: int, page_size: int,
                skip: np.ndarray | None = None) -> tuple[np.ndarray, PageTable, np.ndarray | None]:
    """Per computed new token: its position, and a CSR table whose row covers that token's causal prefix.

    A prefill of n tokens becomes n attention rows (row i sees tokens 0..i), so
    one decode kernel serves prefill and decode. Rows of a sliding-window layer
    start at the first page the manager still holds (pages before it are outside
    every window; the kernel attends the last `window` tokens of the row).
    skip: per batch row, leading new tokens not computed (cached). Returns (positions int64 [T], table, the
    generation of each of its pages uint32 [nnz], or None when the step carries none).
    """
    st = step.for_layer(layer)
    t = st.table
    positions, indptr, indices, last, gens = [], [0], [], [], []
    for b in range(len(step.seq_ids)):
        pages = t.row(b)
        row_gens = st.generations[t.indptr[b]:t.indptr[b + 1]] if st.generations is not None else None
        lo, hi = step.new_token_indptr[b], step.new_token_indptr[b + 1]
        n = int(step.num_tokens[b])
        first = -(-n // page_size) - len(pages)             # pages released before the table starts
        for p in range(n - (hi - lo) + (int(skip[b]) if skip is not None else 0), n):
            held = p // page_size + 1 - first
            positions.append(p)
            indices.append(pages[:held])
            if row_gens is not None:
                gens.append(row_gens[:held])
            indptr.append(indptr[-1] + held)
            last.append(p % page_size + 1)
    idx = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int32)
    g = None if st.generations is None else (np.concatenate(gens) if gens else np.zeros(0, dtype=np.uint32))
    return np.array(positions, dtype=np.int64), PageTable(np.array(indptr, dtype=np.int32),
                                                          idx.astype(np.int32), np.array(last, dtype=np.int32)), g


class TinyModel:
    """The network. Weights are float32 for the paged path and float64 for the reference."""

    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        d, hq, hk = cfg.d_model, cfg.q_heads, cfg.kv_heads

        def w(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale / np.sqrt(shape[0])

        self.emb = torch.randn(cfg.vocab, d, generator=g, dtype=torch.float64)
        self.shapes = cfg.layer_shapes()
        self.layers = [{
            "n1": 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64),
            "wq": w(d, hq * hd), "wk": w(d, hk * hd), "wv": w(d, hk * hd), "wo": w(hq * hd, d),
            "n2": 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64),
            "w1": w(d, cfg.ffn), "w2": w(cfg.ffn, d),
        } for hd, _ in self.shapes]
        self.nf = 1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
        self.logit_scale = 1.0 / np.sqrt(d)      # tied embeddings, scaled: logits of order 1

    # ---- pieces shared by both paths -----------------------------------------------------
    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; pos: [T]."""
        hd = x.shape[-1]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos[:, None].to(x.dtype) * inv_freq.to(x.dtype)[None, :]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def _mlp(self, x: torch.Tensor, lw: dict, dt: torch.dtype) -> torch.Tensor:
        return torch.nn.functional.silu(x @ lw["w1"].to(dt)) @ lw["w2"].to(dt)

    # ---- the paged path, through workers -----------------------------------------------
    def forward_paged(self, tokens: np.ndarray, step: StepResult, workers: Sequence[tuple[range, WorkerClient]],
                      page_size: int, skip: np.ndarray | None = None, table_id: str = "") -> np.ndarray:
        """Logits float32 [T, vocab] of the computed new tokens of the step (rows in batch order).

        tokens: int64 [T], the computed new tokens (all new tokens but each row's first skip[b]).
        workers: (layers held, client) pairs. Copy-on-write pairs of the step must have been run.
        table_id: the workers hold this step's tables (UpdateTables); a decode step (one new token per
            row) then sends neither slot mappings nor tables.
        """
        cfg, dt = self.cfg, torch.float32
        h = self.emb.to(dt)[torch.as_tensor(tokens)]
        keep = new_tokens(step, skip)
        decode = bool(table_id) and skip is None and int(step.new_token_indptr[-1]) == len(step.seq_ids)
        for layer, (lw, (hd, _)) in enumerate(zip(self.layers, self.shapes, strict=True)):
            worker = next(c for r, c in workers if layer in r)
            if decode:
                positions, table, gens = np.asarray(step.num_tokens, dtype=np.int64) - 1, None, None
            else:
                positions, table, gens = causal_rows(step, layer, page_size, skip)
            pos = torch.as_tensor(positions)
            x = self._norm(h, lw["n1"].to(dt))
            q = self._rope((x @ lw["wq"].to(dt)).view(-1, cfg.q_heads, hd), pos)
            k = self._rope((x @ lw["wk"].to(dt)).view(-1, cfg.kv_heads, hd), pos)
            v = (x @ lw["wv"].to(dt)).view(-1, cfg.kv_heads, hd)
            if decode:
                worker.append_kv(layer, k.numpy(), v.numpy(), table_id=table_id)
                att = worker.decode_attention(layer, q.contiguous().numpy(), table_id=table_id)
            else:
                st = step.for_layer(layer)      # with page generations: recorded, then checked on read
                worker.append_kv(layer, k.numpy(), v.numpy(), st.slot_mapping[keep],
                                 slot_generations=None if st.slot_generations is None else st.slot_generations[keep])
                att = worker.decode_attention(layer, q.contiguous().numpy(), table, generations=gens)
            h = h + torch.tensor(att.out).reshape(-1, cfg.q_heads * hd) @ lw["wo"].to(dt)
            h = h + self._mlp(self._norm(h, lw["n2"].to(dt)), lw, dt)
        return (self._norm(h, self.nf.to(dt)) @ self.emb.to(dt).T * self.logit_scale).numpy()

    # ---- the oracle ------------------------------------------------------------------------
    def reference_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Dense causal float64 logits [n, vocab] of one sequence, no paging; sliding layers see `window` tokens."""
        cfg, dt = self.cfg, torch.float64
        n = len(tokens)
        pos = torch.arange(n)
        h = self.emb[torch.as_tensor(list(tokens))]
        for lw, (hd, window) in zip(self.layers, self.shapes, strict=True):
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            visible = (j <= i) & ((j > i - window) if window else True)
            mask = torch.zeros((n, n), dtype=dt).masked_fill(~visible, float("-inf"))
            x = self._norm(h, lw["n1"])
            q = self._rope((x @ lw["wq"]).view(n, cfg.q_heads, hd), pos)
            k = self._rope((x @ lw["wk"]).view(n, cfg.kv_heads, hd), pos)
            v = (x @ lw["wv"]).view(n, cfg.kv_heads, hd)
            rep = cfg.q_heads // cfg.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(n, -1)
            h = h + o @ lw["wo"]
            h = h + self._mlp(self._norm(h, lw["n2"]), lw, dt)
        return (self._norm(h, self.nf) @ self.emb.T * self.logit_scale).numpy()
