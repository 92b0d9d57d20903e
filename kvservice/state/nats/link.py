"""NatsLink: one NATS connection on its own event-loop thread, for synchronous callers.

Threading: nats-py is asyncio-only while the manager is synchronous (gRPC thread pool, one
journal lock). A ``NatsLink`` owns one NATS connection on its own event-loop thread; sync code
submits coroutines with ``asyncio.run_coroutine_threadsafe`` and waits with a timeout
(``NatsLink.call``), and a coroutine still running at the timeout is cancelled. Code that
already runs on the loop (the lease renewer) awaits directly and never calls ``call``. The
journal's publishes (appends and fences, one per Step) skip the loop: ``NatsLink.direct`` is a
connection of their own that the appending thread writes and reads itself (kvservice/state/nats/direct.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats
import nats.errors

from kvservice.state.nats import NATS_SERVER_VERSION
from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.direct import DirectPublisher

log = logging.getLogger("kvservice.nats")
T = TypeVar("T")


class NatsLink:
    """One NATS connection on a dedicated event-loop thread, usable from synchronous code (see module doc)."""

    def __init__(self, config: NatsConfig, client_name: str = "kvservice", connect_seconds: float = 10.0) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="nats-loop")
        self._thread.start()
        self.disconnects, self.closing, self.last_error = 0, False, None   # last_error: nats-py's, for a failed connect
        #: The journal's publishes: a connection of their own, used by the appending thread (state/nats/direct.py).
        self.direct = DirectPublisher(config.servers, f"{client_name}-journal", config.request_seconds)
        try:
            self.nc = self.call(self._connect(client_name, connect_seconds), connect_seconds + 5.0, "connecting")
        except BaseException:
            self._stop_loop()
            raise
        self.js = self.nc.jetstream(timeout=config.request_seconds)
        v = self.nc.connected_server_version
        try:
            self.server_version = f"{v.major}.{v.minor}.{v.patch}"
        except ValueError:                          # not a semantic version (a development build)
            self.server_version = repr(v)
        if self.server_version != NATS_SERVER_VERSION:
            log.warning("NATS server %s at %s; kvservice is tested with %s (docs/HA.md, 'One NATS version'): "
                        "run that version", self.server_version, config.url, NATS_SERVER_VERSION)

    async def _connect(self, client_name: str, connect_seconds: float) -> nats.NATS:
        deadline = time.monotonic() + connect_seconds      # kept strictly: nothing is left running on the loop
        while True:
            try:
                return await asyncio.wait_for(nats.connect(
                    servers=list(self.config.servers), name=client_name, connect_timeout=1,
                    reconnect_time_wait=0.1, max_reconnect_attempts=-1, ping_interval=2, max_outstanding_pings=2,
                    error_cb=self._on_error, disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect,
                    allow_reconnect=True), max(0.05, deadline - time.monotonic()))
            except (TimeoutError, OSError, nats.errors.Error) as err:
                if time.monotonic() + 0.2 >= deadline:
                    raise StoreError(f"cannot reach NATS at {self.config.url}: connecting gave up after "
                                     f"{connect_seconds:g} s (last: {self.last_error or err!r})") from None
                await asyncio.sleep(0.2)

    async def _on_error(self, err: Exception) -> None:
        self.last_error = err
        log.debug("NATS: %s: %s", type(err).__name__, err)

    async def _on_disconnect(self) -> None:
        if self.closing:
            return
        self.disconnects += 1
        log.warning("NATS: disconnected from %s; reconnecting", self.config.url)

    async def _on_reconnect(self) -> None:
        url = self.nc.connected_url
        log.warning("NATS: reconnected to %s", url.netloc if url else "?")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str = "a request") -> T:
        """Run `coro` on the loop and wait at most `timeout` seconds (then cancel it and raise StoreError).

        what: the call, as a StoreError names it ("listing snapshots"). A NATS request inside `coro` that
        times out by itself (nats-py's own deadline) is told apart from this wait running out: both
        messages say which call and after how long.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("NatsLink.call from the loop thread would wait on itself; await instead")
        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as err:      # (the builtin TimeoutError, as nats-py's are)
            spent = time.monotonic() - t0
            if fut.done():
                raise StoreError(f"NATS timed out {what} after {spent:.2f} s ({type(err).__name__}"
                                 f"{': ' + str(err) if str(err) else ''}; {self.config.url})") from None
            fut.cancel()
            raise StoreError(f"NATS did not answer {what} within {timeout:g} s ({self.config.url})") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.closing = True
        self.direct.close()
        if not self.nc.is_closed:
            try:
                self.call(self.nc.close(), 5.0)
            except (StoreError, nats.errors.Error) as err:
                log.debug("NATS close: %s", err)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
