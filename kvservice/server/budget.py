"""One memory budget for everything a request or a session holds, with a global and a per-tenant limit.

The pools' own arrays are bounded by the pool limits (kvservice/server/limits.py's Limits); what
else grows with the load is charged here before it is allocated: a request in flight (from its
wire size, before it is parsed: kvservice/server/admission.py), the reply a Step will build (from
its bound, kvservice/core/limits.py, before the step is applied), and what an open stream's
session keeps between requests (kvservice/server/stream.py). A charge that would take its tenant
past ``tenant_bytes`` or everyone past ``total_bytes`` is refused with :class:`BudgetExceeded`
(RESOURCE_EXHAUSTED, reason ``MEMORY_BUDGET``) and nothing is charged; the caller then refuses its
request before it changes anything.

Charged bytes are a model of resident memory, not a measurement: each kind is its size on the wire
times a factor measured by bench/bench_limits.py (``WIRE_FACTOR``, ``REPLY_FACTOR``). The budget
itself comes from the pod's memory (:func:`derive_budget`, docs/SECURITY.md#memory-budget).

Plain Python (no gRPC): tests drive it directly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from kvservice.contract.errors import ResourceExhausted
from kvservice.manager.pools import SLOT_UNIT_BYTES

#: Resident bytes per byte of a request on the wire while it is handled: gRPC's buffer, the parsed
#: message, decoded arrays and the work they feed (a prefix-cached admission pads and hashes its
#: token ids: 3 x its ids). Measured by bench/bench_limits.py.
WIRE_FACTOR = 6
#: Resident bytes per byte of a Step's reply bound while the reply is built and serialized
#: (measured 3.1 x the reply; bench/bench_limits.py).
REPLY_FACTOR = 4
#: What the process needs before any pool or request: interpreter, gRPC, NumPy, threads' stacks.
PROCESS_BYTES = 256 << 20
#: Resident bytes per slot unit of Limits.max_total_slots (a prefix-cached pool's slot counts several units,
#: its cached page included: kvservice/manager/pools.py slot_units).
SLOT_BYTES = SLOT_UNIT_BYTES
#: Share of what is left that the budget may charge (the rest absorbs allocator fragmentation and
#: the error of the model).
HEADROOM = 0.8
#: The memory limit assumed when no cgroup limit is set: the base manifest's (deploy/base).
DEFAULT_MEMORY_LIMIT = 4 << 30
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class BudgetExceeded(ResourceExhausted):
    """A charge over the global or the tenant's budget (RESOURCE_EXHAUSTED, reason MEMORY_BUDGET)."""


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """total_bytes: all tenants together; tenant_bytes: one tenant (the name of its token; "" without tokens)."""

    total_bytes: int
    tenant_bytes: int

    def __post_init__(self) -> None:
        if self.total_bytes <= 0 or self.tenant_bytes <= 0:
            raise ValueError(f"memory budgets must be > 0 bytes, got total {self.total_bytes}, "
                             f"tenant {self.tenant_bytes}")


def cgroup_memory_limit(files: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    """This process's cgroup memory limit in bytes (v2, then v1), None if unset or unreadable."""
    for name in files:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:        # v1 says "no limit" with a huge number, v2 with "max"
            return int(text)
        return None
    return None


def derive_budget(memory_limit: int, max_total_slots: int, reply_cache_bytes: int = 64 << 20) -> int:
    """The global budget for a process limited to `memory_limit` bytes: HEADROOM x what is left after the
    process, the pools at max_total_slots and the journal's reply cache; at least 1/8 of the limit."""
    left = memory_limit - PROCESS_BYTES - SLOT_BYTES * max_total_slots - reply_cache_bytes
    return max(int(HEADROOM * left), memory_limit // 8)


class Charge:
    """Bytes charged to one tenant for one thing; release() (idempotent) gives them back.

    Resizing (`resize`) is refused like a new charge when it grows past a limit; it keeps the old size then.
    """

    __slots__ = ("budget", "nbytes", "tenant", "what")

    def __init__(self, budget: MemoryBudget, tenant: str, what: str, nbytes: int) -> None:
        self.budget, self.tenant, self.what, self.nbytes = budget, tenant, what, nbytes

    def resize(self, nbytes: int) -> None:
        """Charge `nbytes` instead (BudgetExceeded, nothing changed, if the growth does not fit)."""
        self.budget._move(self, max(0, int(nbytes)))

    def release(self) -> None:
        self.budget._move(self, 0)

    def __enter__(self) -> Charge:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class MemoryBudget:
    """Bytes charged per tenant and in all, each under its limit. Thread-safe.

    refused: charges refused so far (by what was charged: "Step request", "Step reply", ...).
    peak_bytes: the most ever charged at once.
    """

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits
        self.charged_bytes = 0
        self.peak_bytes = 0
        self.refused: dict[str, int] = {}
        self._tenants: dict[str, int] = {}
        self._lock = threading.Lock()

    def charge(self, tenant: str, nbytes: int, what: str) -> Charge:
        """A new charge of `nbytes` to `tenant`; BudgetExceeded (nothing charged) if it does not fit."""
        c = Charge(self, tenant, what, 0)
        self._move(c, max(0, int(nbytes)))
        return c

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            return self._tenants.get(tenant, 0)

    def tenants(self) -> dict[str, int]:
        """Bytes charged per tenant now (tenants with nothing charged are left out)."""
        with self._lock:
            return dict(self._tenants)

    def _move(self, c: Charge, nbytes: int) -> None:
        with self._lock:
            grow = nbytes - c.nbytes
            held = self._tenants.get(c.tenant, 0)
            if grow > 0:
                lim = self.limits
                if held + grow > lim.tenant_bytes or self.charged_bytes + grow > lim.total_bytes:
                    self.refused[c.what] = self.refused.get(c.what, 0) + 1
                    raise self._refusal(c, grow, held)
            held += grow
            if held:
                self._tenants[c.tenant] = held
            else:
                self._tenants.pop(c.tenant, None)
            self.charged_bytes += grow
            self.peak_bytes = max(self.peak_bytes, self.charged_bytes)
            c.nbytes = nbytes

    def _refusal(self, c: Charge, grow: int, held: int) -> BudgetExceeded:
        lim = self.limits
        mib = 1 << 20
        whose = f"tenant {c.tenant!r}" if c.tenant else "this server's callers"
        if held + grow > lim.tenant_bytes and lim.tenant_bytes < lim.total_bytes:
            limit, flag, where = lim.tenant_bytes, "--tenant-rpc-memory-budget", \
                f"{whose} already hold {held / mib:.1f} MiB of their {lim.tenant_bytes / mib:.0f} MiB"
        else:
            limit, flag, where = lim.total_bytes, "--rpc-memory-budget", \
                f"requests and sessions of all tenants hold {self.charged_bytes / mib:.1f} MiB of the manager's " \
                f"{lim.total_bytes / mib:.0f} MiB"
        if grow > limit:
            where = f"that is more than the {limit / mib:.0f} MiB ({flag}) there is: send smaller requests " \
                    "(split the step, omit_tables) or raise " + flag
        else:
            where = f"{where} ({flag}): retry when fewer large requests are in flight, send smaller ones (split " \
                    "the step, omit_tables), or close idle streams"
        return BudgetExceeded(f"{c.what} needs {grow / mib:.1f} MiB of the manager's memory budget; {where}",
                              reason="MEMORY_BUDGET", needed=grow,
                              held=held, tenant_limit=lim.tenant_bytes, charged=self.charged_bytes,
                              limit=lim.total_bytes)
