"""A pool as plain data and back (`PoolState`): what snapshots store and recovery rebuilds.

A base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read pool.py first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

import numpy as np

from kvservice.contract.sizing import Plan
from kvservice.core.hashing import DEFAULT_MODE, VLLM_DEFAULT_SEED
from kvservice.core.pool_state import POOL_STATE_VERSION, IdRuns, PoolState, as_array, spec_runs


class PoolCodec:
    """A pool as plain data and back (`PoolState`) (part of Pool)."""

    # Reads and writes the attributes Pool.__init__ sets.

    # ---- durable state ---------------------------------------------------------------------------
    # A snapshot stores a pool in domain terms (sequences, the slots of their pages, free lists in hand-out
    # order, prefix-cache entries per layer group), not as this class's attributes, so that another internal
    # layout (or the next release) can read it. export_state reads, and from_state writes, exactly these
    # fields; keep both in step with any change to them (tests/unit/test_snapshot.py::
    # test_every_pool_field_is_exported_or_rebuilt lists them and fails when a field is added):
    #   Pool:          name, plan, model, incarnation, prefix_hash, prefix_hash_seed, prefixes (prefix), _sharing,
    #                  _rows, _seq_ids, _num_tokens, _held, _first, _slots (RowSlots: the slots of pages
    #                  [first, held) of each row), _free_rows,
    #                  _num_rows, steps, admitted, refused, alloc_failures, events (seq; its sources' parent
    #                  hashes and hash index are rebuilt from the caches)
    #   SlotAllocator: _stack[:_top], _top, _cached (eviction order, with release stamps), peak_used, evictions,
    #                  generation; policy: its links per registered page (prefix/<g>/linked), the rest rebuilt;
    #                  clock: the largest stamp (the pool sets it every step);
    #                  _refcnt is rebuilt from the owners (invariant 1), cacheable from the prefix caches
    #   PrefixCache (per group): by_hash (insertion order), hash, parent, parent_hash, anchor, namespace,
    #                  tokens (registered slots only), hits; the namespaces shared by the groups
    # Rebuilt, not stored (caches, scratch, constants): Pool._sorted, _last_batch, _fast, _one_full_group, page_size,
    # max_seq_len, windows, layer_space, _sliding, _is_sliding, _anchor_group, _register_order (from the plan);
    # SlotAllocator._mark, _ones, num_slots, caching, on_evict; PrefixCache.fleet (the manager attaches a
    # restored pool to its fleet index, which reads the cache again: fleet_index.py).
    def capture_state(self) -> Callable[[], PoolState]:
        """Copy what export_state needs and return the function that builds the PoolState from the copies.

        Call it under the pool's lock: it only copies (memcpy-speed), so the lock is held briefly; the
        returned function gathers the slot lists later, without any lock (what a snapshot does).
        """
        geo = self.plan.geometry
        ps = self.page_size
        rows = np.sort(np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows)))
        held = self._held[rows]
        arrays: dict[str, np.ndarray] = {
            "seq_ids": self._seq_ids[rows], "rows": rows, "num_tokens": self._num_tokens[rows],
            "free_rows": np.asarray(self._free_rows, dtype=np.int64)}
        groups, tables, stacks = [], [], []
        for g, alloc in enumerate(self.allocators):
            arrays[f"first/{g}"] = self._first[g][rows]                  # fancy indexing: copies
            rs = self._slots[g]                                           # gathered later, unlocked
            tables.append((rs.arena[:rs.used].copy(), rs.start[rows], rs.lo[rows]))
            a = alloc.export_state()
            stacks.append(a.pop("free_stack"))
            groups.append({"peak_used": a.pop("peak_used"), "evictions": a.pop("evictions")})
            arrays |= {f"{k}/{g}": v for k, v in a.items()}                 # cached, cached_stamp, generation
        prefix = None
        if self.prefixes is not None:
            for g, pc in enumerate(self.prefixes):
                arrays |= {f"prefix/{g}/{k}": v for k, v in pc.export_state().items()}
            prefix = {"hits": [int(pc.hits) for pc in self.prefixes], "namespaces": self.prefix.namespaces.items()}
        spec = geo.spec
        meta = {"version": POOL_STATE_VERSION, "name": self.name, "model": self.model,
                "incarnation": int(self.incarnation),
                "spec": {"page_size": ps, "layout": spec.layout, "layers": spec_runs(spec)},
                "num_slots": int(geo.num_slots), "group_slots": [int(n) for n in geo.group_slots],
                "max_seq_len": int(self.max_seq_len),
                "backends": list(self.plan.backends), "prefix_caching": self.prefixes is not None,
                "prefix_hash": self.prefix_hash, "prefix_hash_seed": self.prefix_hash_seed,
                "sharing": bool(self._sharing), "steps": int(self.steps),
                "admitted": int(self.admitted), "refused": int(self.refused),
                "alloc_failures": {str(k): int(v) for k, v in self.alloc_failures.items()},
                "row_capacity": len(self._num_tokens), "num_rows": int(self._num_rows),
                "events_seq": int(self.events.seq), "groups": groups, "prefix": prefix}

        def finish(runs: bool = False) -> PoolState:
            """runs: leave a free stack found to be runs as IdRuns (the snapshot encoder writes them as they are)."""
            for g, stack in enumerate(stacks):
                arrays[f"free_stack/{g}"] = stack if runs and isinstance(stack, IdRuns) else as_array(stack)
            for g, (arena, start, lo) in enumerate(tables):
                first = arrays[f"first/{g}"]
                cnt = held - first
                out = np.empty(int(cnt.sum()), dtype=np.int64)
                at = 0
                for a in range(0, len(rows), 1024):        # in pieces: other threads run in between (GIL)
                    s, f, lw, c = start[a:a + 1024], first[a:a + 1024], lo[a:a + 1024], cnt[a:a + 1024]
                    k = int(c.sum())
                    starts = c.cumsum() - c
                    flat = (s + (f - lw) - starts).repeat(c) + np.arange(k, dtype=np.int64)
                    out[at:at + k] = arena.take(flat)
                    at += k
                arrays[f"slots/{g}"] = out
            return PoolState(meta, arrays)
        return finish

    def export_state(self) -> PoolState:
        """The pool's state as PoolState (copies; the caller holds the pool's lock for a consistent cut)."""
        return self.capture_state()()

    @classmethod
    def from_state(cls, state: PoolState, plan: Plan) -> Self:
        """A pool rebuilt from PoolState; plan: the pool's plan (kvservice.state.snapshot rebuilds it from meta).

        The state must have passed kvservice.core.invariants.check_pool_state (this only rebuilds it).
        """
        m, a = state.meta, state.arrays
        pool = cls(m["name"], plan, bool(m["prefix_caching"]), str(m.get("model", "")),
                    str(m.get("prefix_hash", DEFAULT_MODE)), str(m.get("prefix_hash_seed", VLLM_DEFAULT_SEED)))
        pool.incarnation = int(m.get("incarnation", 0))
        cap = int(m["row_capacity"])
        pool._grow_rows(cap)
        ps = pool.page_size
        rows, n = a["rows"], a["num_tokens"]
        held = (n + (ps - 1)) // ps
        pool._seq_ids[rows] = a["seq_ids"]
        pool._num_tokens[rows] = n
        pool._held[rows] = held
        pool._rows = dict(zip(a["seq_ids"].tolist(), rows.tolist(), strict=True))
        pool._free_rows = a["free_rows"].tolist()
        pool._num_rows = int(m["num_rows"])
        pool._sharing = bool(m["sharing"])
        for g, alloc in enumerate(pool.allocators):
            first = a[f"first/{g}"]
            slots = a[f"slots/{g}"]
            pool._first[g][rows] = first
            rs = pool._slots[g]
            rs.reserve(rows, first, held)
            flat, _ = rs.span(rows, first, held)
            rs.arena[flat] = slots
            alloc.restore_state(a[f"free_stack/{g}"], slots, m["groups"][g]["peak_used"], m["groups"][g]["evictions"],
                                a.get(f"generation/{g}"))               # version 2 states have none: all 0
        if pool.prefixes is not None:
            p = m["prefix"]
            pool.prefix.namespaces.restore(p["namespaces"])
            for g, pc in enumerate(pool.prefixes):
                at = f"prefix/{g}/"
                pc.restore_state({k[len(at):]: v for k, v in a.items() if k.startswith(at)}, p["hits"][g])
        for g, alloc in enumerate(pool.allocators):   # after the links: the policy orders the cached slots by them
            cached = a[f"cached/{g}"]
            stamps = a.get(f"cached_stamp/{g}")         # older snapshots: LRU order as stored
            alloc.restore_cached(cached, stamps if stamps is not None else np.arange(len(cached), dtype=np.int64))
        pool.events.seq = int(m.get("events_seq", 0))
        pool.steps, pool.admitted, pool.refused = int(m["steps"]), int(m["admitted"]), int(m["refused"])
        pool.alloc_failures = {str(k): int(v) for k, v in m["alloc_failures"].items()}
        return pool
