"""The deadline of one logical call and how it is retried inside it (every client: unary, asyncio, streams, HA).

A call's ``timeout`` is its deadline, as in gRPC: the whole call, every attempt and every pause
included, ends within it. Each attempt is sent with the time that remains as its gRPC deadline
(deadline propagation), so a dead address costs ``timeout`` and not a second more.

Retries inside that deadline happen at two levels, both with the same request bytes (so a mutating
call keeps its one request_id and the manager applies it at most once):

- gRPC's own: the channel carries :meth:`RetryPolicy.service_config` (gRFC A6 ``retryPolicy`` and
  ``waitForReady``), so gRPC resends an attempt that failed UNAVAILABLE (``grpc_attempts`` tries in
  all, gRPC's backoff between them). Any gRPC client, in any language, can load the same JSON.
- the client's: a call that still failed UNAVAILABLE (no manager answered: a restart, a failover, a
  standby that is not the leader) is issued again after a pause, until the deadline. A
  LeaderClient also moves to the next address then.

Keep trying across a failover: ``RetryPolicy.failover`` (seconds, 0 = off) is a bound of its own for
a call that met no manager. Such a call may go on until ``failover`` seconds after it started, past
``timeout``; a call whose every attempt reached a manager (a slow one, say) never does. A scheduler
can so keep a short iteration deadline and still ride out a failover (about 2-3 s) or a restart.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from kvservice.client.codec import ClientError

#: The clock of every deadline (tests wrap it to read the arithmetic of a call).
clock = time.monotonic
#: A deadline with less than this left is not worth another attempt, seconds.
MIN_ATTEMPT_SECONDS = 0.005
#: Codes after which a call is issued again: no manager answered it (an attempt cut by attempt_timeout too).
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How one logical call is retried within its deadline (the client's ``timeout``).

    attempts: most times the client issues a call, 0 = as many as the deadline allows, 1 = once (and no
        gRPC retries either).
    initial_backoff, max_backoff, multiplier: seconds; the pause before issue k + 1 is uniform in [d/2, d],
        d = min(max_backoff, initial_backoff * multiplier**k), cut to what the deadline leaves. gRPC's
        retryPolicy uses the same three (initialBackoff, maxBackoff, backoffMultiplier).
    failover: seconds from its start that a call which met no manager (UNAVAILABLE) keeps trying, even past
        ``timeout`` (0 = never past it): "keep trying across a failover", with this bound.
    attempt_timeout: most seconds one attempt may wait for its reply (0 = all the deadline leaves). A
        LeaderClient uses it to leave a paused leader for the next address.
    grpc_attempts: gRPC's ``maxAttempts`` (1-5; 1 = no retryPolicy) of the channel's service config: tries of one
        issue on UNAVAILABLE.
        gRPC's resends are quick (its backoff capped at initial_backoff * multiplier), so that a call learns
        soon that nobody answers; the longer pauses are the client's.
    wait_for_ready: gRPC's ``waitForReady``: an attempt waits for a connection until the deadline instead of
        failing UNAVAILABLE at once (its error then says less: DEADLINE_EXCEEDED, not why it did not connect).
    deadline: the name ``failover`` had when a timeout bounded one attempt only (kept for callers of then).
    """

    attempts: int = 0
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0
    failover: float = 0.0
    attempt_timeout: float = 0.0
    grpc_attempts: int = 3
    wait_for_ready: bool = False
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.deadline is not None:
            object.__setattr__(self, "failover", max(self.failover, self.deadline))
            object.__setattr__(self, "deadline", None)
        if not 1 <= self.grpc_attempts <= 5:
            raise ValueError(f"grpc_attempts must be 1..5 (gRPC's cap on maxAttempts), got {self.grpc_attempts}")
        if self.attempts < 0 or self.failover < 0 or self.attempt_timeout < 0:
            raise ValueError("attempts, failover and attempt_timeout must be >= 0")

    def backoff(self, attempt: int) -> float:
        """Pause before issue attempt + 2 (attempt counts from 0), seconds."""
        d = min(self.max_backoff, self.initial_backoff * self.multiplier ** attempt)
        return random.uniform(d / 2, d)

    def service_config(self, service: ServiceDescriptor, resend: frozenset[str] | None = None) -> str:
        """This policy as a gRPC service config (JSON), the channel option ``grpc.service_config``.

        service: the service's descriptor. resend: the unary methods gRPC may resend (None = all of them:
        every mutating BlockManager call carries a request_id); streams are never resent by gRPC (their
        clients reconnect themselves). Every method gets ``waitForReady``.
        """
        retry = {"maxAttempts": self.grpc_attempts, "initialBackoff": f"{self.initial_backoff:g}s",
                 "maxBackoff": f"{min(self.max_backoff, self.initial_backoff * self.multiplier):g}s",
                 "backoffMultiplier": self.multiplier,
                 "retryableStatusCodes": ["UNAVAILABLE"]}
        unary = [m.name for m in service.methods if not (m.client_streaming or m.server_streaming)]
        resent = [m for m in unary if resend is None or m in resend] if self.attempts != 1 and self.grpc_attempts > 1 \
            else []
        configs = [{"name": [{"service": service.full_name}], "waitForReady": self.wait_for_ready}]
        if resent:
            configs.insert(0, {"name": [{"service": service.full_name, "method": m} for m in resent],
                               "waitForReady": self.wait_for_ready, "retryPolicy": retry})
        return json.dumps({"methodConfig": configs})


def client_policy(retry: RetryPolicy | None, retries: int | None, failover: float | None,
                  default: RetryPolicy = RetryPolicy()) -> RetryPolicy:
    """A client's RetryPolicy from its arguments: `retry`, else `default` with `retries` extra attempts (0 = never
    retry) if given; `failover` (seconds), if given, replaces the policy's."""
    policy = retry or (default if retries is None else dataclasses.replace(default, attempts=1 + max(0, retries)))
    return policy if failover is None else dataclasses.replace(policy, failover=failover)


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of a grpc.RpcError or a ClientError (UNKNOWN for anything else)."""
    code = getattr(exc, "code", None)
    code = code() if callable(code) else code
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def client_error(exc: BaseException, request_id: str | None = None) -> ClientError:
    if isinstance(exc, ClientError):
        return exc
    return ClientError.from_rpc(exc, request_id)  # type: ignore[arg-type]


class CallBudget:
    """Deadline and pauses of one logical call (sync and asyncio clients, StepStream, LeaderEventStream).

    policy: the client's RetryPolicy. timeout: the call's deadline, seconds from now. name: the RPC, and
    target: the address(es) it goes to, for messages. request_id: its idempotency key (None for reads).
    codes: the codes after which it is issued again (a subset of RETRY_CODES).
    """

    def __init__(self, policy: RetryPolicy, timeout: float, name: str, request_id: str | None,
                 codes: tuple[grpc.StatusCode, ...] = RETRY_CODES, target: str = "") -> None:
        self.policy, self.timeout, self.name, self.request_id, self.codes = policy, timeout, name, request_id, codes
        self.target = target
        self.start = clock()
        self.deadline = self.start + timeout
        self.tries = 0
        self.cut = False               # the last attempt was given less than the deadline left (attempt_timeout)
        self.unavailable = ""          # the last UNAVAILABLE message of this call (why no manager answered)

    def remaining(self) -> float:
        return self.deadline - clock()

    def attempt_timeout(self) -> float:
        """The gRPC deadline of the next attempt: what remains of the call's (at most policy.attempt_timeout)."""
        self.tries += 1
        left = self.remaining()
        cap = self.policy.attempt_timeout
        self.cut = bool(cap) and cap < left
        return max(0.001, min(left, cap) if self.cut else left)

    def no_manager(self, code: grpc.StatusCode) -> bool:
        """Has this call met no manager (refused, not connected, a standby, a silent one cut short)? Once it has,
        a later DEADLINE_EXCEEDED may be gRPC's own resends running out of time: it stays in failover."""
        return code == grpc.StatusCode.UNAVAILABLE or self.cut or bool(self.unavailable)

    def pause_or_raise(self, exc: BaseException) -> float:
        """Seconds to wait before issuing the call again; raises ClientError if it must stop now."""
        code = code_of(exc)
        if code not in self.codes:
            raise client_error(exc, self.request_id) from None
        if code == grpc.StatusCode.UNAVAILABLE:
            self.unavailable = client_error(exc).message
        if self.no_manager(code) and self.policy.failover:     # the failover bound applies
            self.deadline = max(self.deadline, self.start + self.policy.failover)
        left = self.remaining()
        limit = self.policy.attempts
        if (limit and self.tries >= limit) or left <= 2 * MIN_ATTEMPT_SECONDS:
            raise self.gave_up(exc) from None
        return min(self.policy.backoff(self.tries - 1), left - MIN_ATTEMPT_SECONDS)

    def retry_after(self, exc: BaseException) -> float:
        """pause_or_raise for a call with no deadline of its own that broke (a WatchEvents stream): the
        failure counts as an attempt that met no manager."""
        self.tries += 1
        self.cut = True
        return self.pause_or_raise(exc)

    def gave_up(self, exc: BaseException) -> ClientError:
        """The error of a call that stops: UNAVAILABLE if it met no manager (its last attempt may have been cut
        by the deadline), else its last code; naming the call, its target, its deadline and why it could not
        connect."""
        err = client_error(exc, self.request_id)
        spent = clock() - self.start
        bound = self.deadline - self.start
        where = f" to {self.target}" if self.target else ""
        tries = f"{self.tries} attempt{'s' * (self.tries != 1)} in {spent:.1f} s"
        none = self.no_manager(err.code)
        code = grpc.StatusCode.UNAVAILABLE if none and err.code in RETRY_CODES else err.code
        if none:
            what = f"no manager answered within its {bound:.3g} s deadline ({tries})"
        elif err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            what = f"no reply within its {bound:.3g} s deadline ({tries})"
        else:
            what = f"gave up after {tries} of its {bound:.3g} s deadline"
        last = f"{err.code.name}: {err.message}"
        if self.unavailable and self.unavailable != err.message:
            last += f"; before: UNAVAILABLE: {self.unavailable}"
        again = (f"; it may or may not have been applied: call again with request_id={self.request_id!r} (safe: "
                 "the manager answers a retry with the original reply)") if self.request_id else ""
        return ClientError(code, f"{self.name}{where}: {what} (last: {last}){again}", "RETRIES_EXHAUSTED",
                           {**err.metadata, "attempts": str(self.tries), "last_reason": err.reason,
                            "last_code": err.code.name, "deadline_seconds": f"{bound:.3f}",
                            **({"target": self.target} if self.target else {})},
                           self.request_id)
