"""The first two phases of a Step: validate the request, then plan it (pure: nothing changes).

``Pool.step`` runs ``validate -> plan -> commit -> emit``. This module holds the
request parsing (`StepInput`), the prefix-cache inputs of admissions (`Prompt`)
and the plan (`StepPlan`, one `GroupPlan` per layer group): exactly how many
slots each group needs and has, which pages sliding windows release, which
extended rows copy their last page first, and which cached pages admissions
take. The commit then only carries the plan out, so a refused step changes
nothing.

Order of a step (what every later part sees): frees, then forks (a child is a
copy of its parent as it was before this step), then extensions (window
release, copy-on-write, new pages), then admissions (prefix hits, new pages).
Prefix hits are pinned before any page is allocated, so a step never evicts a
cached page that one of its own admissions takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import sub

import numpy as np

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import MAX_COUNT

EMPTY_IDS = np.zeros(0, dtype=np.uint64)
EMPTY_I64 = np.zeros(0, dtype=np.int64)
#: Up to this many ids or counts are checked as Python ints (fewer NumPy calls); more as arrays.
FEW = 8


def parse_ids(name: str, a: object) -> np.ndarray:
    """A 1-D array of sequence ids as uint64; InvalidArgument for anything else."""
    if a is None:
        return EMPTY_IDS
    if type(a) is list and 0 < len(a) <= FEW and all(type(v) is int and 0 <= v < 1 << 63 for v in a):
        return np.array(a, dtype=np.uint64)          # a few valid Python ints (anything else: checked below)
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.dtype.kind == "i" and len(arr) and np.minimum.reduce(arr) < 0:
        raise InvalidArgument(f"{name} holds a negative sequence id ({arr.min()})")
    return arr.astype(np.uint64, copy=False)




def parse_counts(name: str, a: object, n: int, max_value: int = MAX_COUNT,
                 known: tuple[int, int] | None = None) -> np.ndarray:
    """Token counts, one per id, each in [1, max_value], as int64.

    known: (min, max) of `a` as the caller computed them from this same array (a Step's request decoded
    once: kvservice.manager.step_input), so they are not reduced again; None: computed here.
    """
    if a is None:
        a = EMPTY_I64
    elif type(a) is list and 0 < len(a) == n <= FEW and all(type(v) is int and 0 < v <= max_value for v in a):
        return np.array(a, dtype=np.int64)          # a few valid Python ints (anything else: checked below)
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if len(arr) != n:
        raise InvalidArgument(f"{name} has {len(arr)} entries for {n} sequence ids")
    if 0 < n <= FEW:                          # a few counts: their bounds as Python ints (the same checks)
        vals = arr.tolist()
        lo, hi = min(vals), max(vals)
        if (arr.dtype.kind == "u" or lo > 0) and hi > max_value:
            raise InvalidArgument(f"{name} must be at most {max_value} tokens per sequence, got {hi}")
        if lo <= 0:
            raise InvalidArgument(f"{name} must be > 0 tokens per sequence, got {lo}")
        return arr.astype(np.int64, copy=False)
    if n:
        if known is None and arr.dtype.kind == "u" and int(np.maximum.reduce(arr)) > max_value:
            raise InvalidArgument(f"{name} must be at most {max_value} tokens per sequence, got {int(arr.max())}")
        if known is not None:
            lo, hi = known
        else:
            lo, hi = int(np.minimum.reduce(arr)), int(np.maximum.reduce(arr))
        if lo <= 0:
            raise InvalidArgument(f"{name} must be > 0 tokens per sequence, got {lo}")
        if hi > max_value:
            raise InvalidArgument(f"{name} must be at most {max_value} tokens per sequence, got {hi}")
        return arr.astype(np.int64, copy=False)
    return EMPTY_I64


def parse_strs(name: str, values: object, n: int) -> list[str]:
    vals = [] if values is None else [str(v) for v in values]  # type: ignore[attr-defined]
    if not vals:
        return [""] * n
    if len(vals) != n:
        raise InvalidArgument(f"{name} has {len(vals)} entries for {n} admissions; give one per admission or none")
    return vals


def check_distinct(ids: np.ndarray) -> None:
    """Each sequence may be freed, extended, admitted or created by a fork once per step."""
    if len(ids) < 2:
        return
    if len(ids) <= FEW:
        vals = ids.tolist()
        if len(set(vals)) == len(vals):
            return
    srt = np.sort(ids)
    dup = srt[1:] == srt[:-1]
    if np.logical_or.reduce(dup):
        seq = srt[1:][dup][0]
        raise InvalidArgument(
            f"sequence {seq} appears more than once in one step; each sequence may be freed, extended, "
            "admitted or created by a fork once per step", seq_id=seq)


@dataclass(frozen=True, slots=True)
class Prompt:
    """Prefix-cache inputs of a step's admissions: A prompts with N full pages in all, stored ragged.

    pages: int64 [N, page_size] token ids of every full page, prompt after prompt.
    row, col: int64 [N] the admission (0..A-1) and the position inside its prompt of each page.
    full: int64 [A] full pages of each prompt; limit: int64 [A] pages it may take from the cache.
    ns: int64 [A] namespace id of each (salt, extra key); hashes: uint64 [N] chained page hashes.
    new_ns: namespaces seen for the first time (remembered only when the step commits).
    """

    pages: np.ndarray
    row: np.ndarray
    col: np.ndarray
    full: np.ndarray
    limit: np.ndarray
    ns: np.ndarray
    hashes: np.ndarray
    new_ns: dict


@dataclass(frozen=True, slots=True)
class StepInput:
    """A validated step: ids (uint64), counts (int64) and the live rows they name."""

    f_ids: np.ndarray
    e_ids: np.ndarray
    e_k: np.ndarray
    a_ids: np.ndarray
    a_n: np.ndarray
    p_ids: np.ndarray
    c_ids: np.ndarray
    f_rows: np.ndarray
    e_rows: np.ndarray
    p_rows: np.ndarray
    prompt: Prompt | None
    extend_only: bool            # nothing but extensions (a decode loop's step)
    repeat: bool                 # extend_only with the very batch of the last extend-only step
    e_new: np.ndarray | None = None      # int64 [E] tokens each extended row holds after the step


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """What one layer group needs and does in a step.

    need: slots the step allocates (new pages + copy-on-write copies); avail: slots it may use
    (free now + freed by this step - cached pages its admissions revive).
    new_first: int64 [E] first page each extended row keeps (sliding groups; None otherwise).
    cow: bool [E] extended rows that copy their shared, partly filled last page first (None: none).
    hits: int64 [A] cached pages each admission takes (prefix caching; else None), the same in every group.
    cand: int64 [N] this group's cached slot of each prompt page (valid where a_first <= col < hits).
    a_first: int64 [A] first page each admission holds in this group (sliding groups skip pages
        wholly before the window of the first computed token; 0 elsewhere; None without prefix caching).
    f_slots: int64 [n] the slots the freed rows hold in this group, row after row (None: no frees); the
        commit releases exactly these.
    """

    need: int
    avail: int
    new_first: np.ndarray | None = None
    cow: np.ndarray | None = None
    hits: np.ndarray | None = None
    cand: np.ndarray | None = None
    a_first: np.ndarray | None = None
    f_slots: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Token and page counts of the extended (E) and admitted (A) rows, and each group's plan."""

    e_old: np.ndarray           # int64 [E] tokens before the step
    e_new: np.ndarray           # int64 [E] tokens after
    e_held: np.ndarray          # int64 [E] pages before (= ceil(e_old / page_size))
    e_held_new: np.ndarray      # int64 [E] pages after
    a_held: np.ndarray          # int64 [A] pages of each admission
    groups: tuple[GroupPlan, ...]


def count_in(sorted_vals: np.ndarray, q: np.ndarray) -> np.ndarray:
    """How often each q occurs in sorted_vals (int64, shape of q)."""
    if not len(sorted_vals) or not len(q):
        return np.zeros(len(q), dtype=np.int64)
    return sorted_vals.searchsorted(q, side="right") - sorted_vals.searchsorted(q, side="left")


def distinct_sorted(sorted_vals: np.ndarray) -> np.ndarray:
    """The distinct values of an ascending 1-D array (np.unique of it, without sorting again)."""
    if len(sorted_vals) < 2:
        return sorted_vals
    head = np.empty(len(sorted_vals), dtype=bool)
    head[0] = True
    np.not_equal(sorted_vals[1:], sorted_vals[:-1], out=head[1:])
    return sorted_vals if np.logical_and.reduce(head) else sorted_vals[head]


def distinct_counts(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(distinct values ascending, how often each occurs, or None when every value occurs once): np.unique(vals,
    return_counts=True) of a 1-D array with one sort, and no counts array in the usual all-distinct case."""
    srt = np.sort(vals)
    if len(srt) < 2:
        return srt, None
    head = np.empty(len(srt), dtype=bool)
    head[0] = True
    np.not_equal(srt[1:], srt[:-1], out=head[1:])
    if np.logical_and.reduce(head):
        return srt, None
    starts = head.nonzero()[0]
    return srt[starts], np.diff(np.append(starts, len(srt)))


def token_indptr(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """int64 [B + 1]: the prefix sum of new - old (int64 [B] tokens before and after), row b's new tokens being
    [out[b], out[b + 1]); a few rows summed as Python ints."""
    if len(old) <= FEW:
        return np.array([0, *accumulate(map(sub, new.tolist(), old.tolist()))], dtype=np.int64)
    out = np.zeros(len(old) + 1, dtype=np.int64)
    (new - old).cumsum(out=out[1:])
    return out


def cow_rows(last: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """Which of c extending owners of a partly filled page copy it (bool, shape of last).

    last: int64 [n] the page (slot) each extending row writes into, in batch order.
    owners: int64 [n] owners of that slot once this step's frees, forks and releases are done.
    Of c extenders of a slot with r owners, all c copy when r > c; otherwise the last one in
    batch order writes in place and the others copy. A sole owner (r == c == 1) never copies.
    """
    n = len(last)
    order = np.lexsort((np.arange(n), last))       # by slot, then batch order
    s = last[order]
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = s[1:] != s[:-1]
    run_id = new_run.cumsum() - 1
    run_len = np.bincount(run_id)
    is_last_sorted = np.ones(n, dtype=bool)
    is_last_sorted[:-1] = s[1:] != s[:-1]
    c = run_len[run_id]
    copy_sorted = (owners[order] > c) | ~is_last_sorted
    out = np.empty(n, dtype=bool)
    out[order] = copy_sorted
    return out
