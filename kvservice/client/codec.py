"""Requests built from NumPy arrays, replies parsed into typed results (shared by sync and async clients)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from kvservice.contract import convert
from kvservice.contract.geometry import CacheSpec, IndexSpace
from kvservice.contract.pagetable import PageTable, ValidationReport, Violation
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.contract.wire import field_array, from_tensor, to_tensor
from kvservice.v1 import block_manager_pb2 as pb


class ClientError(Exception):
    """A failed call: gRPC code, the server's message, and its ErrorInfo reason/metadata.

    request_id: the idempotency key of a mutating call (None for reads). After a call gave up
    (reason RETRIES_EXHAUSTED) the request may or may not have been applied: calling again with
    the same request_id is safe and returns the original reply if it was.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", metadata: dict | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.request_id = request_id
        if request_id:
            self.metadata.setdefault("request_id", request_id)

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, request_id: str | None = None) -> ClientError:
        info = None
        try:
            info = error_info(exc)
        except Exception:  # a status without parsable details
            info = None
        return cls(exc.code(), exc.details() or "", info.reason if info else "",
                   dict(info.metadata) if info else {}, request_id)


def position_of(reply: object) -> tuple[int, int] | None:
    """(incarnation, seq) of the journal position a reply carries, None if it has none (its lineage:
    lineage_of; all three: kvservice.client.position.journal_position)."""
    if "position" not in reply.DESCRIPTOR.fields_by_name or not reply.HasField("position"):  # type: ignore[attr-defined]
        return None
    pos = reply.position                                                                      # type: ignore[attr-defined]
    return int(pos.incarnation), int(pos.seq)


def lineage_of(reply: object) -> int:
    """The state lineage of a reply's journal position (0 if none)."""
    if "position" not in reply.DESCRIPTOR.fields_by_name or not reply.HasField("position"):  # type: ignore[attr-defined]
        return 0
    return int(reply.position.lineage)                                                        # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class SpaceTables:
    """Tables of one index space (shapes as in kvservice.core.pool.SpaceTables)."""

    space: IndexSpace
    slot_mapping: np.ndarray            # int64 [num_new_tokens]
    table: PageTable | None             # CSR, None if omitted
    block_table: np.ndarray | None      # [B, max_pages], -1 padded, None unless asked
    # Page generations (docs/ARCHITECTURE.md, "Page generations"), for the worker's checks; None from a
    # manager that sends none. FlashInfer kernels take the CSR above and ignore them.
    slot_generations: np.ndarray | None = None  # uint32 [num_new_tokens], parallel to slot_mapping
    generations: np.ndarray | None = None       # uint32 [nnz], parallel to table.indices


@dataclass(frozen=True, slots=True)
class StepResult:
    """The scheduled batch of a Step: extended sequences, then admitted ones, then fork children.

    seq_ids: uint64 [B]; num_tokens: int64 [B]; new_token_indptr: int64 [B + 1].
    tables: by index space id. layer_index_space: layer -> index space id.
    """

    seq_ids: np.ndarray
    num_tokens: np.ndarray
    new_token_indptr: np.ndarray
    tables: dict[int, SpaceTables]
    layer_index_space: tuple[int, ...]
    num_free_slots: int
    cached_tokens: np.ndarray | None = None         # int64 [A]: tokens of each admission already cached
    copies: dict[int, np.ndarray] | None = None     # group -> int64 [n, 2] (src_slot, dst_slot), run first
    position: tuple[int, int] | None = None         # (incarnation, seq): the manager's journal position
    lineage: int = 0                                # the state lineage that position belongs to (0 = none)
    copy_generations: dict[int, np.ndarray] | None = None  # group -> uint32 [n, 2]: the pairs' slot generations
    pool_incarnation: int = 0                       # the pool incarnation the step ran in (0 = not said)

    def for_layer(self, layer: int) -> SpaceTables:
        """The tables a kernel of `layer` must use (never another space's)."""
        return self.tables[self.layer_index_space[layer]]


def plan_request(spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = ()) -> pb.PlanRequest:
    return pb.PlanRequest(cache=convert.cache_spec_to_proto(spec), sizing=_sizing(sizing), backends=list(backends))


def create_pool_request(name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                        prefix_caching: bool = False, model: str = "") -> pb.CreatePoolRequest:
    return pb.CreatePoolRequest(name=name, cache=convert.cache_spec_to_proto(spec), sizing=_sizing(sizing),
                                backends=list(backends), enable_prefix_caching=prefix_caching, model=model)


def score_request(token_ids: object, salt: str = "", extra_key: str = "", pools: tuple[str, ...] = (),
                  model: str = "") -> pb.ScorePrefixRequest:
    """A ScorePrefix request; token_ids: int [n], sent as INT32 when every id fits (half the bytes), else INT64."""
    tok = np.asarray(token_ids, dtype=np.int64)
    if not len(tok) or (int(tok.min()) >= -(2**31) and int(tok.max()) < 2**31):
        tok = tok.astype(np.int32)
    return pb.ScorePrefixRequest(token_ids=to_tensor(tok), cache_salt=salt, extra_key=extra_key, pools=list(pools),
                                 model=model)


def _sizing(s: Sizing) -> pb.Sizing:
    return pb.Sizing(max_batch=s.max_batch, max_seq_len=s.max_seq_len, memory_budget_bytes=s.memory_budget_bytes,
                     num_slots=s.num_slots, max_num_batched_tokens=s.max_num_batched_tokens,
                     prefix_headroom_slots=s.prefix_headroom_slots, equal_groups=s.equal_groups,
                     group_slots=list(s.group_slots))


def _ids(a: object) -> np.ndarray:
    return np.asarray(a, dtype=np.uint64)


_INT32_MAX = np.iinfo(np.int32).max


def _wire(a: np.ndarray) -> pb.Tensor:
    """An id or count array as a Tensor: INT32 when every value fits (half the bytes; the manager reads any
    integer dtype), else as it is (uint64 ids, int64 counts)."""
    if len(a) and a.dtype != np.int32 and 0 <= int(a.min()) and int(a.max()) <= _INT32_MAX:
        a = a.astype(np.int32)
    return to_tensor(a)


def step_request(pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
                 admit: object = None, admit_tokens: object = None, tables: bool = True,
                 block_table: bool = False, fork: object = None, admit_token_ids: object = None,
                 salts: object = None, extra_keys: object = None, request_id: str = "") -> pb.StepRequest:
    """Build a StepRequest; ids and token counts as INT32 when they fit, else uint64 / int64 (scalar counts
    broadcast over ids).

    fork: (parent, child) pairs. admit_token_ids: the admitted prompts' token ids, concatenated (prefix
    caching). salts, extra_keys: one string per admission.
    """
    req = pb.StepRequest(pool=pool, omit_tables=not tables, include_block_table=block_table,
                         request_id=request_id, admit_cache_salts=list(salts or ()),
                         admit_extra_keys=list(extra_keys or ()))
    if free is not None:
        req.free_seq_ids.CopyFrom(to_tensor(_ids(free)))
    if fork is not None:
        pairs = np.asarray(fork, dtype=np.uint64).reshape(-1, 2)
        req.fork_parent_ids.CopyFrom(to_tensor(np.ascontiguousarray(pairs[:, 0])))
        req.fork_child_ids.CopyFrom(to_tensor(np.ascontiguousarray(pairs[:, 1])))
    if admit_token_ids is not None:
        req.admit_token_ids.CopyFrom(to_tensor(np.asarray(admit_token_ids, dtype=np.int64)))
    for ids, counts, f_ids, f_n in ((extend, extend_tokens, "extend_seq_ids", "extend_num_tokens"),
                                    (admit, admit_tokens, "admit_seq_ids", "admit_num_tokens")):
        if ids is None:
            continue
        ids = _ids(ids)
        counts = np.broadcast_to(np.asarray(1 if counts is None else counts, dtype=np.int64), ids.shape)
        getattr(req, f_ids).CopyFrom(_wire(ids))
        getattr(req, f_n).CopyFrom(_wire(np.ascontiguousarray(counts)))
    return req


def parse_step(reply: pb.StepReply) -> StepResult:
    tables: dict[int, SpaceTables] = {}
    for st in reply.tables:
        space = IndexSpace(st.index_space, st.group, st.scale, st.offset, st.upper_bound, (), st.base)
        table = None
        if st.HasField("indptr"):
            table = PageTable(from_tensor(st.indptr, "indptr"), from_tensor(st.indices, "indices"),
                              from_tensor(st.last_page_len, "last_page_len"))
        tables[st.index_space] = SpaceTables(space, from_tensor(st.slot_mapping, "slot_mapping"), table,
                                             field_array(st, "block_table"), field_array(st, "slot_generations"),
                                             field_array(st, "generations"))
    copies, copy_gens = parse_copies(reply)
    return StepResult(from_tensor(reply.seq_ids, "seq_ids"), from_tensor(reply.num_tokens, "num_tokens"),
                      from_tensor(reply.new_token_indptr, "new_token_indptr"), tables,
                      tuple(reply.layer_index_space), reply.num_free_slots,
                      field_array(reply, "admit_cached_tokens"), copies, position_of(reply), lineage_of(reply),
                      copy_gens, reply.pool_incarnation)


def parse_copies(reply: pb.StepReply) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """(group -> int64 [n, 2] copy-on-write slot pairs, group -> uint32 [n, 2] their generations or None when
    the manager sent none)."""
    copies = {c.group: from_tensor(c.pairs, "pairs").reshape(-1, 2) for c in reply.copies}
    if not all(c.HasField("generations") for c in reply.copies):
        return copies, None
    return copies, {c.group: from_tensor(c.generations, "generations").reshape(-1, 2) for c in reply.copies}


def validate_request(pool: str, layer: int, table: PageTable, max_reports: int = 100) -> pb.ValidatePageTableRequest:
    return pb.ValidatePageTableRequest(pool=pool, layer=layer, indptr=to_tensor(np.asarray(table.indptr)),
                                       indices=to_tensor(np.asarray(table.indices)),
                                       last_page_len=to_tensor(np.asarray(table.last_page_len)),
                                       max_reports=max_reports)


def parse_validate(reply: pb.ValidatePageTableReply) -> ValidationReport:
    return ValidationReport(reply.num_violations, [Violation(v.reason, v.row, v.position, v.value, v.detail)
                                                   for v in reply.violations])
