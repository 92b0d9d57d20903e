"""Who may reach a pool's ZeroMQ sockets, and how often its replay socket works for one peer.

- Loopback by default: a socket the manager *binds* must be on a loopback address (tcp on 127.0.0.0/8,
  ::1 or localhost; ipc:// and inproc:// are local too) unless ``--kv-events-allow-remote`` asks for
  more (:func:`check_bind`). Batches carry users' prompt tokens; a wildcard ``tcp://*:5557`` would
  hand them to anyone who reaches the port.
- CURVE (optional, :class:`CurveKeys`): the bound sockets are CURVE servers with the secret key of
  ``--kv-events-curve-secret`` and a ZAP handler that admits only the client public keys found in
  ``--kv-events-curve-clients`` (a directory of ``*.key`` certificates, as ``zmq.auth.create_certificates``
  writes them). Any other client fails the handshake and never reaches the socket.
- Replay rate (:class:`ReplayLimiter`): a token bucket per peer (its CURVE key, else its IP address,
  else its routing id) and a shared one of ALL_PEERS_FACTOR times its size; a request past either is
  answered at once with the end marker and a reason, never served.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvservice.contract.errors import InvalidArgument

#: Replay requests one peer may send per second on average, and at once (the bucket's size).
DEFAULT_REPLAY_RATE = 2.0
DEFAULT_REPLAY_BURST = 10
#: Peers the limiter remembers (the least recently seen is forgotten first: its bucket starts full again).
MAX_PEERS = 4096
#: All peers together may use this many times one peer's rate and burst (many addresses, e.g. of one IPv6
#: prefix, do not multiply the work).
ALL_PEERS_FACTOR = 8


def endpoint_is_local(endpoint: str) -> bool:
    """True if a socket bound to `endpoint` can be reached only from this machine: ipc://, inproc://, or a
    tcp://, ws:// ... address on a loopback interface. A wildcard (*, 0.0.0.0, ::), another address, an
    interface name or a host name is not."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.rsplit(";", 1)[-1].strip("[]")          # tcp://source;host:port binds host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(endpoint: str, flag: str, allow_remote: bool) -> None:
    """InvalidArgument for a bind on a non-loopback address that --kv-events-allow-remote did not ask for."""
    if not allow_remote and not endpoint_is_local(endpoint):
        raise InvalidArgument(
            f"{flag} {endpoint} would bind a ZeroMQ socket reachable from other machines, and KV events carry users' "
            "prompt tokens; bind a loopback address (tcp://127.0.0.1:PORT) or ipc://, or pass "
            "--kv-events-allow-remote (with --kv-events-curve-secret and --kv-events-curve-clients to authenticate "
            "subscribers, or --kv-events-no-token-ids to publish hashes only)")


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The server's CURVE key pair (z85 bytes) and the directory of client public keys it admits."""

    public: bytes
    secret: bytes
    clients_dir: str

    @classmethod
    def load(cls, secret_file: str, clients_dir: str) -> CurveKeys:
        """From a secret certificate file (``NAME.key_secret``) and a directory of client ``*.key`` files;
        InvalidArgument naming the flag for a missing or unreadable one."""
        import zmq.auth
        if not secret_file or not clients_dir:
            raise InvalidArgument("--kv-events-curve-secret and --kv-events-curve-clients go together")
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as err:
            raise InvalidArgument(f"--kv-events-curve-secret {secret_file}: not a readable CURVE certificate "
                                  f"({err}); make one with python -c \"import zmq.auth; "
                                  "zmq.auth.create_certificates('DIR', 'server')\"") from None
        if not secret:
            raise InvalidArgument(f"--kv-events-curve-secret {secret_file} holds no secret key (a public .key "
                                  "file?): give the server's .key_secret file")
        d = Path(clients_dir)
        if not d.is_dir() or not any(d.glob("*.key")):
            raise InvalidArgument(f"--kv-events-curve-clients {clients_dir}: a directory with at least one client "
                                  "public key (*.key) is needed; copy each subscriber's NAME.key there")
        return cls(public, secret, str(d))

    def serve(self, socket: zmq.Socket) -> None:
        """Make `socket` (not yet bound) a CURVE server with this key pair."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def authenticator(self, context: zmq.Context) -> object:
        """A started ZAP handler of `context` that admits the client keys of clients_dir (stop() it)."""
        from zmq.auth.thread import ThreadAuthenticator
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=self.clients_dir)
        return auth


def peer_of(frame: zmq.Frame, identity: bytes) -> bytes:
    """Who sent a request: the CURVE client key (ZAP User-Id), else the peer's IP address, else its routing id."""
    for prop in ("User-Id", "Peer-Address"):
        try:
            value = frame.get(prop)
        except (zmq.ZMQError, KeyError, UnicodeDecodeError):
            continue
        if value:
            return f"{prop}:{value}".encode()
    return b"id:" + identity


class ReplayLimiter:
    """A token bucket per peer: `burst` requests at once, refilled at `rate` per second (rate 0: only the
    burst, ever), and one of ALL_PEERS_FACTOR times that for all peers together. At most max_peers buckets
    are kept. Use from one thread."""

    def __init__(self, rate: float = DEFAULT_REPLAY_RATE, burst: int = DEFAULT_REPLAY_BURST,
                 max_peers: int = MAX_PEERS, clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0 or burst < 1:
            raise InvalidArgument(f"--kv-events-replay-rate must be >= 0 and --kv-events-replay-burst >= 1, got "
                                  f"{rate} and {burst}")
        self.rate, self.burst, self.max_peers, self.clock = rate, burst, max_peers, clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()   # peer -> (tokens, when)
        self._all = (float(burst * ALL_PEERS_FACTOR), clock())
        self.allowed = 0
        self.refused = 0

    def allow(self, peer: bytes) -> bool:
        """Take one token of `peer`'s bucket and of the shared one; False (and nothing taken) when either is
        empty."""
        now = self.clock()
        tokens, when = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.rate)
        shared = min(float(self.burst * ALL_PEERS_FACTOR), self._all[0] + (now - self._all[1]) * self.rate *
                     ALL_PEERS_FACTOR)
        ok = tokens >= 1.0 and shared >= 1.0
        self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
        self._all = (shared - 1.0 if ok else shared, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        if ok:
            self.allowed += 1
        else:
            self.refused += 1
        return ok


__all__ = ["ALL_PEERS_FACTOR", "DEFAULT_REPLAY_BURST", "DEFAULT_REPLAY_RATE", "MAX_PEERS", "CurveKeys",
           "ReplayLimiter", "check_bind", "endpoint_is_local", "peer_of"]
