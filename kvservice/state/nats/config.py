"""Where the replicated state lives (NatsConfig, ``--state nats://...``), what its store raises, and the retry
managers started together need while JetStream creates the stream and buckets."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvservice.contract.errors import InvalidArgument, KVError

log = logging.getLogger("kvservice.nats")
T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class StoreError(KVError):
    """The replicated store cannot do what was asked (unreachable, refused, corrupt)."""

    reason = "STORE_ERROR"


class Unrecoverable(StoreError):
    """The replicated state is missing or damaged (no stream there, a corrupt snapshot or message): waiting
    changes nothing, so retry_startup does not retry it (unlike a stream being created or elected)."""


class Fenced(StoreError):
    """Another writer appended to the stream: this store's view is stale and it may not write."""

    reason = "FENCED"


def retry_startup(what: str, attempt: Callable[[], T], seconds: float = 60.0) -> T:
    """attempt() until it does not raise StoreError (JournalGap, Fenced, Unrecoverable excepted), for up to `seconds`.

    Managers started together on a fresh deployment create the stream and the buckets at the same
    time, and JetStream answers requests about an asset being created (or a stream being elected)
    with timeouts meanwhile: each of them retries instead of exiting.
    """
    deadline = time.monotonic() + seconds
    delay = 0.2
    while True:
        try:
            return attempt()
        except (JournalGap, Fenced, Unrecoverable):
            raise
        except StoreError as err:
            if time.monotonic() + delay > deadline:
                raise StoreError(f"{what}: still failing after {seconds:g} s: {err.message}") from None
            log.warning("%s: %s; retrying", what, err.message)
        time.sleep(delay)
        delay = min(2.0, delay * 2)


class JournalGap(StoreError):
    """Entries between what this store has and what the stream holds were purged (a snapshot overtook us)."""

    reason = "JOURNAL_GAP"


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """Where and how the replicated state lives.

    servers: NATS URLs of the cluster (any subset reaches all of it).
    name: deployment name; stream KVS_<name>, buckets KVS_<name>_snapshots and KVS_<name>_leader.
    replicas: JetStream replicas of the stream and buckets (3 in production: survives one node; 1 for dev).
    request_seconds: deadline of one request to NATS (publish, info, get).
    append_seconds: how long an append keeps retrying a publish that timed out or found no stream
        leader (a JetStream Raft election takes 4-9 s after a node dies) before the journal fails.
    """

    servers: tuple[str, ...]
    name: str = "kvservice"
    replicas: int = 1
    request_seconds: float = 2.0
    append_seconds: float = 15.0

    def __post_init__(self) -> None:
        if not self.servers:
            raise InvalidArgument("--state nats://HOST:PORT needs at least one NATS server")
        if not _NAME.match(self.name):
            raise InvalidArgument(f"NATS name {self.name!r} must match [A-Za-z0-9_-]{{1,32}}")
        if self.replicas not in (1, 3, 5):
            raise InvalidArgument(f"replicas must be 1, 3 or 5 (a Raft group of an odd size), got {self.replicas}")
        if self.request_seconds <= 0 or self.append_seconds < self.request_seconds:
            raise InvalidArgument("request_seconds must be > 0 and append_seconds >= request_seconds")

    @property
    def stream(self) -> str:
        return f"KVS_{self.name}"

    @property
    def subject(self) -> str:
        return f"kvs.{self.name}.journal"

    @property
    def snapshot_bucket(self) -> str:
        return f"KVS_{self.name}_snapshots"

    @property
    def leader_bucket(self) -> str:
        return f"KVS_{self.name}_leader"

    @property
    def url(self) -> str:
        return ",".join(self.servers)


def parse_state_url(url: str, **fields: Any) -> NatsConfig:
    """NatsConfig of ``--state nats://h1:4222,nats://h2:4222`` (``nats://h1:4222,h2:4222`` works too)."""
    if not url.startswith("nats://"):
        raise InvalidArgument(f"--state {url!r}: expected 'memory' or nats://HOST:PORT[,HOST:PORT...]")
    servers = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = "nats://" + part
        host_port = part.split("://", 1)[1].rstrip("/")
        if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:\d{1,5}", host_port):
            raise InvalidArgument(f"--state: {part!r} is not nats://HOST:PORT")
        servers.append(part.rstrip("/"))
    return NatsConfig(tuple(servers), **fields)
