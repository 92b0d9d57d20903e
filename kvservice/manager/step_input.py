"""A Step request decoded once: its typed arrays and what it costs, passed from the servicer to Pool.step.

A StepRequest's arrays are decoded (kvservice.v1.Tensor -> NumPy, without copying) exactly once per request,
by `decode_step`, where it arrives: the unary adapter, the stream's `step_one`, or the journal's replay of an
entry. The `DecodedStep` it returns then goes through the server's Limits, the journal (which journals the
request's bytes, not the arrays), `ManagerAPI.run_step`'s cost check and `Pool.step`; none of them decodes
again. (The pool's own validated form of a step, with the rows it names, is `core.stepplan.StepInput`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvservice.contract.errors import InvalidArgument, KVError
from kvservice.contract.wire import from_tensor
from kvservice.core.limits import count_summary
from kvservice.v1 import block_manager_pb2 as pb

#: The StepRequest fields that carry arrays, in the order Pool.step reads them.
STEP_ARRAYS = ("free_seq_ids", "extend_seq_ids", "extend_num_tokens", "admit_seq_ids", "admit_num_tokens",
               "fork_parent_ids", "fork_child_ids", "admit_token_ids")
#: (min, max, exact sum) of a token-count array; None for an absent, empty or malformed one (the pool names it).
CountSummary = tuple[int, int, int] | None


@dataclass(slots=True)
class DecodedStep:
    """One StepRequest with its arrays decoded, and the summary its cost checks read. Read-only by convention
    (not frozen: a frozen dataclass's constructor costs microseconds on the hot path).

    free_seq_ids [F], extend_seq_ids [E], admit_seq_ids [A], fork_parent_ids [K], fork_child_ids [K]: sequence
        ids as sent (any integer dtype; the pool checks sign and dtype). None: the field was not set.
    extend_num_tokens [E], admit_num_tokens [A]: tokens each extended row gains / each admission starts with.
    admit_token_ids [sum(admit_num_tokens)]: the admissions' token ids (prefix caching).
    tables: full tables asked for (not omit_tables); block_table: include_block_table.
    admit_salts, admit_extra_keys: one string per admission, or None.
    extend_counts, admit_counts: CountSummary of extend_num_tokens and admit_num_tokens.
    count_ranges: ((min, max) of extend_num_tokens, (min, max) of admit_num_tokens), None each where the summary
        is: what Pool.step's count checks read (its count_ranges argument).
    sequences: ids in the step (free + extend + admit + fork children); new_tokens: sum of the counts
        (an array with an entry <= 0 counts 0: the pool refuses it) or the length of admit_token_ids if
        that is more: what Limits caps.
    """

    pool: str
    free_seq_ids: np.ndarray | None
    extend_seq_ids: np.ndarray | None
    extend_num_tokens: np.ndarray | None
    admit_seq_ids: np.ndarray | None
    admit_num_tokens: np.ndarray | None
    fork_parent_ids: np.ndarray | None
    fork_child_ids: np.ndarray | None
    admit_token_ids: np.ndarray | None
    tables: bool
    block_table: bool
    admit_salts: list[str] | None
    admit_extra_keys: list[str] | None
    extend_counts: CountSummary
    admit_counts: CountSummary
    sequences: int
    new_tokens: int
    count_ranges: tuple[tuple[int, int] | None, tuple[int, int] | None]


def _range(summary: CountSummary) -> tuple[int, int] | None:
    """(min, max) of a CountSummary: what Pool.step's count checks read."""
    return None if summary is None else (summary[0], summary[1])


def decode_step(request: pb.StepRequest) -> DecodedStep:
    """Decode a StepRequest's arrays (no copies) and summarise its counts; InvalidArgument naming the field
    for an array that cannot be decoded (nothing has changed then)."""
    a = []
    for f in STEP_ARRAYS:
        if not request.HasField(f):
            a.append(None)
            continue
        try:
            a.append(from_tensor(getattr(request, f), f))
        except KVError:
            raise
        except Exception as err:
            raise InvalidArgument(f"{f}: cannot be decoded ({type(err).__name__}: {err})", field=f) from None
    free, e_ids, e_k, a_ids, a_n, parents, children, token_ids = a
    ext, adm = count_summary(e_k), count_summary(a_n)
    sequences = 0
    for x in (free, e_ids, a_ids, children):
        if x is not None:
            sequences += x.size
    tokens = (ext[2] if ext is not None else 0) + (adm[2] if adm is not None else 0)
    if token_ids is not None and token_ids.size > tokens:
        tokens = token_ids.size
    salts, keys = request.admit_cache_salts, request.admit_extra_keys
    return DecodedStep(request.pool, free, e_ids, e_k, a_ids, a_n, parents, children, token_ids,
                       not request.omit_tables, request.include_block_table, list(salts) if salts else None,
                       list(keys) if keys else None, ext, adm, sequences, tokens, (_range(ext), _range(adm)))


__all__ = ["STEP_ARRAYS", "DecodedStep", "decode_step"]
