"""Leader election: one leader key in a JetStream KV bucket, taken and renewed by compare-and-set.

The bucket ``KVS_<name>_leader`` has a TTL (its stream's max_age: the lease plus the longest
lapse, below), so a key nobody renews disappears by itself. The key's value names the holder
(node id, gRPC address, epoch); its *revision* (the KV stream sequence of the last write) is
what compare-and-set checks:

- take (standby): ``create`` when the key is absent (expired, released or never written), or
  ``update(last=r)`` once the same revision r has been *read* unchanged for a whole TTL by this
  process's monotonic clock (a failed read restarts that clock: a standby that cannot see the
  key cannot tell whether the leader renews it). Either succeeds for exactly one contender.
- renew (leader): every ``renew_seconds``, ``update(last=own revision)``. A renewal the server
  refuses (the revision moved: someone else took the key) deposes the leader at once.
- valid until: ``t_sent + ttl - margin`` where t_sent is when the last successful write of the
  key was *sent*. Any contender takes over only after reading that revision for a full TTL,
  which began after it was written, so at a later instant than this bound (clock *rates* may
  differ by up to margin/ttl; nothing depends on clock values being in sync).
- lapsed: past ``valid_until`` with renewals failing (NATS electing a leader after a node
  died, a partition, or this process paused by SIGSTOP, a GC, a starved CPU). The leader
  acknowledges nothing while lapsed and keeps renewing by compare-and-set on its revision for
  up to ``lapse_seconds``: if that succeeds, nobody wrote the key meanwhile, so nobody else led,
  and it goes on (a NATS election costs a pause, not a failover); if it is refused, or the
  lapse lasts too long, the lease is lost.

``check()`` raises unless the lease is valid now; ``wait_valid()`` (the journal's guard, before
every publish and before acknowledging) waits through a lapse and raises once it is lost, so
a leader never acknowledges a write it made without a valid lease.

Runs on a NatsLink's event loop (see kvservice/state/nats/journal.py): the renewer is an asyncio
task there; ``try_acquire``, ``check`` and ``release`` are called from ordinary threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from kvservice.contract.errors import InvalidArgument, KVError
from kvservice.state.nats.journal import NatsLink, StoreError

log = logging.getLogger("kvservice.state.nats.leader")
KEY = "leader"


class LeaseLost(KVError):
    """This manager is not (or no longer) the leader: it must not acknowledge writes."""

    reason = "LEASE_LOST"


class LeaseLapsed(LeaseLost):
    """The lease is past its bound and not renewed yet: acknowledge nothing until it is (or is lost)."""

    reason = "LEASE_LAPSED"


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    """Timing of the leader lease, seconds.

    ttl_seconds: how long a lease lasts without renewal (also the KV bucket's TTL). Failover
        takes about this long after the leader dies.
    renew_seconds: renewal period of the leader; well inside the TTL (at most ttl/3) so two
        renewals can fail before the lease lapses.
    poll_seconds: how often a standby looks at the key.
    margin_seconds: the leader stops acknowledging this long before its lease could have lapsed.
    lapse_seconds: how long a lapsed leader keeps trying to renew (it serves nothing meanwhile)
        before it gives the lease up; covers a JetStream Raft election (4-9 s). The bucket TTL
        is ttl + lapse_seconds.
    """

    ttl_seconds: float = 2.0
    renew_seconds: float = 0.5
    poll_seconds: float = 0.1
    margin_seconds: float = 0.1
    lapse_seconds: float = 12.0

    def __post_init__(self) -> None:
        if not 0 < self.margin_seconds < self.ttl_seconds / 4:
            raise InvalidArgument(f"margin_seconds must be in (0, ttl/4), got {self.margin_seconds}")
        if not 0 < self.renew_seconds <= self.ttl_seconds / 3:
            raise InvalidArgument(f"renew_seconds ({self.renew_seconds:g}) must be in (0, ttl/3] (ttl "
                                  f"{self.ttl_seconds:g} s): a leader must be able to miss two renewals")
        if not 0 < self.poll_seconds <= self.ttl_seconds:
            raise InvalidArgument(f"poll_seconds must be in (0, ttl], got {self.poll_seconds}")
        if self.lapse_seconds < 0:
            raise InvalidArgument(f"lapse_seconds must be >= 0, got {self.lapse_seconds}")

    @property
    def bucket_ttl_seconds(self) -> float:
        return self.ttl_seconds + self.lapse_seconds


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or last held) the key, as written in its value."""

    node: str
    address: str
    epoch: int
    revision: int

    @classmethod
    def parse(cls, value: bytes, revision: int) -> Holder:
        try:
            v = json.loads(value)
            return cls(str(v["node"]), str(v.get("address", "")), int(v.get("epoch", 0)), revision)
        except (ValueError, KeyError, TypeError):
            return cls("?", "", 0, revision)


class Lease:
    """The leader key of one deployment, seen from one manager process (see the module doc).

    node: this process's id (unique per process); address: its gRPC address for clients.
    clock: monotonic seconds (injectable for tests). Counters: renewals, renew_failures.
    """

    def __init__(self, link: NatsLink, config: LeaseConfig, node: str, address: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link, self.config, self.node, self.address = link, config, node, address
        self.bucket = link.config.leader_bucket
        self.clock = clock
        self.epoch = 0
        self.revision = 0              # revision of our last successful write (while held)
        self.valid_until = 0.0         # clock() bound of the lease (while held)
        self.held = False
        self.lost: str | None = None
        self.renewals = 0
        self.renew_failures = 0
        self.holder: Holder | None = None        # the last holder this process observed
        self._seen: tuple[int, float] | None = None   # (revision, clock() when first seen)
        self._on_lost: Callable[[str], None] | None = None
        self._renewer: asyncio.Future[Any] | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)     # notified on every renewal and on loss
        try:
            self.kv = link.call(self._ensure_bucket(), max(10.0, 3 * link.config.request_seconds),
                                f"opening the lease bucket {self.bucket}")
        except nats.errors.Error as err:
            raise StoreError(f"opening the lease bucket {self.bucket}: {type(err).__name__}: {err}") from None

    async def _ensure_bucket(self) -> Any:
        js, c = self.link.js, self.link.config
        try:
            return await js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await js.create_key_value(api.KeyValueConfig(
                    bucket=self.bucket, ttl=self.config.bucket_ttl_seconds, history=1, replicas=c.replicas,
                    storage=api.StorageType.FILE, description="kvservice leader lease"))
            except nats.js.errors.BadRequestError as refused:
                try:
                    return await js.key_value(self.bucket)     # created meanwhile by another manager
                except nats.js.errors.BucketNotFoundError:
                    # not created by anyone: the refusal was real (on a cluster still electing or
                    # missing peers, a replicated bucket cannot be placed yet); say why
                    raise StoreError(f"creating the lease bucket {self.bucket} ({c.replicas} replicas) was "
                                     f"refused: {refused.description or refused}") from None

    def _value(self) -> bytes:
        return json.dumps({"node": self.node, "address": self.address, "epoch": self.epoch}).encode()

    # ---- taking the lease (standby) -----------------------------------------------------------------
    def try_acquire(self) -> bool:
        """One look at the key; take it if it is free or its revision stood still for a whole TTL."""
        if self.held:
            return True
        if self.lost is not None:
            return False
        return self.link.call(self._try_acquire(), self.link.config.request_seconds * 2 + 1.0,
                              "reading (and maybe taking) the leader key")

    async def _try_acquire(self) -> bool:
        now = self.clock()
        try:
            entry = await self.kv.get(KEY)
        except nats.js.errors.KeyNotFoundError:
            return await self._take(None)
        except BaseException:
            self._seen = None          # unreadable: whether the leader renews is unknown, start over
            raise
        self.holder = Holder.parse(entry.value, entry.revision)
        if self.holder.node == self.node:
            return await self._take(entry.revision)    # our own take timed out but landed: nobody wrote since
        if self._seen is None or self._seen[0] != entry.revision:
            self._seen = (entry.revision, now)
            return False
        if now - self._seen[1] < self.config.ttl_seconds:
            return False
        log.info("leader %s (epoch %d) did not renew revision %d for %.2f s; taking over", self.holder.node,
                    self.holder.epoch, entry.revision, now - self._seen[1])
        return await self._take(entry.revision)

    def take_due(self) -> float | None:
        """clock() from which the revision this standby reads unchanged may be taken (first read + TTL), or None
        (none seen yet): the follower looks again exactly then, not up to a poll later."""
        seen = self._seen
        return None if seen is None or self.held else seen[1] + self.config.ttl_seconds

    async def _take(self, revision: int | None) -> bool:
        sent = self.clock()
        try:
            if revision is None:
                rev = await self.kv.create(KEY, self._value())
            else:
                rev = await self.kv.update(KEY, self._value(), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False                               # another contender won
        with self._changed:
            self.revision, self.valid_until, self.held = rev, sent + self.config.ttl_seconds - \
                self.config.margin_seconds, True
        self._seen = None
        return True

    # ---- holding it (leader) -------------------------------------------------------------------------
    def start_renewing(self, epoch: int, on_lost: Callable[[str], None]) -> None:
        """Renew from now on, writing `epoch` into the key; on_lost(why) once if the lease is lost."""
        if not self.held:
            raise LeaseLost("start_renewing without holding the lease")
        self.epoch, self._on_lost = epoch, on_lost
        self._renewer = asyncio.run_coroutine_threadsafe(self._renew_loop(), self.link.loop)

    async def _renew_loop(self) -> None:
        c = self.config
        failed = 0                             # renewals failed in a row
        while self.held:
            await asyncio.sleep(c.renew_seconds)
            while self.held:
                sent = self.clock()
                if sent - self.valid_until > c.lapse_seconds:
                    silent = sent - self.valid_until + c.ttl_seconds
                    self._lose(f"lease lapsed: no renewal succeeded for {silent:.1f} s")
                    return
                try:
                    rev = await asyncio.wait_for(self.kv.update(KEY, self._value(), last=self.revision),
                                                 max(c.renew_seconds, 0.25))
                except nats.js.errors.KeyWrongLastSequenceError:
                    mine = await self._own_revision()
                    if mine is None:
                        self._lose("another manager holds the leader key (renewal refused: its revision moved)")
                        return
                    self.revision = mine       # an earlier renewal that timed out here had landed: adopt it
                    continue
                except (TimeoutError, nats.errors.Error, OSError) as err:
                    self.renew_failures += 1
                    failed += 1
                    log.warning("lease renewal failed (%s: %s); %s", type(err).__name__, err,
                                f"{self.valid_until - self.clock():.2f} s left" if self.clock() < self.valid_until
                                else "lapsed: serving nothing until a renewal succeeds")
                    if failed % 2 == 0:
                        await self._move_to_another_server()
                    await asyncio.sleep(min(0.1, c.renew_seconds / 4))
                    continue
                failed = 0
                with self._changed:
                    if self.held:
                        if self.clock() >= self.valid_until:
                            log.warning("lease renewed after a lapse of %.2f s: serving again",
                                        self.clock() - self.valid_until)
                        self.revision, self.valid_until = rev, sent + c.ttl_seconds - c.margin_seconds
                    self._changed.notify_all()
                self.renewals += 1
                break

    async def _move_to_another_server(self) -> None:
        """Two renewals in a row got no answer: the server this connection uses may be cut off from its
        cluster while the connection itself looks alive (nats-py notices only after its pings go unanswered,
        seconds later than a standby would take the key). Reconnect to another server now."""
        force = getattr(self.link.nc, "force_reconnect", None)
        if force is not None:
            log.warning("lease renewals unanswered through %s: reconnecting to another NATS server",
                        self.link.nc.connected_url.netloc if self.link.nc.connected_url else "?")
            await force()

    async def _own_revision(self) -> int | None:
        """The key's revision if its value is still this process's (a write that timed out but landed), else None."""
        try:
            entry = await self.kv.get(KEY)
        except (nats.js.errors.KeyNotFoundError, nats.errors.Error, OSError, TimeoutError):
            return None
        holder = Holder.parse(entry.value, entry.revision)
        return entry.revision if holder.node == self.node else None

    def check(self) -> None:
        """LeaseLost unless this process holds a lease valid right now (LeaseLapsed while it is being renewed)."""
        if not self.held:
            raise LeaseLost(f"this manager is not the leader ({self.lost or 'standby'})")
        late = self.clock() - self.valid_until
        if late >= 0:
            raise LeaseLapsed(f"the leader lease lapsed {late:.2f} s ago and is not renewed yet (NATS unreachable "
                              "or this process was paused)")

    def wait_valid(self, timeout: float) -> None:
        """Return once the lease is valid; LeaseLost once it is lost, LeaseLapsed after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                try:
                    self.check()
                    return
                except LeaseLapsed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    self._changed.wait(min(left, 0.05))

    @property
    def remaining_seconds(self) -> float:
        return max(0.0, self.valid_until - self.clock()) if self.held else 0.0

    def _lose(self, why: str) -> None:
        with self._changed:
            if not self.held:
                return
            self.held, self.lost = False, why
            self._changed.notify_all()
        log.warning("leadership lost (epoch %d): %s", self.epoch, why)     # the new leader's log says who took it
        if self._on_lost is not None:
            self._on_lost(why)

    def lose(self, why: str) -> None:
        """Give the lease up in memory (e.g. the journal was fenced); the key lapses or is taken."""
        self._lose(why)

    def release(self) -> None:
        """Stop renewing and delete the key if it is still ours (a clean stop: the standby takes over at once)."""
        if self._renewer is not None:
            self._renewer.cancel()
        with self._changed:
            held, self.held = self.held, False
            self.lost = self.lost or "released"
            self._changed.notify_all()
        if held:
            try:
                self.link.call(self.kv.delete(KEY, last=self.revision), self.link.config.request_seconds + 1.0,
                               "releasing the leader key")
                log.info("leader key released (epoch %d)", self.epoch)
            except (StoreError, nats.errors.Error) as err:
                log.warning("could not release the leader key (%s); it lapses in %g s", err, self.config.ttl_seconds)

    def current(self) -> Holder | None:
        """The holder written in the key now (None if absent); a standby's view of the leader."""
        try:
            entry = self.link.call(self.kv.get(KEY), self.link.config.request_seconds + 1.0, "reading the leader key")
        except nats.js.errors.KeyNotFoundError:
            return None
        self.holder = Holder.parse(entry.value, entry.revision)
        return self.holder


__all__ = ["Holder", "Lease", "LeaseConfig", "LeaseLapsed", "LeaseLost"]
