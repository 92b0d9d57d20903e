"""Per-request caps (Limits) checked before the domain sees a request: batch sizes, token counts, request ids,
pool sizes and the manager's pool count and slot units (docs/SECURITY.md#limits). A Step is checked on its
one decoding (manager/step_input.py's DecodedStep), which the journal and the step service then read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvservice.contract.convert import cache_spec_from_proto, plan_to_proto, sizing_from_proto
from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.sizing import Plan
from kvservice.core.planner import plan
from kvservice.manager.pools import SLOT_UNIT_BYTES, BlockManager, slot_units
from kvservice.manager.step_input import DecodedStep, decode_step
from kvservice.v1 import block_manager_pb2 as pb


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request caps checked before the domain sees a request; 0 = no cap.

    max_step_sequences: ids in one Step (free + extend + admit + fork children).
    max_step_tokens: new tokens in one Step (sum of extend and admit counts; also admit_token_ids).
    max_pool_slots: slots of one pool summed over its layer groups (allocator memory, ~24 bytes each).
    max_pools: pools one manager holds.
    max_request_id: characters of a request_id.
    max_total_slots: slot units of all pools together (slots x layer groups, a prefix-cached pool's each
        counting manager.pools.slot_units: 33 at page size 16): what bounds the pools' memory (56 bytes a
        unit), whatever max_pools says. docs/SECURITY.md#limits.
    """

    max_step_sequences: int = 65_536
    max_step_tokens: int = 8_388_608
    max_pool_slots: int = 1 << 24
    max_pools: int = 256
    max_request_id: int = 128
    max_total_slots: int = 1 << 24

    def check(self, method: str, request: Any, manager: BlockManager, step: DecodedStep | None = None) -> None:
        """InvalidArgument (reason LIMIT_EXCEEDED) for a request over a cap; ResourceExhausted at max_pools.

        step: a Step's request decoded (decode_step; the caller decodes it once and passes it on).
        """
        rid = getattr(request, "request_id", "")
        if self.max_request_id and len(rid) > self.max_request_id:
            raise _over("request_id", len(rid), self.max_request_id, "characters", "")
        if method == "Step":
            self._check_step(step if step is not None else decode_step(request))
        elif method == "CreatePool":
            self._check_create(request, manager)
        elif method == "Plan":
            _check_representable(plan(cache_spec_from_proto(request.cache), sizing_from_proto(request.sizing),
                                      tuple(request.backends)))

    def _check_step(self, step: DecodedStep) -> None:
        """The caps of a decoded Step, from its arrays as decoded (a malformed one already got its own message)."""
        if self.max_step_tokens:
            for f, a, summary in (("extend_num_tokens", step.extend_num_tokens, step.extend_counts),
                                  ("admit_num_tokens", step.admit_num_tokens, step.admit_counts)):
                top = summary[1] if summary is not None else int(a.max()) if a is not None and a.size else 0
                if top > self.max_step_tokens:
                    raise _over(f"{f} entry", top, self.max_step_tokens, "tokens", "--max-step-tokens")
        if self.max_step_sequences and step.sequences > self.max_step_sequences:
            raise _over("sequences in one Step", step.sequences, self.max_step_sequences, "ids",
                        "--max-step-sequences")
        if self.max_step_tokens and step.new_tokens > self.max_step_tokens:
            raise _over("new tokens in one Step", step.new_tokens, self.max_step_tokens, "tokens", "--max-step-tokens")

    def _check_create(self, r: pb.CreatePoolRequest, manager: BlockManager) -> None:
        if self.max_pools and len(manager.pool_names()) >= self.max_pools:
            raise ResourceExhausted(f"the manager holds {self.max_pools} pools, its limit (--max-pools); delete "
                                    "one first", reason="LIMIT_EXCEEDED", limit=self.max_pools)
        p = plan(cache_spec_from_proto(r.cache), sizing_from_proto(r.sizing), tuple(r.backends))
        _check_representable(p)
        slots = sum(p.group_slots)            # slots x layer groups, each group its own count
        if self.max_pool_slots and slots > self.max_pool_slots:
            raise _over(f"pool {r.name!r}: slots x layer groups", slots, self.max_pool_slots, "slots",
                        "--max-pool-slots")
        if self.max_total_slots:
            held = manager.total_slots()
            per = slot_units(p.page_size, r.enable_prefix_caching)
            units = slots * per
            if held + units > self.max_total_slots:
                cached = (f", each counting {per} because a cached page costs that many slots' memory"
                          if per > 1 else "")
                raise ResourceExhausted(
                    f"pool {r.name!r} needs {units} slot units ({slots} slots x layer groups{cached}); the "
                    f"manager's pools hold {held} of its {self.max_total_slots} (max_total_slots, which bounds "
                    f"their memory at {SLOT_UNIT_BYTES} bytes a unit); delete a pool or plan a smaller one "
                    "(docs/SECURITY.md#limits)", reason="LIMIT_EXCEEDED", needed=units, held=held,
                    limit=self.max_total_slots)


def _check_representable(p: Plan) -> None:
    """InvalidArgument if a plan's byte figures do not fit the reply's uint64 fields (planner.py accepts them)."""
    try:
        plan_to_proto(p)
    except ValueError:
        raise InvalidArgument(f"this cache needs {p.total_bytes} bytes ({p.bytes_per_slot} per slot): more than a "
                              "64-bit byte count can describe; check kv_heads, head_dim and page_size",
                              reason="LIMIT_EXCEEDED", total_bytes=p.total_bytes) from None


def _over(what: str, value: int, limit: int, unit: str, flag: str) -> InvalidArgument:
    hint = f" (server flag {flag})" if flag else ""
    return InvalidArgument(f"{what}: {value} {unit} is over this server's limit of {limit}{hint}; split the "
                           "request", reason="LIMIT_EXCEEDED", value=value, limit=limit)
