"""Phase 1 of a Step: the request checked and resolved to rows (`StepInput`), nothing changed.

A base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read pool.py first).
"""

from __future__ import annotations

import numpy as np

from kvservice.contract.errors import AlreadyExists, InvalidArgument
from kvservice.core.stepplan import (
    FEW,
    Prompt,
    StepInput,
    check_distinct,
    parse_counts,
    parse_ids,
    parse_strs,
)


class ValidatePhase:
    """Phase 1 of a Step (part of Pool)."""

    # Reads and writes the attributes Pool.__init__ sets.

    # ---- phase 1: validate ---------------------------------------------------------------
    def _validate(self, free_ids: object, extend_ids: object, extend_tokens: object, admit_ids: object,
                  admit_tokens: object, fork_parents: object, fork_children: object, admit_token_ids: object,
                  admit_salts: object, admit_extra_keys: object, count_ranges: tuple) -> StepInput:
        f_ids = parse_ids("free_seq_ids", free_ids)
        e_ids = parse_ids("extend_seq_ids", extend_ids)
        a_ids = parse_ids("admit_seq_ids", admit_ids)
        p_ids = parse_ids("fork_parent_ids", fork_parents)
        c_ids = parse_ids("fork_child_ids", fork_children)
        e_k = parse_counts("extend_num_tokens", extend_tokens, len(e_ids), known=count_ranges[0])
        a_n = parse_counts("admit_num_tokens", admit_tokens, len(a_ids), known=count_ranges[1])
        if len(p_ids) != len(c_ids):
            raise InvalidArgument(f"fork_parent_ids has {len(p_ids)} entries, fork_child_ids {len(c_ids)}")
        extend_only = not (len(f_ids) or len(a_ids) or len(c_ids)) and len(e_ids) > 0
        e_rows = self._last_rows_if_same(e_ids) if extend_only else None
        if not (repeat := e_rows is not None):
            parts = [a for a in (f_ids, e_ids, a_ids, c_ids) if len(a)]
            if len(parts) > 1:
                check_distinct(np.concatenate(parts))
            elif parts:
                check_distinct(parts[0])
            e_rows = self._lookup(e_ids, "extend_seq_ids")
        f_rows = self._lookup(f_ids, "free_seq_ids")
        p_rows = self._lookup(p_ids, "fork_parent_ids")
        new_ids = np.concatenate((a_ids, c_ids)) if len(c_ids) else a_ids
        if len(new_ids) and (len(new_ids) > FEW or not self._rows.keys().isdisjoint(new_ids.tolist())):
            known = self._find(new_ids)[1]
            if np.logical_or.reduce(known):
                taken = new_ids[known][0]
                raise AlreadyExists(f"sequence {taken} is already in pool {self.name!r}", seq_id=taken)
        if len(p_ids) and len(f_ids) and np.isin(p_ids, f_ids).any():
            raise InvalidArgument(f"fork parent {p_ids[np.isin(p_ids, f_ids)][0]} is freed in the same step")
        e_new = self._num_tokens[e_rows] + e_k
        for name, n, ids in (("extend", e_new, e_ids), ("admit", a_n, a_ids)):
            if len(n) and (max(n.tolist()) if len(n) <= FEW else int(np.maximum.reduce(n))) > self.max_seq_len:
                j = int(np.argmax(n))
                raise InvalidArgument(
                    f"{name}: sequence {ids[j]} would hold {n[j]} tokens; pool {self.name!r} takes at most "
                    f"max_seq_len={self.max_seq_len}", seq_id=ids[j], max_seq_len=self.max_seq_len)
        prompt = self._prompt(a_n, admit_token_ids, admit_salts, admit_extra_keys)
        return StepInput(f_ids, e_ids, e_k, a_ids, a_n, p_ids, c_ids, f_rows, e_rows, p_rows, prompt, extend_only,
                         repeat, e_new)

    def _last_rows_if_same(self, e_ids: np.ndarray) -> np.ndarray | None:
        """The rows of the last extend-only step if e_ids is that batch again (checked distinct and live then)."""
        last = self._last_batch
        if last is not None and len(last[0]) == len(e_ids) and last[0].dtype == e_ids.dtype \
                and last[0].tobytes() == e_ids.tobytes():
            return last[1]
        return None

    def _prompt(self, a_n: np.ndarray, token_ids: object, salts: object, keys: object) -> Prompt | None:
        """Prefix-cache inputs of the admissions, or None when caching is off or no token ids were given."""
        a = len(a_n)
        if a:      # counted on every pool, with or without prefix caching or token ids: never ignored silently
            salt_list, key_list = parse_strs("admit_cache_salts", salts, a), parse_strs("admit_extra_keys", keys, a)
        else:
            # One salt and extra key per admission and sum(admit_tokens) token ids: with none, nothing.
            for name, values in (("admit_token_ids", token_ids), ("admit_cache_salts", salts),
                                 ("admit_extra_keys", keys)):
                if values is not None and len(np.asarray(values)):
                    raise InvalidArgument(f"{name} given for a step with no admissions; send it only with "
                                          "admit_seq_ids (one entry per admission, token ids: their sum)")
            return None
        if token_ids is None or self.prefix is None:
            if token_ids is not None and self.prefix is None and len(np.asarray(token_ids)):
                raise InvalidArgument(f"pool {self.name!r} was created without prefix caching; "
                                      "admit_token_ids are not accepted")
            return None
        tok = np.asarray(token_ids)
        if tok.ndim != 1 or tok.dtype.kind not in "iu":
            raise InvalidArgument(f"admit_token_ids must be a 1-D integer array, got shape {tok.shape} dtype "
                                  f"{tok.dtype}")
        if len(tok) != (int(a_n[0]) if a == 1 else int(np.add.reduce(a_n))):
            raise InvalidArgument(f"admit_token_ids has {len(tok)} ids; admit_num_tokens add up to {int(a_n.sum())}")
        ns, new_ns = self.prefix.namespace_ids(salt_list, key_list)
        ps = self.page_size
        full = a_n // ps
        tok = tok.astype(np.int64, copy=False)
        if a == 1:                                          # one prompt: its full pages are a view
            n = int(full[0])
            page_start = np.zeros(1, dtype=np.int64)
            row = np.zeros(n, dtype=np.int64)
            col = np.arange(n, dtype=np.int64)
            pages = tok[:n * ps].reshape(n, ps)
        else:                                               # [N, ps]: O(prompt tokens), never A x longest
            n = int(np.add.reduce(full))
            page_start = full.cumsum() - full               # first page of each prompt
            row = np.arange(a, dtype=np.int64).repeat(full)
            col = np.arange(n, dtype=np.int64) - page_start[row]
            tok_start = a_n.cumsum() - a_n
            pages = np.concatenate([tok[s:s + f * ps].reshape(f, ps)
                                    for s, f in zip(tok_start.tolist(), full.tolist(), strict=True)])
        limit = (a_n - 1) // ps                      # at least one token of each prompt is computed
        hashes = self.prefix.hash_fn(pages, col, page_start, full, ns) if n else np.zeros(0, dtype=np.uint64)
        return Prompt(pages, row, col, full, limit, ns, hashes, new_ns)
