"""Loopback TCP links a fault test controls: partitions between named processes without root.

Every connection a fault test wants to cut goes through a ``Link``: a listening port on
127.0.0.1 that forwards each accepted connection to one upstream port. ``cut()`` partitions it:
nothing is read or written on either side any more and new connections are held unanswered,
so the peers see what a dropped network shows them (no RST, no FIN: silence, then their own
timeouts); bytes already sent wait in the kernel's buffers and flow again after ``heal()``,
as TCP retransmission would deliver them. A connection one side closes is closed on the
other (unless the link is cut: then nothing passes, not even the close).

One thread runs every link of a ``FaultNet`` (a selector loop), so hundreds of forwarded
connections cost no thread each. Only loopback addresses are ever used.

Network namespaces (``ip netns``, a veth pair per process) would cut the same connections in the
kernel and work as root here; the links are used instead because they need no privileges, leave
nothing behind when a test dies, and cut exactly one direction of one peer pair.
"""

from __future__ import annotations

import selectors
import socket
import threading
from dataclasses import dataclass, field

_CHUNK = 1 << 16
_BUFFER = 4 << 20          # bytes held for a slow side before reading from the other stops


@dataclass(eq=False)
class _Pair:
    link: Link
    down: socket.socket                 # the accepted connection (the client's side)
    up: socket.socket | None = None     # to the upstream port (None while the link is cut at accept)
    out: dict = field(default_factory=dict)     # socket -> bytearray waiting to be written to it

    def peer(self, s: socket.socket) -> socket.socket | None:
        return self.up if s is self.down else self.down


class Link:
    """127.0.0.1:<port> -> 127.0.0.1:<upstream>; cut() and heal() at any time (thread-safe)."""

    def __init__(self, net: FaultNet, upstream: int, name: str) -> None:
        self.net, self.upstream, self.name = net, upstream, name
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.is_cut = False
        self.accepted = 0

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        self.is_cut = False


class FaultNet:
    """The links of one test, run by one selector thread; close() ends every connection and the thread."""

    def __init__(self) -> None:
        self.links: list[Link] = []
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="faultnet")
        self._thread.start()

    def link(self, upstream: int, name: str = "") -> Link:
        lk = Link(self, upstream, name or f"->{upstream}")
        with self._lock:
            self.links.append(lk)
        return lk

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for p in self._pairs:
                _close(p.down, p.up)
            for lk in self.links:
                _close(lk.listener)
            self._pairs, self.links = [], []

    # ---- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        sel = self._sel = selectors.DefaultSelector()
        try:
            while not self._stop.is_set():
                with self._lock:
                    links, pairs = list(self.links), list(self._pairs)
                want: dict[socket.socket, tuple[int, object]] = {}
                for lk in links:
                    want[lk.listener] = (selectors.EVENT_READ, lk)
                for p in pairs:
                    if p.link.is_cut:
                        continue
                    if p.up is None:
                        self._connect(p)
                        continue
                    for s in (p.down, p.up):
                        peer = p.peer(s)
                        ev = 0
                        if len(p.out.get(peer, b"")) < _BUFFER:
                            ev |= selectors.EVENT_READ
                        if p.out.get(s):
                            ev |= selectors.EVENT_WRITE
                        if ev:
                            want[s] = (ev, p)
                for key in list(sel.get_map().values()):
                    if key.fileobj not in want:
                        sel.unregister(key.fileobj)
                for s, (ev, data) in want.items():
                    if s.fileno() < 0:
                        continue
                    try:
                        key = sel.get_key(s)
                        if key.events != ev or key.data is not data:
                            sel.modify(s, ev, data)
                    except KeyError:
                        sel.register(s, ev, data)
                for key, ev in sel.select(0.02):
                    if isinstance(key.data, Link):
                        self._accept(key.data)
                    else:
                        self._pump(key.data, key.fileobj, ev)
        finally:
            sel.close()

    def _accept(self, lk: Link) -> None:
        try:
            s, _ = lk.listener.accept()
        except OSError:
            return
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lk.accepted += 1
        with self._lock:
            self._pairs.append(_Pair(lk, s))     # connected upstream by the loop (at once, or once healed)

    def _connect(self, p: _Pair) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", p.link.upstream), timeout=1.0)
        except OSError:                          # the upstream process is down: the client sees a close
            self._drop(p)
            return
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p.up = up

    def _pump(self, p: _Pair, s: socket.socket, ev: int) -> None:
        peer = p.peer(s)
        if ev & selectors.EVENT_READ:
            try:
                data = s.recv(_CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._drop(p)
                return
            if data:
                p.out.setdefault(peer, bytearray()).extend(data)
        if ev & selectors.EVENT_WRITE and p.out.get(s):
            try:
                n = s.send(p.out[s])
            except BlockingIOError:
                n = 0
            except OSError:
                self._drop(p)
                return
            del p.out[s][:n]

    def _drop(self, p: _Pair) -> None:
        for s in (p.down, p.up):               # (loop thread) unregistered before closing: its fd may be reused
            if s is not None:
                try:
                    self._sel.unregister(s)
                except (KeyError, ValueError):
                    pass
        _close(p.down, p.up)
        with self._lock:
            if p in self._pairs:
                self._pairs.remove(p)


def _close(*socks: socket.socket | None) -> None:
    for s in socks:
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


__all__ = ["FaultNet", "Link"]


def dead_address() -> str:
    """host:port on 127.0.0.1 that nothing listens on: a port the kernel just handed out, closed again."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"
