"""Domain errors: a caller mistake or a refused request, with text a person can act on.

Each error carries a ``reason`` (a stable UPPER_SNAKE word for machines) and
``metadata`` (string key/values, e.g. how many slots were needed and free). The
gRPC adapter maps the class to a status code in one place (kvservice/contract/status.py).
"""

from __future__ import annotations


class KVError(Exception):
    """Base class of every error the domain core raises on purpose."""

    reason = "KV_ERROR"

    def __init__(self, message: str, reason: str | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = {k: str(v) for k, v in metadata.items()}


class InvalidArgument(KVError):
    """Malformed input: wrong shape, dtype, sign, or an impossible configuration."""

    reason = "INVALID_ARGUMENT"


class FailedPrecondition(KVError):
    """A configuration a named kernel backend cannot run, or a state that forbids the call."""

    reason = "FAILED_PRECONDITION"


class ResourceExhausted(KVError):
    """Not enough free slots; the message says how many were needed and free."""

    reason = "RESOURCE_EXHAUSTED"


class NotFound(KVError):
    """Unknown pool or sequence id."""

    reason = "NOT_FOUND"


class AlreadyExists(KVError):
    """Pool or sequence id already taken."""

    reason = "ALREADY_EXISTS"


class StateError(KVError):
    """A state dir (or snapshot) that cannot be served: busy, damaged, missing parts, or from another format.

    The message says what is wrong and what to do; ``problems`` lists every finding of a check.
    """

    reason = "STATE_ERROR"

    def __init__(self, message: str, reason: str | None = None, problems: list[str] | None = None,
                 **metadata: object) -> None:
        super().__init__(message, reason, **metadata)
        self.problems = list(problems or [message])


class JournalUnavailable(Exception):
    """The journal can no longer make changes durable: the call is refused UNAVAILABLE (fail-stop).

    Not a KVError: it says nothing about the request, only that this manager must restart.
    """
