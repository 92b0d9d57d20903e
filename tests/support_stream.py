"""Random Step op sequences for the incremental-table tests, and the check that a mirror equals full tables.

A `Driver` draws scheduler-like steps (admissions with or without prompt token ids, decode and
prefill-chunk extensions, forks with and without extending the parent, frees, mixed steps, and
mistakes that must be refused) from a seeded generator and keeps the set of live ids in step with
the replies. The same ops go to a pool driven through StepStream with deltas and to a twin pool
driven by unary Step with full tables; the domain is deterministic, so the twin's full tables are
the reference the mirror must equal, bit for bit and dtype for dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvservice.contract.geometry import CacheSpec, LayerSpec

PAGE = 4
SPECS = {
    # one index space, slot-mapping source of the delta
    "per_layer": (CacheSpec.uniform(2, 1, 64, "float16", PAGE), False),
    # three layer views, two groups, a sliding window of 6 tokens: CSR source, released pages
    "hybrid": (CacheSpec((LayerSpec(1, 64), LayerSpec(1, 128), LayerSpec(1, 64, sliding_window=6)), PAGE,
                         "interleaved"), False),
    # one group seen as two index spaces (page = base + slot * scale + offset, scale 2): the steady decode path
    "views": (CacheSpec((LayerSpec(1, 64), LayerSpec(1, 128)), PAGE, "interleaved"), False),
    # prefix caching: admissions share cached pages, children copy on write
    "prefix": (CacheSpec.uniform(2, 1, 64, "float16", PAGE), True),
}
NUM_SLOTS = 96
MAX_LEN = 64


@dataclass
class Driver:
    """Draws one step at a time; `live` must be updated by the caller from each successful reply."""

    rng: np.random.Generator
    prefix: bool
    live: list[int] = field(default_factory=list)
    next_id: int = 1
    tokens: dict[int, int] = field(default_factory=dict)
    last_extend: list[int] = field(default_factory=list)

    def _new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _prompt(self, n: int) -> list[int]:
        # few distinct prompts, so prefix-cache hits happen
        base = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 0, 3, 3, 1, 7, 2] * 8
        start = int(self.rng.integers(0, 2)) * 4
        return base[start:start + n]

    def draw(self) -> dict:
        """Keyword arguments of kvservice.client.codec.step_request for the next step."""
        r = self.rng
        kind = r.choice(["admit", "decode", "decode", "decode", "chunk", "fork", "free", "mixed", "mistake"])
        live = list(self.live)
        if not live or kind == "admit":
            n = int(r.integers(1, 4))
            lens = r.integers(1, 24, n)
            kw: dict = {"admit": self._new_ids(n), "admit_tokens": lens}
            if self.prefix and r.random() < 0.8:
                kw["admit_token_ids"] = np.concatenate([self._prompt(int(k)) for k in lens])
            return kw
        if kind == "decode":
            # a steady decode loop: the same batch as last time when possible
            batch = [i for i in self.last_extend if i in live] if r.random() < 0.7 else []
            batch = batch or live
            self.last_extend = batch
            return {"extend": batch, "extend_tokens": 1}
        if kind == "chunk":
            batch = list(r.choice(live, size=min(len(live), int(r.integers(1, 4))), replace=False))
            return {"extend": batch, "extend_tokens": r.integers(1, 9, len(batch))}
        if kind == "fork":
            parent = int(r.choice(live))
            kids = self._new_ids(int(r.integers(1, 3)))
            kw = {"fork": [(parent, c) for c in kids]}
            if r.random() < 0.6:
                kw.update(extend=[parent], extend_tokens=1)
            return kw
        if kind == "free":
            return {"free": list(r.choice(live, size=min(len(live), int(r.integers(1, 3))), replace=False))}
        if kind == "mixed":
            f = list(r.choice(live, size=min(len(live), int(r.integers(0, 2))), replace=False))
            rest = [i for i in live if i not in f]
            e = list(r.choice(rest, size=min(len(rest), int(r.integers(0, 4))), replace=False)) if rest else []
            kw = {"admit": self._new_ids(1), "admit_tokens": [int(r.integers(1, 12))]}
            if f:
                kw["free"] = f
            if e:
                kw.update(extend=e, extend_tokens=1)
            return kw
        # mistakes: unknown id, duplicate, over max_seq_len (all refused, nothing changes)
        pick = int(r.integers(0, 3))
        if pick == 0:
            return {"extend": [10_000_000], "extend_tokens": 1}
        if pick == 1:
            return {"extend": [live[0], live[0]], "extend_tokens": 1}
        return {"extend": [live[0]], "extend_tokens": MAX_LEN + 1}

    def update(self, kw: dict, seq_ids: np.ndarray) -> None:
        """After a successful step: frees leave, the reply's batch is live."""
        freed = {int(i) for i in kw.get("free", ())}
        self.live = sorted((set(self.live) - freed) | {int(i) for i in seq_ids})


def assert_same_tables(mirror, full, where: str) -> None:
    """The mirror's tables equal a full reply's (kvservice.client.codec.StepResult with block tables), values and
    dtypes."""
    assert mirror.seq_ids.tolist() == full.seq_ids.tolist(), where
    assert np.array_equal(np.asarray(mirror.num_tokens), full.num_tokens), where
    assert np.array_equal(np.asarray(mirror.new_token_indptr), full.new_token_indptr), where
    for sid, st in full.tables.items():
        t = mirror.page_table(sid)
        pairs = [("indptr", t.indptr, st.table.indptr), ("indices", t.indices, st.table.indices),
                 ("last_page_len", t.last_page_len, st.table.last_page_len),
                 ("slot_mapping", mirror.slot_mapping(sid), st.slot_mapping),
                 ("block_table", mirror.block_table(sid), st.block_table)]
        for name, got, want in pairs:
            got = np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape, (where, sid, name, got.dtype, want.dtype,
                                                                         got.shape, want.shape)
            assert np.array_equal(got, want), (where, sid, name, got.tolist(), want.tolist())


def fields_in_order(request, order=None) -> bytes:
    """A protobuf message's set fields serialized one by one in `order` (indices into ListFields(); None: descending
    field numbers): valid bytes that parse to the same message, in an order a re-serialization does not keep."""
    fields = request.ListFields()
    if order is None:
        order = sorted(range(len(fields)), key=lambda i: -fields[i][0].number)
    out = b""
    for i in order:
        field, value = fields[i]
        one = type(request)()
        if field.message_type is not None:
            getattr(one, field.name).CopyFrom(value)
        else:
            setattr(one, field.name, value)
        out += one.SerializeToString()
    return out
