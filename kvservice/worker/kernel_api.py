"""Shared kernel API: reasons, policy, violation records, page layouts, argument checks, and the calls
both compiled backends launch (``kvservice.worker.kernels_cpu`` -- g++ host emulation,
``kvservice.worker.kernels_cuda`` -- CuPy); which entry and how many splits a launch takes:
``kvservice.worker.launch_plan``.

Array conventions (FlashInfer-style; ``xp`` is NumPy or CuPy):

- cache dtypes: ``float16``, ``bfloat16`` (stored as ``uint16`` bit patterns,
  NumPy/CuPy have no bfloat16), ``float32``.
- page tables: ``indptr`` int32 [batch + 1], ``indices`` int32 [nnz],
  ``last_page_len`` int32 [batch] in (0, page_size]; ``slot_mapping`` int64.
- page generations (optional, checked and recorded): ``kvservice.worker.generations``.
  What a valid table is, and the reason/row/position/value of each violation, is
  defined once in ``kvservice.contract.pagetable`` (module docstring); the kernels and
  ``kvservice.worker.ops_numpy`` implement exactly that.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvservice.contract import pagetable
from kvservice.worker import generations as gens
from kvservice.worker.launch_plan import THREADS, VEC, decode_entry, default_splits, heads_per_block
from kvservice.worker.page_layout import DTYPES, PageLayout

#: Reason names by kernel reason code (paged.cuh KV_*): 0 ok, then pagetable.WORKER_REASONS (..., stale_page).
REASONS: tuple[str, ...] = ("ok", *pagetable.WORKER_REASONS)
NO_KEY = 0xFFFFFFFFFFFFFFFF


class Policy(enum.IntEnum):
    """What a caller gets for a row that hit a violation."""

    NAN = 0
    ZEROS = 1
    ERROR = 2


@dataclass(frozen=True)
class ViolationRecord:
    """Exact, deterministic summary of one call's bounds violations.

    ``count``: offending entries (each table entry / token / pair entry once).
    ``row``, ``position``: the smallest (row, position); position -1 means a
    row-level field (indptr, last_page_len). ``value``: the offending value.
    ``reason``: one of ``REASONS[1:]`` or None when count == 0.
    """

    kernel: str
    count: int = 0
    row: int = -1
    position: int = -1
    value: int = 0
    reason: str | None = None

    @classmethod
    def from_words(cls, kernel: str, words: np.ndarray) -> ViolationRecord:
        w = np.asarray(words, dtype=np.uint64)
        count = int(w[0])
        if count == 0:
            return cls(kernel)
        signed = w.view(np.int64)
        return cls(kernel, count, int(signed[2]), int(signed[3]), int(signed[4]), REASONS[int(w[5])])

    def __bool__(self) -> bool:
        return self.count > 0


class KernelViolationError(RuntimeError):
    """Raised after a call under ``Policy.ERROR`` that hit a violation."""

    def __init__(self, record: ViolationRecord) -> None:
        super().__init__(
            f"{record.kernel}: {record.count} page-table violation(s); first at row "
            f"{record.row}, position {record.position}: value {record.value} ({record.reason})"
        )
        self.record = record


def new_record_words() -> np.ndarray:
    w = np.zeros(8, dtype=np.uint64)
    w[1] = NO_KEY
    return w


@dataclass
class ValidationResult:
    row_status: Any  # int32 [batch], bit (reason-1) per reason seen, 0 = clean
    record: ViolationRecord


# ---- argument checks -------------------------------------------------------------
def check_array(name: str, a: Any, shape: Sequence[int | None], dtype: Any, doc: str) -> None:
    """Check ndim/shape/dtype/C-contiguity; ``None`` in shape = any extent."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected an array {doc}, got {type(a).__name__}")
    if len(a.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape, strict=True)):
        raise ValueError(f"{name}: expected shape {doc} = {tuple(shape)}, got {tuple(a.shape)}")
    if np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def check_cache(name: str, cache: Any, layout: PageLayout, ptr: int) -> None:
    layout.validate()
    if np.dtype(cache.dtype) != np.dtype(DTYPES[layout.dtype]):
        raise TypeError(f"{name}: expected dtype {np.dtype(DTYPES[layout.dtype])} for {layout.dtype}, "
                        f"got {cache.dtype}")
    if not cache.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if cache.size < layout.required_elems:
        raise ValueError(f"{name}: layout needs {layout.required_elems} elements "
                         f"({layout.num_pages} pages x page_stride {layout.page_stride}), "
                         f"buffer has {cache.size}")
    if ptr % 16:
        raise ValueError(f"{name}: base address must be 16-byte aligned")


def _check_gens(name: str, g: Any, n: int | tuple[int, int], page_gens: Any, layout: PageLayout, what: str) -> bool:
    return gens.check_generations(name, g, n, page_gens, layout.num_pages, what, check_array)


def empty_batch_record(kernel: str, indptr: np.ndarray, nnz: int) -> ViolationRecord:
    """A table of 0 rows (no kernel runs): bad_indptr at row -1 unless indptr == [0] and
    nnz == 0 (kvservice.contract.pagetable rule 1). indptr: host int32 [1]."""
    first = int(indptr[0])
    if first == 0 and nnz == 0:
        return ViolationRecord(kernel)
    return ViolationRecord(kernel, 1, -1, -1, first, "bad_indptr")


def check_csr(indptr: Any, indices: Any, last_page_len: Any) -> int:
    """Shapes/dtypes of a CSR table; returns batch. Values are checked on the device."""
    if len(getattr(indptr, "shape", ())) != 1 or indptr.shape[0] < 1:
        raise ValueError("indptr: expected shape [batch + 1]")
    batch = int(indptr.shape[0]) - 1
    check_array("indptr", indptr, (batch + 1,), np.int32, "[batch + 1]")
    check_array("indices", indices, (None,), np.int32, "[nnz]")
    check_array("last_page_len", last_page_len, (batch,), np.int32, "[batch]")
    if indices.shape[0] >= 2**31 - 1:
        raise ValueError("indices: nnz must be < 2^31 - 1")
    return batch


def _first_repeat(values: np.ndarray) -> int:
    s = np.sort(values)
    return int(s[1:][s[1:] == s[:-1]][0])


#: slot_mapping value of a token the layer does not hold (a prefix hit's tokens before a sliding
#: window): append writes nothing for it and counts no violation, as vLLM's padding slot.
SKIP_SLOT = -1


def check_distinct_slots(xp: Any, slot_mapping: Any) -> None:
    """append: slot_mapping entries must be pairwise distinct (two writes of one token slot
    land in an undefined order on a GPU), SKIP_SLOT entries aside. ValueError before anything
    is written. Costs a sort and, on a GPU, one scalar read back."""
    n = slot_mapping.shape[0]
    if n > 1:
        s = xp.sort(slot_mapping)
        s = s[s != SKIP_SLOT]
        if len(s) > 1 and bool((s[1:] == s[:-1]).any()):
            v = _first_repeat(np.asarray(s.get() if hasattr(s, "get") else s))
            raise ValueError(f"slot_mapping: slot {v} appears more than once; every token needs its own slot "
                             "(duplicate writes are unordered on a GPU), nothing was written")


def check_copy_pairs(xp: Any, pairs: Any, what: str = "page") -> None:
    """copy: destinations pairwise distinct and none of them also a source (the copies of
    one call run in an undefined order on a GPU). ValueError before anything is copied."""
    n = pairs.shape[0]
    if n == 0:
        return
    dst = xp.sort(pairs[:, 1])
    if n > 1 and bool((dst[1:] == dst[:-1]).any()):
        v = _first_repeat(np.asarray(dst.get() if hasattr(dst, "get") else dst))
        raise ValueError(f"pairs: destination {what} {v} appears more than once; destinations must be "
                         "distinct, nothing was copied")
    both = xp.isin(pairs[:, 0], dst)
    if bool(both.any()):
        host = np.asarray(pairs.get() if hasattr(pairs, "get") else pairs)
        v = int(host[np.isin(host[:, 0], host[:, 1]), 0][0])
        raise ValueError(f"pairs: {what} {v} is both a source and a destination; copy in two calls, "
                         "nothing was copied")


class Backend(Protocol):
    xp: Any
    sms: int

    def resident_blocks(self, name: str, block: int) -> int:
        """Blocks of kernel ``name`` (``block`` threads) one SM holds at once."""
        ...

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any]) -> None: ...
    def ptr(self, a: Any) -> int: ...
    def to_host(self, a: Any) -> np.ndarray: ...


# ---- launch planning shared by the compiled backends ------------------------------
NULL = np.uint64(0)
I64 = np.int64
F32 = np.float32
class KernelCall:
    """Handle on a launched kernel; ``record`` reads its violation record lazily."""

    def __init__(self, kernel: str, words: Any, to_host: Any) -> None:
        self._words, self._to_host, self._kernel = words, to_host, kernel
        self._record: ViolationRecord | None = None

    @property
    def record(self) -> ViolationRecord:
        if self._record is None:
            words = new_record_words() if self._words is None else self._to_host(self._words)
            self._record = ViolationRecord.from_words(self._kernel, words)
        return self._record

    def raise_if(self, policy: Policy) -> None:
        if policy == Policy.ERROR and self.record:
            raise KernelViolationError(self.record)


class AttentionCall(KernelCall):
    """``out`` float32 [batch, q_heads, head_dim]; ``lse`` float32 [batch, q_heads]
    (natural log of the softmax denominator of sm_scale-scaled scores)."""

    def __init__(self, out: Any, lse: Any, words: Any, to_host: Any) -> None:
        super().__init__("decode_attention", words, to_host)
        self.out, self.lse = out, lse


def _space(layout: PageLayout) -> list[Any]:
    """Kernel arguments of the index space, in KvLayout order: scale, offset, base, upper_bound, pool_pages."""
    return [I64(layout.scale), I64(layout.offset), I64(layout.base), I64(layout.upper_bound),
            I64(layout.pool_pages)]


def _geometry(layout: PageLayout) -> list[Any]:
    return [I64(layout.page_stride), I64(layout.page_size), I64(layout.kv_heads), I64(layout.head_dim)]


def append_kv(be: Backend, cache: Any, layout: PageLayout, k: Any, v: Any, slot_mapping: Any,
              *, policy: Policy = Policy.NAN, slot_generations: Any = None, page_gen: Any = None) -> KernelCall:
    """Write K/V of n new tokens into ``cache`` at ``slot_mapping``.

    cache: the layer's buffer (any shape, C-contiguous, storage dtype of layout.dtype);
    k, v: shape [n, kv_heads, head_dim], storage dtype of layout.dtype; v is None for a K-only layout
        (an MLA layer's latent vectors go in k);
    slot_mapping: shape [n], dtype int64, value = page * page_size + offset, or SKIP_SLOT (-1) for a
        token this layer does not hold (written nowhere, not a violation).
    slot_generations [n], page_gen: kvservice.worker.generations (a stale write is stale_page).
    Offending tokens (negative, page out of range, off lattice, stale) are not written.
    """
    check_cache("cache", cache, layout, be.ptr(cache))
    n = int(getattr(slot_mapping, "shape", (0,))[0]) if hasattr(slot_mapping, "shape") else -1
    shape = (n, layout.kv_heads, layout.head_dim)
    check_array("slot_mapping", slot_mapping, (n,), np.int64, "[n]")
    check_array("k", k, shape, DTYPES[layout.dtype], "[n, kv_heads, head_dim]")
    check_v(v, shape, layout)
    _check_gens("slot_generations", slot_generations, n, page_gen, layout, "[n]")
    if n == 0:
        return KernelCall("append_kv", None, be.to_host)
    check_distinct_slots(be.xp, slot_mapping)
    words = be.xp.asarray(new_record_words())
    be.launch("kv_append", (n, 1, 1), THREADS,
              [k, NULL if v is None else v, slot_mapping, I64(n), cache, I64(layout.itemsize), *_geometry(layout),
               *_space(layout), *gens.pointers(slot_generations, page_gen), words])
    call = KernelCall("append_kv", words, be.to_host)
    call.raise_if(policy)
    return call


def check_v(v: Any, shape: tuple[int, int, int], layout: PageLayout) -> None:
    """append: v like k, or None exactly when the layout is K-only (an MLA latent layer)."""
    if layout.k_only:
        if v is not None:
            raise ValueError("v: this layer is K-only (a multi-head latent attention latent cache); "
                             "send the latent vectors as k and no v")
        return
    check_array("v", v, shape, DTYPES[layout.dtype], "[n, kv_heads, head_dim]")


def refuse_k_only(layout: PageLayout) -> None:
    """decode_attention: a K-only layout is an MLA latent cache, which these kernels do not attend."""
    if layout.k_only:
        raise ValueError("decode attention over a multi-head latent attention (MLA) latent cache is not "
                         "implemented by these kernels (they attend K and V per head); run an MLA decode "
                         "kernel (FlashMLA, FlashInfer's MLA) on the same page tables")


def decode_attention(be: Backend, q: Any, cache: Any, layout: PageLayout, indptr: Any, indices: Any,
                     last_page_len: Any, *, sm_scale: float | None = None, window: int = 0,
                     policy: Policy = Policy.NAN, kv_chunk_pages: int | None = None,
                     max_pages: int | None = None, out: Any = None, lse: Any = None,
                     generations: Any = None, page_gen: Any = None) -> AttentionCall:
    """Paged decode attention (one query token per row) with GQA.

    q: shape [batch, num_q_heads, head_dim], storage dtype of layout.dtype;
    cache: the layer's buffer; indptr: [batch + 1] int32; indices: [nnz] int32;
    last_page_len: [batch] int32 in (0, page_size]. ``window`` > 0 attends the
    last ``window`` tokens only. ``kv_chunk_pages``: pages per split for the
    split-KV path (0 = never split, None = automatic). ``max_pages``: optional
    host-side bound on pages per row (avoids reading indptr back).
    out: optional float32 [batch, num_q_heads, head_dim]; lse: optional float32
    [batch, num_q_heads] (allocated when omitted). A K-only (MLA) layout is refused (ValueError).
    generations [nnz], page_gen: kvservice.worker.generations (a stale page is never read: policy).
    """
    refuse_k_only(layout)
    check_cache("cache", cache, layout, be.ptr(cache))
    batch = check_csr(indptr, indices, last_page_len)
    _check_gens("generations", generations, int(indices.shape[0]), page_gen, layout, "[nnz]")
    hq = int(q.shape[1]) if len(getattr(q, "shape", ())) == 3 else -1
    check_array("q", q, (batch, hq, layout.head_dim), DTYPES[layout.dtype], "[batch, num_q_heads, head_dim]")
    if hq <= 0 or hq % layout.kv_heads:
        raise ValueError(f"q: num_q_heads {hq} must be a positive multiple of kv_heads {layout.kv_heads}")
    xp = be.xp
    out, lse = attention_outputs(xp, out, lse, batch, hq, layout.head_dim)
    if batch == 0:
        call = AttentionCall(out, lse, None, be.to_host)
        call._record = empty_batch_record("decode_attention", be.to_host(indptr), indices.shape[0])
        call.raise_if(policy)
        return call
    scale = 1.0 / math.sqrt(layout.head_dim) if sm_scale is None else float(sm_scale)
    gm = heads_per_block(hq // layout.kv_heads, layout.head_dim)
    groups = layout.kv_heads * math.ceil(hq // layout.kv_heads / gm)
    entry = decode_entry(layout.dtype, hq // layout.kv_heads, layout.head_dim)
    pps = kv_chunk_pages
    if pps is None or pps > 0:
        if max_pages is None:
            ip = be.to_host(indptr).astype(np.int64)
            max_pages = int(max(0, (ip[1:] - ip[:-1]).max()))
        if window > 0:
            max_pages = min(max_pages, (window - 1) // layout.page_size + 2)
        if pps is None:
            pps = default_splits(batch * groups, max_pages, be.sms * be.resident_blocks(entry, THREADS))
    splits = max(1, math.ceil(max_pages / pps)) if pps else 1
    if splits > 65535:
        raise ValueError(f"kv_chunk_pages {pps} gives {splits} splits (max 65535)")
    words = xp.asarray(new_record_words())
    common = [q, cache, *_geometry(layout), *_space(layout), indptr, indices, last_page_len,
              I64(indices.shape[0]), I64(batch), I64(hq), I64(window), F32(scale)]
    g = gens.pointers(generations, page_gen)
    grid = (batch, groups, splits)
    if splits == 1:
        be.launch(entry, grid, THREADS,
                  [*common, I64(0), I64(int(policy)), *g, out, lse, NULL, NULL, NULL, words])
    else:
        p_out = xp.empty((splits, batch, hq, layout.head_dim), dtype=np.float32)
        p_lse = xp.empty((splits, batch, hq), dtype=np.float32)
        p_flag = xp.empty((splits, batch), dtype=np.int32)
        be.launch(entry, grid, THREADS,
                  [*common, I64(pps), I64(int(policy)), *g, NULL, NULL, p_out, p_lse, p_flag, words])
        be.launch("kv_decode_merge", (batch, hq, 1), THREADS,
                  [p_out, p_lse, p_flag, I64(splits), I64(batch), I64(hq), I64(layout.head_dim),
                   I64(int(policy)), out, lse])
    call = AttentionCall(out, lse, words, be.to_host)
    call.raise_if(policy)
    return call


def attention_outputs(xp: Any, out: Any, lse: Any, batch: int, hq: int, d: int) -> tuple[Any, Any]:
    """Check caller-provided outputs or allocate them."""
    if out is None:
        out = xp.empty((batch, hq, d), dtype=np.float32)
    if lse is None:
        lse = xp.empty((batch, hq), dtype=np.float32)
    check_array("out", out, (batch, hq, d), np.float32, "[batch, num_q_heads, head_dim]")
    check_array("lse", lse, (batch, hq), np.float32, "[batch, num_q_heads]")
    return out, lse


def copy_blocks(be: Backend, caches: Sequence[Any], layout: PageLayout, pairs: Any,
                *, policy: Policy = Policy.NAN, generations: Any = None,
                page_gens: Sequence[Any] | None = None) -> KernelCall:
    """Copy whole pages ``pairs[i] = (src_page, dst_page)`` in every buffer of ``caches``.

    caches: buffers sharing ``layout`` (same index space and page geometry);
    pairs: shape [n, 2], dtype int64, page indices in that index space. A pair
    with an offending entry is skipped. For an interleaved group, one call per
    index space (or one call over whole slots with a slot-sized layout).
    generations [n, 2], page_gens (one per buffer): kvservice.worker.generations (stale: once per buffer).
    """
    if not caches:
        raise ValueError("caches: need at least one buffer")
    for i, c in enumerate(caches):
        check_cache(f"caches[{i}]", c, layout, be.ptr(c))
    n = int(pairs.shape[0]) if len(getattr(pairs, "shape", ())) == 2 else -1
    check_array("pairs", pairs, (n, 2), np.int64, "[n, 2]")
    if len(caches) > 65535:
        raise ValueError("caches: at most 65535 layers per call")
    if page_gens is not None and len(page_gens) != len(caches):
        raise ValueError(f"page_gens: one record per buffer of caches ({len(caches)}), got {len(page_gens)}")
    checked = _check_gens("generations", generations, (n, 2), page_gens, layout, "[n, 2]")
    if n == 0:
        return KernelCall("copy_blocks", None, be.to_host)
    check_copy_pairs(be.xp, pairs)
    ptrs = be.xp.asarray(np.array([be.ptr(c) for c in caches], dtype=np.uint64))
    gen_ptrs = be.xp.asarray(np.array([be.ptr(g) for g in page_gens], dtype=np.uint64)) if checked else NULL
    words = be.xp.asarray(new_record_words())
    be.launch("kv_copy_blocks", (n, len(caches), 1), THREADS,
              [ptrs, pairs, I64(n), I64(layout.page_elems * layout.itemsize),
               I64(layout.page_stride * layout.itemsize), *_space(layout), *gens.pointers(generations), gen_ptrs,
               words])
    call = KernelCall("copy_blocks", words, be.to_host)
    call.raise_if(policy)
    return call


def validate_page_table(be: Backend, indptr: Any, indices: Any, last_page_len: Any,
                        layout: PageLayout, *, generations: Any = None, page_gen: Any = None) -> ValidationResult:
    """Check a CSR table on the device. Returns int32 [batch] row status
    (bit reason-1 per reason seen, 0 = clean) and the violation record; generations as decode_attention's."""
    batch = check_csr(indptr, indices, last_page_len)
    _check_gens("generations", generations, int(indices.shape[0]), page_gen, layout, "[nnz]")
    status = be.xp.zeros((batch,), dtype=np.int32)
    if batch == 0:
        return ValidationResult(status, empty_batch_record("validate_page_table", be.to_host(indptr),
                                                           indices.shape[0]))
    words = be.xp.asarray(new_record_words())
    be.launch("kv_validate_page_table", (batch, 1, 1), THREADS,
              [indptr, indices, last_page_len, I64(batch), I64(indices.shape[0]), I64(layout.page_size),
               *_space(layout), *gens.pointers(generations, page_gen), status, words])
    return ValidationResult(status, ViolationRecord.from_words("validate_page_table", be.to_host(words)))


def widen(be: Backend, x: Any, dtype: str) -> Any:
    """x: 1-D storage array of a 16-bit cache dtype (``float16``, or ``bfloat16`` as uint16
    bits), 16-byte aligned. Returns float32 [n], converted by the attention kernels' own loads."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    check_array("x", x, (None,), DTYPES[dtype], "[n]")
    if be.ptr(x) % 16:
        raise ValueError("x: base address must be 16-byte aligned")
    n = int(x.shape[0])
    out = be.xp.empty((n,), dtype=np.float32)
    if n:
        blocks = min(1024, max(1, math.ceil(n / (THREADS * VEC[dtype]))))
        be.launch("kv_widen_f16" if dtype == "float16" else "kv_widen_bf16", (blocks, 1, 1), THREADS,
                  [x, out, I64(n)])
    return out
