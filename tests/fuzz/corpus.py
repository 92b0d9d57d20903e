"""Fuzz corpus: the hostile requests of issue #11, one entry per shape, kept so they run on every test run.

Each entry is a request (built from the pool state it needs) and the status it must get. test_corpus.py
sends every entry to a memory-only and a durable manager and checks that nothing changed, the journal
did not fail stop, and the server answers. The hypothesis fuzzers draw the same shapes at random
(support.garbage_tensor: wrapping shapes; test_fuzz_manager: reply-size edges).

Shapes:
- declared size vs data (item 1): a Tensor whose int64 shape product wraps to the item count of its data
  (0 or 1), or that NumPy cannot describe even with no data, in Step and ValidatePageTable fields.
- reply over the message limit (item 3): a Step whose reply would pass the server's limit (slot mappings
  of many index spaces, tables of long sequences, block tables), refused before it is applied.
- counts that wrap the pool's int64 arithmetic (item 8): extensions near 2^63 (or uint64 2^64 - 1) in a
  step that also admits thousands of sequences, with the server's token and sequence caps off.
- a prefix-cache lookup padded to the longest prompt (found with item 8): one long prompt among a
  thousand one-token admissions, a 170 KB request the pool would have padded to 1024 x 20,000 int64s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb


def u64(vals) -> cpb.Tensor:
    return cpb.Tensor(dtype=cpb.UINT64, data=np.asarray(vals, dtype="<u8").tobytes())


def i64(vals) -> cpb.Tensor:
    return cpb.Tensor(dtype=cpb.INT64, data=np.asarray(vals, dtype="<i8").tobytes())


@dataclass(frozen=True)
class Entry:
    name: str
    rpc: str
    request: Callable[[], object]    # built lazily (some are large)
    code: grpc.StatusCode
    words: str                       # in the status message
    reason: str = ""                 # ErrorInfo.reason, when the entry checks it


WRAP = cpb.Tensor(dtype=cpb.UINT64, shape=[2**32, 2**32])                     # product 2^64 wraps to 0
WRAP_ONE = cpb.Tensor(dtype=cpb.UINT64, shape=[274177, 67280421310721],      # = 2^64 + 1, wraps to 1
                      data=np.array([7], "<u8").tobytes())
HUGE_EMPTY = cpb.Tensor(dtype=cpb.INT32, shape=[2**31, 0, 2**31])             # no data, no NumPy array either


def _table(**override: cpb.Tensor) -> pb.ValidatePageTableRequest:
    r = pb.ValidatePageTableRequest(pool="narrow", layer=0, indptr=i64([0, 1]), indices=i64([0]),
                                    last_page_len=cpb.Tensor(dtype=cpb.INT32, data=np.array([1], "<i4").tobytes()))
    for field, t in override.items():
        getattr(r, field).CopyFrom(t)
    return r


def _admit(pool: str, counts, start: int = 1, **flags: bool) -> pb.StepRequest:
    n = len(counts)
    return pb.StepRequest(pool=pool, admit_seq_ids=u64(np.arange(start, start + n)), admit_num_tokens=i64(counts),
                          **flags)


def setup_step(pool: str, seq_id: int, tokens: int) -> pb.StepRequest:
    return _admit(pool, [tokens], start=seq_id, omit_tables=True)


def _wrapping_counts(dtype: str, value: int) -> pb.StepRequest:
    """Extend the two live sequences by ~2^63 tokens while admitting 8,192 new ones (item 8's step had 65,536:
    a request that size does not pass this corpus's 256 KiB message limit; tests/unit/test_limits.py sends it)."""
    r = pb.StepRequest(pool="narrow", extend_seq_ids=u64([1, 2]),
                       extend_num_tokens=cpb.Tensor(dtype=cpb.INT64 if dtype == "<i8" else cpb.UINT64,
                                                    data=np.array([value, value - 2], dtype).tobytes()))
    r.admit_seq_ids.CopyFrom(u64(np.arange(10_000, 10_000 + 8_192)))
    r.admit_num_tokens.CopyFrom(i64(np.ones(8_192)))
    return r


#: Pools every server of test_corpus.py starts with (name, layers, layout, num_slots, max_seq_len, prefix caching).
#: "wide": 16 index spaces (interleaved layers), so 16 slot mappings per new token.
POOLS = (("narrow", 2, "per_layer", 200_000, 4096, False), ("wide", 16, "interleaved", 8192, 4096, False),
         ("cached", 2, "per_layer", 4096, 32768, True))
#: Sequences admitted first, one per step, as (pool, id, tokens): extensions then have pages to list.
SETUP = (("narrow", 1, 5), ("narrow", 2, 5), *(("wide", i, 1000) for i in range(1, 81)))
MESSAGE_LIMIT = 256 << 10
WIDE_ROWS = list(range(1, 81))

ENTRIES = (
    # ---- item 1: declared size vs data --------------------------------------------------------
    Entry("step_shape_product_wraps_to_zero", "Step",
          lambda: pb.StepRequest(pool="narrow", admit_seq_ids=WRAP, admit_num_tokens=i64([])),
          grpc.StatusCode.INVALID_ARGUMENT, "declares 18446744073709551616 items but the data holds 0"),
    Entry("step_shape_product_wraps_to_one", "Step",
          lambda: pb.StepRequest(pool="narrow", free_seq_ids=WRAP_ONE),
          grpc.StatusCode.INVALID_ARGUMENT, "but the data holds 1"),
    Entry("step_counts_shape_without_numpy_array", "Step",
          lambda: pb.StepRequest(pool="narrow", extend_seq_ids=u64([]), extend_num_tokens=HUGE_EMPTY),
          grpc.StatusCode.INVALID_ARGUMENT, "more than 2^62 bytes"),
    Entry("validate_indptr_wraps", "ValidatePageTable", lambda: _table(indptr=WRAP),
          grpc.StatusCode.INVALID_ARGUMENT, "indptr: shape [4294967296, 4294967296] declares"),
    Entry("validate_indices_without_numpy_array", "ValidatePageTable", lambda: _table(indices=HUGE_EMPTY),
          grpc.StatusCode.INVALID_ARGUMENT, "more than 2^62 bytes"),
    # ---- item 3: reply over the message limit -------------------------------------------------
    # 2,400 new tokens x 16 spaces x 8 bytes = 307 KB of slot mappings
    Entry("step_slot_mappings_over_limit", "Step", lambda: _admit("wide", [600] * 4, start=100),
          grpc.StatusCode.RESOURCE_EXHAUSTED, "split it into smaller steps", "REPLY_TOO_LARGE"),
    # decode of 80 rows of 63 pages: 80 x 63 x 16 spaces x (4 + 4) bytes = 645 KB of CSR tables and generations
    Entry("step_tables_over_limit", "Step",
          lambda: pb.StepRequest(pool="wide", extend_seq_ids=u64(WIDE_ROWS), extend_num_tokens=i64([1] * 80)),
          grpc.StatusCode.RESOURCE_EXHAUSTED, "set omit_tables", "REPLY_TOO_LARGE"),
    # 24 rows: the CSR tables and their generations fit (220 KB), with the block tables (98 KB more) the reply does not
    Entry("step_block_tables_over_limit", "Step",
          lambda: pb.StepRequest(pool="wide", extend_seq_ids=u64(WIDE_ROWS[:24]), extend_num_tokens=i64([1] * 24),
                                 include_block_table=True),
          grpc.StatusCode.RESOURCE_EXHAUSTED, "leave include_block_table off", "REPLY_TOO_LARGE"),
    # ---- item 8: counts that wrap the pool's int64 sums ----------------------------------------
    Entry("step_extension_near_2_63_with_8192_admissions", "Step", lambda: _wrapping_counts("<i8", 2**63 - 1),
          grpc.StatusCode.INVALID_ARGUMENT, "max_seq_len=4096", "OVER_MAX_SEQ_LEN"),
    Entry("step_uint64_extension_2_64_minus_1", "Step", lambda: _wrapping_counts("<u8", 2**64 - 1),
          grpc.StatusCode.INVALID_ARGUMENT, "max_seq_len=4096", "OVER_MAX_SEQ_LEN"),
)
