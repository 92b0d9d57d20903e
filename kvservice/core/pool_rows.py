"""A pool's rows: sequence id -> row lookups, row handles taken and grown; and the emission of the batch's tables
(phase 4).

A base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read pool.py first).
"""

from __future__ import annotations

import numpy as np

from kvservice.contract.errors import NotFound
from kvservice.core.emit import SpaceTables, emit_tables
from kvservice.core.stepplan import (
    EMPTY_I64,
    FEW,
)


class RowIndex:
    """A pool's rows (part of Pool)."""

    # Reads and writes the attributes Pool.__init__ sets.

    # ---- rows and lookups -------------------------------------------------------------------
    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of live sequences sorted by id, rebuilt after admits and frees."""
        if self._sorted is None:
            rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
            keys = self._seq_ids[rows]
            order = np.argsort(keys, kind="stable")
            self._sorted = (keys[order], rows[order])
        return self._sorted

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found) for ids, vectorised over the sorted index (a few ids: looked up in the row map, without
        rebuilding the index that every admission and free leaves stale)."""
        if len(ids) <= FEW:
            got = [self._rows.get(i, -1) for i in ids.tolist()]
            rows_few = np.array(got, dtype=np.int64)
            return np.maximum(rows_few, 0), rows_few >= 0
        keys, rows = self._index()
        if not len(keys):
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = keys.searchsorted(ids)
        np.minimum(pos, len(keys) - 1, out=pos)
        return rows[pos], keys[pos] == ids

    def _lookup(self, ids: np.ndarray, field: str) -> np.ndarray:
        if not len(ids):
            return EMPTY_I64
        if len(ids) <= FEW and -1 not in (got := [self._rows.get(i, -1) for i in ids.tolist()]):
            return np.array(got, dtype=np.int64)          # a few ids, all live: the row map's answers
        rows, found = self._find(ids)
        if not np.logical_and.reduce(found):
            missing = ids[~found][0]
            raise NotFound(f"{field}: sequence {missing} is not in pool {self.name!r}", seq_id=missing)
        return rows

    def _row_of(self, seq_id: int) -> int:
        row = self._rows.get(int(seq_id))
        if row is None:
            raise NotFound(f"sequence {seq_id} is not in pool {self.name!r}", seq_id=seq_id)
        return row

    def _take_rows(self, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        if not n:
            return EMPTY_I64
        reuse = min(n, len(self._free_rows))
        rows = [self._free_rows.pop() for _ in range(reuse)]
        fresh = n - reuse
        if fresh:
            self._grow_rows(self._num_rows + fresh)
            rows.extend(range(self._num_rows, self._num_rows + fresh))
            self._num_rows += fresh
        out = np.array(rows, dtype=np.int64)
        self._seq_ids[out] = ids
        self._rows.update(zip(ids.tolist(), rows, strict=True))
        self._sorted = None
        self._last_batch = None
        return out

    def _grow_rows(self, n: int) -> None:
        cap = len(self._num_tokens)
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        pad = new_cap - cap
        self._num_tokens = np.concatenate((self._num_tokens, np.zeros(pad, dtype=np.int64)))
        self._seq_ids = np.concatenate((self._seq_ids, np.zeros(pad, dtype=np.uint64)))
        self._held = np.concatenate((self._held, np.zeros(pad, dtype=np.int64)))
        self._first = [np.concatenate((f, np.zeros(pad, dtype=np.int64))) for f in self._first]
        for s in self._slots:
            s.grow_rows(new_cap)

    # ---- phase 4: emit -----------------------------------------------------------------
    def _emit(self, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held: np.ndarray, tok_indptr: np.ndarray,
              tables: bool, block_table: bool) -> tuple[SpaceTables, ...]:
        return emit_tables(self.plan.geometry.index_spaces, self.page_size, self._slots, self._first, self._is_sliding,
                           rows, old, new, held, tok_indptr, tables, block_table, self.allocators)
