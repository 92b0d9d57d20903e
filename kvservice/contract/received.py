"""A request together with the bytes it arrived as (the manager's Step and StepStream), so that its journal appends
the bytes it received rather than serializing the parsed message again.

The wrapper is transparent to what reads a request before its handler (interceptors: the token's pool
scope, the memory budget): attribute reads go to the message. Handlers take it apart with `unwrap`.
"""

from __future__ import annotations

from typing import Any

#: Methods of kvservice.v1.BlockManager whose handler gets a Received.
KEEP_BYTES = frozenset({"Step", "StepStream"})


class Received:
    """message: the parsed request; data: its bytes as they arrived. Reads of any other attribute go to message."""

    __slots__ = ("data", "message")

    def __init__(self, message: Any, data: bytes) -> None:
        self.message, self.data = message, data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)


def unwrap(request: Any) -> tuple[Any, bytes | None]:
    """(message, its bytes as received or None) of what a handler or an interceptor got."""
    if type(request) is Received:
        return request.message, request.data
    return request, None
