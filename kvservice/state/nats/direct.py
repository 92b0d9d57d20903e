"""Journal publishes on a NATS connection of their own, written and read by the publishing thread.

The manager's other NATS traffic (lease, standby consumer, snapshots) goes through nats-py on
``journal_nats.NatsLink``'s event-loop thread. A journal append is on every Step's critical path,
and handing it to that loop costs two thread wake-ups, several loop iterations and the GIL
ping-pong between the gRPC threads and the loop (measured in bench/results/ha.md). Here the thread
that appends (the one serving the Step, under the journal lock) sends the ``HPUB`` itself and
blocks in ``recv`` until the JetStream acknowledgement arrives on this connection's reply inbox:
one system call each way, the GIL released while it waits.

The client protocol used (NATS's documented text protocol; plaintext, no credentials, which is
what ``--state nats://HOST:PORT`` accepts): the server's ``INFO``, then ``CONNECT`` (headers and
no-responders on), ``SUB <inbox>.* 1``, ``PING``/``PONG``; ``HPUB subject reply hdr_len total_len``;
replies as ``HMSG``/``MSG``; a server ``PING`` is answered ``PONG`` whenever this connection reads.
Every failure surfaces to the caller (``journal_nats.NatsStore._publish`` retries with the same
``Nats-Msg-Id``, so a retried entry is stored once): a lost connection (OSError, reconnected to the
next server on the next publish), no reply within the timeout (nats.errors.TimeoutError; the
connection stays, and a late reply to an abandoned publish is skipped by its reply subject; the
journal closes it before retrying, so the retry goes to the next server: the one that did not
answer may be cut off from its cluster).
"""

from __future__ import annotations

import itertools
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import nats.errors

from kvservice.contract.errors import KVError


class DirectError(KVError):
    """The direct publish connection cannot be (re)established or the server refused the protocol."""

    reason = "STORE_ERROR"


@dataclass(frozen=True, slots=True)
class Reply:
    """A message received on the reply inbox: its raw header block (b"" if none) and payload."""

    headers: bytes
    data: bytes

    @property
    def no_responders(self) -> bool:
        """NATS's status 503: nothing listens on the subject (a JetStream stream without a leader now)."""
        return self.headers.startswith(b"NATS/1.0 503")


class DirectPublisher:
    """One plaintext NATS connection for request/reply publishes from synchronous threads (see the module doc).

    servers: nats://HOST:PORT URLs (tried in turn); name: the connection name the server shows.
    Thread-safe (one request at a time). max_payload: the server's limit, known once connected.
    """

    def __init__(self, servers: tuple[str, ...], name: str, connect_seconds: float = 2.0,
                 idle_check_seconds: float = 30.0) -> None:
        self.servers = servers
        self.name = name
        self.connect_seconds = connect_seconds
        self.idle_check_seconds = idle_check_seconds
        self._last_io = 0.0
        self.max_payload = 0
        self.connects = 0
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._next = 0
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._inbox = f"_INBOX.kvs{secrets.token_hex(10)}"
        self.server_name = ""                   # the server this connection is on (its INFO); "" if none
        self._preferred: str | None = None      # the server to publish through, if reachable (prefer)
        self._names: dict[str, str] = {}        # url -> the server name it gave when last connected

    # ---- the one operation ---------------------------------------------------------------------
    def request(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Reply:
        """Publish `payload` with `headers` and wait at most `timeout` s for the one reply.

        nats.errors.TimeoutError without a reply in time; OSError or DirectError if the connection
        failed (it is dropped; the next call connects to the next server).
        """
        hdr = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        hb = hdr.encode()
        with self._lock:
            now = time.monotonic()
            deadline = now + timeout
            if self._sock is not None and now - self._last_io >= self.idle_check_seconds:
                self._check_open()
            if self._sock is None:
                self._connect(min(timeout, self.connect_seconds))
            if len(hb) + len(payload) > self.max_payload:
                raise DirectError(f"a journal publish of {len(hb) + len(payload)} bytes exceeds the NATS server's "
                                  f"max_payload of {self.max_payload} bytes")
            token = next(self._tokens)
            reply = f"{self._inbox}.{token}".encode()
            try:
                self._send(b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject.encode(), reply, len(hb), len(hb) + len(payload),
                                                             hb, payload))
                while True:
                    got = self._read_message(deadline)
                    if got is not None and got[0] == reply:
                        self._last_io = time.monotonic()
                        return got[1]
            except TimeoutError:                   # no reply in time; a partial message stays buffered whole
                raise nats.errors.TimeoutError from None
            except (OSError, DirectError):
                self._drop(forget_preference=True)
                raise
            except (ValueError, IndexError) as err:   # a malformed protocol line: this connection is out of step
                self._drop(forget_preference=True)
                raise DirectError(f"the NATS server sent a malformed protocol line ({err})") from None

    def close(self) -> None:
        """Drop the connection (and any preference: the next request connects to the next server in turn)."""
        with self._lock:
            self._drop(forget_preference=True)

    def prefer(self, server_name: str | None) -> None:
        """Publish through the server named server_name from the next request on, if it is one of the servers
        and reachable; None: any server.

        The journal names its stream's Raft leader (NatsStore.prefer_stream_leader): a publish sent to another
        server is forwarded to the leader and its acknowledgement back, two more hops on every append. Only
        the route changes: whichever server receives a publish, the stream leader checks it. A failed request
        or close() forgets the preference, so that a retry goes to the next server as without one.
        """
        with self._lock:
            self._preferred = server_name or None
            if self._sock is not None and self._preferred not in (None, self.server_name):
                self._drop()                       # the next request connects to it (or to any if it cannot)

    # ---- connection ----------------------------------------------------------------------------
    def _connect(self, timeout: float) -> None:
        errors: list[str] = []
        n = len(self.servers)
        order = [(self._next + i) % n for i in range(n)]
        want = self._preferred if n > 1 else None
        if want is not None:                       # the preferred server first: any not known to be another
            for k in order:
                if self._names.get(self.servers[k], want) == want and self._open(k, timeout, errors, want):
                    return
            self._preferred = None                 # not reachable now: any server, in turn, as without one
        for k in order:
            if self._open(k, timeout, errors, None):
                return
        raise DirectError(f"cannot open the journal's NATS connection: {'; '.join(errors)}")

    def _open(self, k: int, timeout: float, errors: list[str], want: str | None) -> bool:
        """Connect to servers[k] (want: only if it is the server of that name); False with the reason in errors."""
        url = self.servers[k]
        parts = urlsplit(url if "://" in url else "nats://" + url)
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout)
        except OSError as err:
            errors.append(f"{url}: {err}")
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._buf = sock, bytearray()
        try:
            line = self._read_line(deadline)
            if not line.startswith(b"INFO "):
                raise DirectError(f"{url} does not speak the NATS protocol (first line {line[:40]!r})")
            info = json.loads(line[5:])
            name = str(info.get("server_name", ""))
            self._names[url] = name
            if want is not None and name != want:
                self._drop()
                return False
            if info.get("tls_required") or info.get("auth_required"):
                raise DirectError(f"{url} requires TLS or credentials, which --state nats:// does not carry")
            if not info.get("headers"):
                raise DirectError(f"{url} does not support message headers (nats-server >= 2.2 needed)")
            self.max_payload = int(info.get("max_payload", 1 << 20))
            connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True,
                       "protocol": 1, "name": self.name, "lang": "python-kvservice-direct", "version": "1"}
            self._send(b"CONNECT %s\r\nSUB %s.* 1\r\nPING\r\n" % (json.dumps(connect).encode(),
                                                                   self._inbox.encode()))
            while self._read_message(deadline, until_pong=True) != "pong":
                pass
        except (OSError, DirectError, ValueError) as err:
            self._drop()
            errors.append(f"{url}: {err}")
            return False
        self._next = (k + 1) % len(self.servers)   # the next reconnection tries another
        self.server_name = name
        self.connects += 1
        self._last_io = time.monotonic()
        return True

    def _check_open(self) -> None:
        """After a quiet spell: read what arrived without waiting; drop the connection if the server closed it.

        A server closes a connection that left its PINGs unanswered for a few minutes (this one
        reads only while publishing); reconnecting now spares the publish a failed try and its retry.
        """
        assert self._sock is not None
        try:
            self._sock.setblocking(False)
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("closed by the server")
                self._buf += chunk
        except BlockingIOError:
            return                                 # open; whatever came is parsed by the next read
        except OSError:
            self._drop()

    def _drop(self, forget_preference: bool = False) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self._buf, self.server_name = None, bytearray(), ""
        if forget_preference:
            self._preferred = None

    # ---- wire ----------------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        self._sock.settimeout(self.connect_seconds)
        try:
            self._sock.sendall(data)
        except TimeoutError:                       # part of a command may be out: the connection is unusable
            raise ConnectionError("the NATS server did not take the journal's data in time") from None

    def _recv(self, deadline: float) -> None:
        assert self._sock is not None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self._sock.settimeout(left)
        chunk = self._sock.recv(65536)             # TimeoutError when nothing came in time
        if not chunk:
            raise ConnectionResetError("the NATS server closed the journal's connection")
        self._buf += chunk

    def _read_line(self, deadline: float) -> bytes:
        i = self._peek_line(deadline)
        line = bytes(self._buf[:i])
        del self._buf[:i + 2]
        return line

    def _peek_line(self, deadline: float) -> int:
        """Index of the CRLF ending the buffered protocol line (reading until there is one); nothing consumed."""
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                return i
            if len(self._buf) > 1 << 16:
                raise DirectError("a NATS protocol line longer than 64 KiB")
            self._recv(deadline)

    def _read_message(self, deadline: float, until_pong: bool = False) -> tuple[bytes, Reply] | str | None:
        """The next protocol item: (reply subject, Reply) for a message, "pong", or None for anything else.

        A message is consumed only once its whole body is buffered, so a timeout in the middle of one
        leaves the buffer at its start and the next call parses it from there.
        """
        i = self._peek_line(deadline)
        line = bytes(self._buf[:i])
        op = line[:5].upper()
        if op.startswith((b"HMSG ", b"MSG ")):
            f = line.split()      # HMSG subject sid [reply] hdr_len total_len, or MSG subject sid [reply] len
            total = int(f[-1])
            hlen = int(f[-2]) if op.startswith(b"HMSG ") else 0
            if not 0 <= hlen <= total <= self.max_payload + (1 << 16):
                raise DirectError(f"a NATS message header with impossible sizes: {line[:80]!r}")
            end = i + 2 + total + 2
            while len(self._buf) < end:
                self._recv(deadline)
            body = bytes(self._buf[i + 2:i + 2 + total])
            del self._buf[:end]
            return f[1], Reply(body[:hlen], body[hlen:])
        del self._buf[:i + 2]
        if op.startswith(b"PING"):
            self._send(b"PONG\r\n")
            return None
        if op.startswith(b"PONG"):
            return "pong" if until_pong else None
        if op.startswith(b"-ERR"):
            raise DirectError(f"NATS: {line[5:].decode(errors='replace').strip()}")
        return None                               # +OK, INFO updates


__all__ = ["DirectError", "DirectPublisher", "Reply"]
