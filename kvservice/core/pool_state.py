"""A pool as plain data (PoolState) and what keeps its arrays cheap to copy under the pool's lock.

Pool.capture_state / Pool.from_state build and read it (each component exports and restores its own part:
SlotAllocator.export_state, PrefixCache.export_state, RowSlots.gather); kvservice.state.snapshot encodes
it; kvservice.core.invariants.check_pool_state checks it against docs/DESIGN.md's invariants before a pool is
rebuilt from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POOL_STATE_VERSION = 3
#: Pool state versions read: 2 (before page generations: every slot starts at generation 0) and this release's.
POOL_STATE_VERSIONS = (2, POOL_STATE_VERSION)


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool as plain data: JSON-able ``meta`` and named 1-D/2-D NumPy ``arrays`` (copies, never views).

    meta: version (3; 2 read), name, model, incarnation, prefix_hash, prefix_hash_seed (absent in older
      snapshots: the default mode), spec {page_size, layout, layers: [[kv_heads, head_dim, dtype,
      sliding_window, count(, k_only)], ...]}, num_slots (of the largest group), group_slots (per group;
      absent in states written before groups were sized apart: every group num_slots), max_seq_len,
      backends, prefix_caching, sharing, steps, admitted, refused, alloc_failures {reason: count},
      row_capacity, num_rows, events_seq (number of the pool's last KV event batch),
      groups [{peak_used, evictions}], prefix {hits: [per group], namespaces: [[salt, extra_key, id], ...]}
      or None.
    arrays (N live sequences in row order, G layer groups, E prefix-cache entries):
      seq_ids uint64 [N]; rows int64 [N]; num_tokens int64 [N] (tokens, > 0); free_rows int64 [R]
        (reuse order: the last is taken first);
      first/<g> int64 [N]: first page still held in group g (0 unless a sliding window released pages);
      slots/<g> int64 [sum over sequences of held - first]: the slots of pages [first, held) of each
        sequence, sequences concatenated (held = ceil(num_tokens / page_size));
      free_stack/<g> int64 [F]: free slots holding nothing, bottom to top (the top is handed out first);
      cached/<g> int64 [C]: free slots holding a cached page, in eviction order; cached_stamp/<g> int64 [C]:
        the step that released each (absent in older snapshots: then their order is the stamp);
        generation/<g> int64 [num_slots]: each slot's SlotAllocator.generation (< 2^32; absent in version 2);
      per group g with prefix caching (E_g cache entries, by_hash order): prefix/<g>/hash uint64 [E],
      prefix/<g>/slot, prefix/<g>/parent, prefix/<g>/anchor, prefix/<g>/namespace int64 [E],
      prefix/<g>/parent_hash uint64 [E], prefix/<g>/tokens int64 [E, page_size], prefix/<g>/linked int64 [E]
      (1 = the entry counts as a dependant of its parent page for eviction; absent in older snapshots).
    """

    meta: dict
    arrays: dict


def spec_runs(spec: object) -> list[list]:
    runs: list[list] = []
    for la in spec.layers:                                            # type: ignore[attr-defined]
        row = [la.kv_heads, la.head_dim, la.dtype, la.sliding_window]
        if runs and runs[-1][:4] == row and bool(runs[-1][5:]) == la.k_only:
            runs[-1][4] += 1
        else:
            runs.append([*row, 1, *([True] if la.k_only else [])])   # k_only only where set: older readers
    return runs


@dataclass(frozen=True, slots=True)
class IdRuns:
    """A 1-D int64 array of n ids stored as runs of consecutive descending ids.

    starts: int64 [R], the index where each run begins (starts[0] == 0); tops: int64 [R], the run's first
    id plus its start index (element i of run k is tops[k] - i); n: elements in all.
    """

    starts: np.ndarray
    tops: np.ndarray
    n: int

    def array(self) -> np.ndarray:
        lengths = np.diff(np.append(self.starts, self.n))
        return np.repeat(self.tops, lengths) - np.arange(self.n, dtype=np.int64)


def as_array(a: np.ndarray | IdRuns) -> np.ndarray:
    return a.array() if isinstance(a, IdRuns) else a


def copy_ids(a: np.ndarray) -> np.ndarray | IdRuns:
    """A 1-D id array kept for later: IdRuns, or an int64 copy.

    A free stack is mostly runs of consecutive descending ids (all of it, in an idle pool): those
    are found by a scan in 1 M-element chunks, without allocating a copy of the whole array, so the
    caller's lock is held for a read of it only. Otherwise it is a plain copy.
    """
    n, chunk = len(a), 1 << 20
    breaks, found = [np.zeros(1, dtype=np.int64)], 0
    if n > chunk:
        for lo in range(0, n - 1, chunk):
            b = np.flatnonzero(np.diff(a[lo:min(n, lo + chunk + 1)]) != -1) + (lo + 1)
            found += len(b)
            if found > n // 64:
                break
            breaks.append(b)
        else:
            starts = np.concatenate(breaks)
            return IdRuns(starts, a[starts].astype(np.int64) + starts, n)
    return a.astype(np.int64)
