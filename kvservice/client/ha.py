"""Clients of a replicated manager (kvservice serve --state nats://...): find the leader, refuse stale epochs.

LeaderClient (sync, here) and AsyncLeaderClient (asyncio, kvservice/client/aio_ha.py) share LeaderRoute:
the addresses, the current one, the highest epoch seen, and the hooks their StepStreams ask.

Two ways to reach the leader, and both work together:

- One address that only the leader answers behind (the Kubernetes Service: only the leader's
  readiness probe passes). A standby or a dead pod answers UNAVAILABLE or not at all; the retry
  reaches whichever pod is ready by then.
- Several addresses (``"host-a:50051,host-b:50051"``): a call that gets UNAVAILABLE (a standby
  says so at once) or DEADLINE_EXCEEDED (a paused or dead leader) moves to the next address.

Either way a retried mutating call keeps its request_id, so the new leader, which followed
the journal, answers a request the old one applied with the original reply (exactly once).

After a call breaks, the client watches every address's readiness (grpc.health.v1 Watch of the
BlockManager service, SERVING on the leader only): a SERVING report ends the pause before the next
attempt and sends it there, so a new leader is reached as soon as it serves, not a backoff later.
A report is a hint; the reply's epoch is checked as always.

Deadlines (kvservice/client/deadline.py): ``timeout`` bounds the whole call, failover included; an
attempt that has no reply after ``RetryPolicy.attempt_timeout`` (3 s by default: a paused leader)
moves to the next address. A failover takes about one lease (2 s) plus a takeover, so a call with
a 10 s deadline rides it out; ``RetryPolicy(failover=S)`` lets a call with a shorter deadline keep
trying for S seconds while no manager answers.

Every reply of a replicated manager carries the leader's epoch in the initial metadata
``kvservice-leader-epoch``. LeaderClient remembers the highest epoch it has seen and refuses a
reply from a lower one (a deposed leader): the call is retried elsewhere, never returned. The
epoch check comes first; a reply that passes it then goes through the journal-position check
of every client (kvservice/client/position.py): every manager of a deployment serves the same
lineage, so a leader whose journal lost acknowledged entries is refused STATE_ROLLED_BACK.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvservice.client.client import SERVICE, BlockManagerClient, TLSOptions, make_channel
from kvservice.client.deadline import RetryPolicy, client_policy
from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA

#: LeaderClient's default: quick retries within the call's deadline, a silent manager left after 3 s, and no
#: gRPC-level resend (the client moves to the next address instead of asking a standby again).
FAILOVER_RETRY = RetryPolicy(initial_backoff=0.05, max_backoff=0.25, attempt_timeout=3.0, grpc_attempts=1)
_ROTATE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: Seconds before a broken health watch is opened again: first, and at most (doubling in between).
HEALTH_RETRY = (0.05, 1.0)


def leader_epoch(metadata: Any) -> int | None:
    """The epoch in a reply's metadata, or None (a manager without replication)."""
    for key, value in metadata or ():
        if key == EPOCH_METADATA:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def leader_node(metadata: Any) -> str:
    """The node id of the manager that answered (its --node-id), or "" (none given)."""
    return next((str(value) for key, value in metadata or () if key == NODE_METADATA), "")


class StaleLeader(grpc.RpcError):
    """A reply stamped with a lower epoch than one already seen: treated as UNAVAILABLE (retried elsewhere)."""

    def __init__(self, epoch: int, seen: int, target: str) -> None:
        super().__init__()
        self._message = (f"{target} answered as leader epoch {epoch}, but epoch {seen} was already seen: "
                         "a deposed manager; its reply was refused")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple:
        return ()

    def initial_metadata(self) -> tuple:
        return ()


def manager_addresses(targets: str | Sequence[str]) -> list[str]:
    """The addresses of "host:port,host:port" or a sequence of them; ValueError if there is none."""
    out = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if not out:
        raise ValueError("a leader-following client needs at least one manager address")
    return out


class LeaderRoute:
    """Which address is the leader's, and the highest epoch seen: shared by LeaderClient and AsyncLeaderClient.

    A call (unary or a stream's) goes to ``targets[_current]``; one that breaks (UNAVAILABLE, DEADLINE_EXCEEDED)
    or whose reply carries a lower epoch than one seen moves ``_current`` to the next address. Also the three
    hooks a StepStream asks (stream_channel, stream_answered, stream_failed), so the sync and asyncio streams
    follow the leader the same way. epoch: the highest leader epoch seen (0 = none yet); leader_node: node id of
    the manager that sent the last accepted reply; stale_replies: replies refused for a lower epoch.
    """

    targets: list[str]
    _channels: list[Any]          # one grpc.Channel or grpc.aio.Channel per address

    def _follow(self, channels: list[Any]) -> None:
        self._channels = channels
        self._current = 0
        self._lock = threading.Lock()
        self._serving = threading.Condition(self._lock)    # notified when an address reports SERVING
        self.serving_reports = 0         # SERVING reports from the addresses' health watches (see _watch_health)
        self._reports_at_failure = 0     # serving_reports when the last call broke: a later one ends its pause
        self._closed = False
        self.epoch = 0
        self.leader_node = ""
        self.stale_replies = 0

    @property
    def current_target(self) -> str:
        return self.targets[self._current]

    def _rotate(self, index: int) -> None:
        with self._lock:
            self._reports_at_failure = self.serving_reports
            if self._current == index:
                self._current = (index + 1) % len(self.targets)
        self._watch_health()

    def _watch_health(self) -> None:
        """Start watching the addresses' readiness after the first broken call (LeaderClient: threads)."""

    def _reported_serving(self, index: int) -> None:
        """Address `index` reports its BlockManager SERVING (a standby that took over, or a watch (re)started on the
        leader): send the next attempt there, and end a pause that waits for it."""
        with self._serving:
            self._current = index
            self.serving_reports += 1
            self._serving.notify_all()

    def _health_watch(self, index: int) -> Any:
        """Open the readiness watch of address `index` (grpc.health.v1 Watch of the BlockManager service).

        Under the lock, and never once the client is closed (grpc.RpcError then, which ends the watch loop): a
        watch thread that made its stub while close() closed the channel crashed the process (SIGSEGV in grpc)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        request = health_pb2.HealthCheckRequest(service=SERVICE.full_name)
        with self._lock:
            if self._closed:
                raise grpc.RpcError("the client is closed")
            call = self._health_calls[index] = health_pb2_grpc.HealthStub(self._channels[index]).Watch(request)
        return call

    def _health_report(self, index: int, msg: Any) -> float:
        """One message of address `index`'s watch; the delay before watching again if the watch breaks next."""
        from grpc_health.v1 import health_pb2
        if msg.status == health_pb2.HealthCheckResponse.SERVING:
            self._reported_serving(index)
        return HEALTH_RETRY[0]

    def _report_due(self) -> bool:
        return self.serving_reports != self._reports_at_failure or self._closed

    def _failed(self, index: int, err: grpc.RpcError) -> None:
        """A call to address `index` failed with `err`: move on if no manager answered it (a refusal stays)."""
        if err.code() in _ROTATE:
            self._rotate(index)

    def _check_epoch(self, epoch: int | None, index: int) -> None:
        """Record a reply's epoch; StaleLeader (and move to the next address) if it is below one already seen."""
        if epoch is None:
            return
        with self._lock:
            if epoch < self.epoch:
                self.stale_replies += 1
                seen = self.epoch
            else:
                self.epoch, seen = epoch, -1
        if seen >= 0:
            self._rotate(index)
            raise StaleLeader(epoch, seen, self.targets[index])

    def stream_channel(self) -> tuple[int, Any]:
        """A StepStream (or a unary call) opens its next call at the current address."""
        index = self._current
        return index, self._channels[index]

    def stream_answered(self, index: int, metadata: Any) -> None:
        """The first reply of a call on address `index` (a unary reply, or a stream call's first): StaleLeader (the
        call is retried elsewhere, the stream reconnects elsewhere) if its epoch is below one already seen."""
        self._check_epoch(leader_epoch(metadata), index)
        self.leader_node = leader_node(metadata)

    def stream_failed(self, index: int) -> None:
        """A broken stream call (a dead, standby or silent manager): the next one goes to the next address."""
        self._rotate(index)


class LeaderClient(LeaderRoute, BlockManagerClient):
    """A BlockManagerClient over one or more manager addresses that follows the leader (see the module doc).

    targets: "host:port" or "host:port,host:port" or a sequence. timeout: the deadline of each call,
    failover included. retry: default FAILOVER_RETRY. failover: see BlockManagerClient. interceptors:
    client interceptors of every address's unary calls (tracing; tests read each attempt's deadline).
    epoch, leader_node, stale_replies: see LeaderRoute. The asyncio twin: kvservice/client/aio_ha.py.
    """

    def __init__(self, targets: str | Sequence[str], timeout: float = 10.0, retries: int | None = None, *,
                 tls: TLSOptions | None = None, token: str | None = None, retry: RetryPolicy | None = None,
                 registry: Any = None, failover: float | None = None,
                 interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> None:
        self.targets = manager_addresses(targets)
        retry = client_policy(retry, retries, failover, FAILOVER_RETRY)
        channels = [make_channel(t, tls, retry.service_config(SERVICE)) for t in self.targets]
        super().__init__(",".join(self.targets), timeout, channel=channels[0], tls=tls, token=token,
                         retry=retry, registry=registry)
        from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
        self._stubs = [pb_grpc.BlockManagerStub(grpc.intercept_channel(ch, *interceptors) if interceptors else ch)
                       for ch in channels]
        self._stub = LeaderStub(self)             # what BlockManagerClient's calls go through
        self._follow(channels)
        self._watchers: list[threading.Thread] = []
        self._health_calls: dict[int, Any] = {}

    def close(self) -> None:
        with self._serving:
            self._closed = True
            self._serving.notify_all()
        for call in list(self._health_calls.values()):
            call.cancel()
        for ch in self._channels:
            ch.close()

    def _pause(self, seconds: float) -> None:
        """Wait before the next attempt: the backoff, or less once an address reports SERVING after the last
        break (the new leader is served at once instead of after the rest of a backoff)."""
        with self._serving:
            self._serving.wait_for(self._report_due, seconds)

    def _watch_health(self) -> None:
        """One thread per address follows its readiness (grpc.health.v1 Watch of the BlockManager service: SERVING
        on the leader only; a server pushes each change, holding no thread of its own): from the first broken call
        until close()."""
        with self._lock:
            if self._watchers or self._closed:
                return
            self._watchers = [threading.Thread(target=self._health_loop, args=(i,), daemon=True,
                                               name=f"leader-watch-{i}") for i in range(len(self.targets))]
        for th in self._watchers:
            th.start()

    def _health_loop(self, index: int) -> None:
        delay = HEALTH_RETRY[0]
        while not self._closed:
            try:
                for msg in self._health_watch(index):
                    delay = self._health_report(index, msg)
            except grpc.RpcError:      # the manager died or restarts: watch again (a standby says NOT_SERVING)
                pass
            with self._serving:
                self._serving.wait_for(lambda: self._closed, delay)
            delay = min(HEALTH_RETRY[1], 2 * delay)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until one of the addresses accepts a connection (not necessarily the leader)."""
        futures = [grpc.channel_ready_future(ch) for ch in self._channels]
        done = threading.Event()
        for f in futures:
            f.add_done_callback(lambda _f: done.set())
        ok = done.wait(timeout)
        for f in futures:
            f.cancel()
        if not ok:
            from kvservice.client.codec import ClientError
            raise ClientError(grpc.StatusCode.UNAVAILABLE, f"no manager answered at {self.target} within "
                              f"{timeout:.0f} s")

    def _invoke(self, name: str, request: Any, timeout: float | None, metadata: Any) -> Any:
        index = self._current
        try:
            response, call = getattr(self._stubs[index], name).with_call(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            self._failed(index, err)
            raise
        self.stream_answered(index, call.initial_metadata())
        return response

    def watch_events(self, pool: str, from_sequence: int = 0,  # type: ignore[override]
                     timeout: float | None = None) -> LeaderEventStream:
        """The pool's KV event batches from from_sequence on (0 = a reset, then live), resumed across failovers.

        See LeaderEventStream. timeout: of each connection (None = none).
        """
        return LeaderEventStream(self, pool, from_sequence, timeout)


class LeaderEventStream:
    """WatchEvents that follows the leader: on failover it resumes on the new leader from the next sequence.

    Iterate for pb.KVEventBatch messages, as from BlockManagerClient.watch_events. When the stream
    breaks with UNAVAILABLE or DEADLINE_EXCEEDED (the leader died, was deposed or paused) or a
    manager answers with a lower epoch than seen, it reconnects to the next address with
    ``from_sequence`` = the last batch received + 1, retrying as the client's RetryPolicy allows
    (for the client's timeout, or its failover bound if longer, anew once a batch arrives). A standby
    numbers batches as the leader did (they are rebuilt from the same journal entries), so the batches
    resume with no gap and no duplicate. A batch split over several messages (``more``) is yielded only
    once all its parts arrived, so a break inside one never repeats a part. If the new leader no longer holds the
    batches asked for (more than its ring retains were missed, or it recovered from a snapshot
    newer than them), the first batch after the reconnection is a *reset* (``reset`` set,
    AllBlocksCleared and then the whole cache, ``reset_reason`` says why), exactly as
    after a manager restart. Other errors raise ClientError. reconnects: how many times it resumed.
    """

    def __init__(self, client: LeaderClient, pool: str, from_sequence: int, timeout: float | None) -> None:
        self._client, self.pool, self.timeout = client, pool, timeout
        self.next_sequence = from_sequence
        self.reconnects = 0
        self._call: Any = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()

    def __iter__(self) -> Iterator[Any]:
        from kvservice.client.codec import ClientError
        from kvservice.client.deadline import CallBudget
        from kvservice.v1 import block_manager_pb2 as pb
        c = self._client
        budget: CallBudget | None = None
        while not self._cancelled:
            index = c._current
            req = pb.WatchEventsRequest(pool=self.pool, from_sequence=self.next_sequence)
            call = self._call = c._stubs[index].WatchEvents(req, timeout=self.timeout, metadata=c._metadata)
            parts: list[Any] = []
            try:
                if self._cancelled:
                    call.cancel()
                c._check_epoch(leader_epoch(call.initial_metadata()), index)
                for msg in call:
                    parts.append(msg)
                    if msg.more:
                        continue
                    budget = None                    # progress: a later failover gets a whole budget again
                    self.next_sequence = msg.sequence + 1
                    yield from parts
                    parts = []
                return                               # the server ended it (the pool was deleted)
            except GeneratorExit:                    # the consumer closed the stream: end the call with it
                call.cancel()
                raise
            except grpc.RpcError as err:
                if self._cancelled:
                    return
                if err.code() not in _ROTATE:
                    raise ClientError.from_rpc(err) from None
                c._rotate(index)
                call.cancel()                        # a refused epoch leaves its stream open otherwise
                if budget is None:
                    budget = CallBudget(c.retry, self.timeout or c.timeout, "WatchEvents", None, _ROTATE, c.target)
                c._pause(budget.retry_after(err))
                self.reconnects += 1


class LeaderStub:
    """Looks like a BlockManagerStub; every method goes to the client's current address (its ``_invoke``: a
    function for LeaderClient, a coroutine function for AsyncLeaderClient)."""

    def __init__(self, client: LeaderClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        def call(request: Any, timeout: float | None = None, metadata: Any = None) -> Any:
            return self._client._invoke(name, request, timeout, metadata)
        call.__name__ = name
        return call


__all__ = ["EPOCH_METADATA", "FAILOVER_RETRY", "NODE_METADATA", "LeaderClient", "LeaderEventStream", "LeaderRoute",
           "LeaderStub", "StaleLeader", "leader_epoch", "leader_node", "manager_addresses"]
