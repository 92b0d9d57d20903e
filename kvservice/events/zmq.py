"""KV events over ZeroMQ in vLLM's wire format, for routers that already consume vLLM (llm-d, Dynamo).

Formats (``--kv-events-format``; vLLM's ``vllm/distributed/kv_events.py`` of each version; the
tests decode our payloads with those very structs, taken from vLLM's wheels):

- both: a ``KVEventBatch`` is msgpack-encoded as an array ``[ts, events, data_parallel_rank]``
  (msgspec ``array_like``, ``omit_defaults``: a ``None`` rank would be left off); block hashes are
  unsigned 64-bit integers;
- ``vllm-0.33`` (default, the newest): each event is a map tagged by its class name under
  ``"type"``: ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window;
  fields with a default are left off while they hold it), ``BlockRemoved`` (block_hashes, medium,
  group_idx), ``AllBlocksCleared``. ``extra_keys`` has one entry per block, as vLLM publishes
  them (untagged): the pool's extra key (a LoRA name) on every block, the cache salt on a
  prompt's first block, None for a block with neither;
- ``vllm-0.11``: each event is an array tagged by its class name in front:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]`` (no layer groups, no
  extra keys: 0.11 has no such fields);
- PUB frames: ``(topic, sequence as 8 bytes big-endian, payload)``;
- a ROUTER replay socket: a request ``(identity, b"", start as 8 bytes big-endian)`` is
  answered with ``(identity, b"", seq, payload)`` for every retained batch ``>= start``, then
  ``(identity, b"", -1 as 8 signed bytes, b"")``; a request past the peer's rate
  (events/zmq_guard.py) is answered with the end marker alone, its payload saying why.

Access (events/zmq_guard.py): bound sockets only on loopback unless asked; optional CURVE; replay
rate per peer; ``token_ids=False`` publishes hashes without the pages' token ids (``token_ids`` is
then ``[]`` in every BlockStored, replays and resets included).

The sequence number is the pool's own batch number (core/cache_events.py), which survives a restart, so a
subscriber that missed batches asks the replay socket for them as it would ask vLLM. Asked for
batches this manager no longer holds, the replay answers with a reset batch first
(AllBlocksCleared, then the whole cache), labelled with the sequence it describes.

One publisher serves one pool. The encoding is msgspec's; no wire code is written here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvservice.contract.errors import InvalidArgument, KVError
from kvservice.core.cache_events import AllBlocksCleared as DomainCleared
from kvservice.core.cache_events import BlockRemoved as DomainRemoved
from kvservice.core.cache_events import BlockStored as DomainStored
from kvservice.events.zmq_guard import (
    DEFAULT_REPLAY_BURST,
    DEFAULT_REPLAY_RATE,
    CurveKeys,
    ReplayLimiter,
    check_bind,
    endpoint_is_local,
    peer_of,
)
from kvservice.manager.event_log import EventHub, LoggedBatch, Subscription

log = logging.getLogger("kvservice.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Payload of the end marker that answers a replay request past its peer's rate (nothing else is sent).
REFUSED = b"refused: too many replay requests (--kv-events-replay-rate per peer, 8 x that for all); ask again later"
#: Replay requests handled per turn of the publisher's loop (refusals are cheap; served ones are rate-limited).
REPLAYS_PER_TURN = 64
#: The largest message a peer may send (ZMQ_MAXMSGSIZE; a larger one disconnects it before it is buffered): a
#: replay request is 8 bytes, a subscription a topic.
MAX_INBOUND_BYTES = 4096
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three events: encoded as maps with the class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None                   # 0.33's fields we never set: kept so that the encoding is
    ownership: str | None = None                  # byte for byte vLLM's (msgspec sizes a map's header by the
    session_id: str | None = None                 # number of fields a struct can have)
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVCacheEvent011(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """vLLM 0.11's events: arrays with the class name in front."""


class BlockStored011(KVCacheEvent011, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved011(KVCacheEvent011, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared011(KVCacheEvent011, tag="AllBlocksCleared"):
    pass


class KVEventBatch011(EventBatch):
    events: list[BlockStored011 | BlockRemoved011 | AllBlocksCleared011]


#: --kv-events-format values, newest first (the first is the default).
FORMATS = ("vllm-0.33", "vllm-0.11")
DEFAULT_FORMAT = FORMATS[0]
_ENCODER = msgspec.msgpack.Encoder()


def _extra_keys(e: DomainStored) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block extra_keys of a BlockStored: (extra key, salt on a prompt's first block), untagged."""
    keys = e.extra_keys
    if not keys or not any(keys):
        return None
    return [tuple(k) if k else None for k in keys]


def to_vllm(lb: LoggedBatch, medium: str = MEDIUM_GPU, data_parallel_rank: int = 0,
            fmt: str = DEFAULT_FORMAT, token_ids: bool = True) -> KVEventBatch | KVEventBatch011:
    """A logged batch as vLLM's structs of wire format `fmt` (hashes as Python ints < 2^64); token_ids False:
    every BlockStored's token_ids is empty (hashes only: no prompt tokens leave the manager)."""
    events: list[Any] = []
    old = fmt == "vllm-0.11"
    for e in lb.batch.events:
        if isinstance(e, DomainStored):
            tokens = e.token_ids.tolist() if token_ids else []
            if old:
                events.append(BlockStored011(e.block_hashes.tolist(), e.parent_block_hash or None,
                                             tokens, e.block_size, None, medium))
            else:
                events.append(BlockStored(
                    block_hashes=e.block_hashes.tolist(), parent_block_hash=e.parent_block_hash or None,
                    token_ids=tokens, block_size=e.block_size, lora_id=None, medium=medium,
                    lora_name=None, extra_keys=_extra_keys(e), group_idx=e.group, kv_cache_spec_kind=e.kind,
                    kv_cache_spec_sliding_window=e.sliding_window or None))
        elif isinstance(e, DomainRemoved):
            events.append(BlockRemoved011(e.block_hashes.tolist(), medium) if old else
                          BlockRemoved(block_hashes=e.block_hashes.tolist(), medium=medium, group_idx=e.group))
        else:
            assert isinstance(e, DomainCleared), f"unknown event {type(e).__name__}"
            events.append(AllBlocksCleared011() if old else AllBlocksCleared())
    cls = KVEventBatch011 if old else KVEventBatch
    return cls(ts=lb.ts, events=events, data_parallel_rank=data_parallel_rank)


@dataclass(frozen=True, slots=True)
class ZmqConfig:
    """One pool's ZeroMQ publisher.

    endpoint: PUB address. mode "auto" binds it if it holds "*", "::" or is ipc:// / inproc:// and
      connects otherwise (vLLM's rule: a collector that binds one endpoint, every engine connecting);
      "bind" / "connect" force one (flag prefix ``bind:`` / ``connect:``).
    replay_endpoint: ROUTER address for replay requests (always bound); "" = none.
    topic: first frame of every message ("{pool}" is replaced by the pool's name).
    fmt: wire format (FORMATS).
    allow_remote: bound sockets may be on non-loopback addresses (else InvalidArgument at start).
    curve: CURVE keys of the bound sockets (None = plaintext). token_ids: False = hashes only.
    replay_rate, replay_burst: each peer's token bucket of replay requests (zmq_guard.ReplayLimiter).
    """

    pool: str
    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    medium: str = MEDIUM_GPU
    data_parallel_rank: int = 0
    hwm: int = 100_000
    mode: str = "auto"
    fmt: str = DEFAULT_FORMAT
    allow_remote: bool = False
    curve: CurveKeys | None = None
    token_ids: bool = True
    replay_rate: float = DEFAULT_REPLAY_RATE
    replay_burst: int = DEFAULT_REPLAY_BURST

    @property
    def binds(self) -> bool:
        return self.mode == "bind" or (self.mode == "auto" and _binds(self.endpoint))


def zmq_configs(endpoints: list[str], replays: list[str], default_pool: str, topic: str = "",
                medium: str = MEDIUM_GPU, fmt: str = DEFAULT_FORMAT, **access: Any) -> tuple[ZmqConfig, ...]:
    """Publishers from ``[POOL=][bind:|connect:]ENDPOINT`` flags (no POOL = default_pool; no mode = vLLM's
    rule); each replay endpoint goes to the publisher of its pool; access: ZmqConfig's allow_remote, curve,
    token_ids, replay_rate, replay_burst for all. InvalidArgument for a replay endpoint without a publisher,
    a pool named twice, an unknown format, or a bind that access does not allow."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"--kv-events-format {fmt!r} is not a format; use one of {', '.join(FORMATS)}")

    def split(flag: str) -> tuple[str, str]:
        pool, sep, endpoint = flag.partition("=")
        return (pool, endpoint) if sep and "://" not in pool and ":" not in pool else (default_pool, flag)

    pubs: dict[str, str] = {}
    modes: dict[str, str] = {}
    for flag in endpoints:
        pool, endpoint = split(flag)
        mode, sep, rest = endpoint.partition(":")
        mode, endpoint = (mode, rest) if sep and mode in ("bind", "connect") else ("auto", endpoint)
        if pool in pubs:
            raise InvalidArgument(f"--kv-events-zmq: pool {pool!r} is published twice ({pubs[pool]}, {endpoint})")
        pubs[pool] = endpoint
        modes[pool] = mode
    rep: dict[str, str] = {}
    for flag in replays:
        pool, endpoint = split(flag)
        if pool not in pubs:
            raise InvalidArgument(f"--kv-events-replay {flag}: pool {pool!r} has no --kv-events-zmq publisher")
        rep[pool] = endpoint
    out = tuple(ZmqConfig(pool, endpoint, rep.get(pool, ""), topic, medium, mode=modes[pool], fmt=fmt, **access)
                for pool, endpoint in pubs.items())
    for c in out:
        check_access(c)
    return out


def check_access(c: ZmqConfig) -> None:
    """InvalidArgument for sockets `c` may not open: a bind off loopback without allow_remote, CURVE on a
    PUB that connects (CURVE here secures the sockets this manager binds)."""
    if c.binds:
        check_bind(c.endpoint, "--kv-events-zmq", c.allow_remote)
    elif c.curve is not None:
        raise InvalidArgument(f"--kv-events-zmq {c.endpoint} connects to a collector; --kv-events-curve-* secures "
                              "the sockets this manager binds: bind the PUB (bind:ENDPOINT) for subscribers to "
                              "connect with CURVE, or drop the CURVE flags")
    if c.replay_endpoint:
        check_bind(c.replay_endpoint, "--kv-events-replay", c.allow_remote)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """Publishes one pool's committed batches on PUB and answers replay requests on ROUTER, from one thread.

    It reads the pool's log like any subscriber (from the next batch on when it starts; a pool
    created later is waited for). ``bound_endpoint`` / ``bound_replay_endpoint``: the addresses
    actually bound (a "*" port resolved).
    """

    def __init__(self, hub: EventHub, config: ZmqConfig, context: zmq.Context | None = None) -> None:
        check_access(config)
        self.hub = hub
        self.config = config
        self.topic = config.topic.replace("{pool}", config.pool).encode()
        # CURVE: a context of its own, whose ZAP handler admits only this publisher's client keys
        self._ctx = zmq.Context() if config.curve is not None else None
        ctx = self._ctx or context or zmq.Context.instance()
        self._auth = config.curve.authenticator(ctx) if config.curve is not None else None
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        self._replay: zmq.Socket | None = None
        try:
            if config.binds:
                if config.curve is not None:
                    config.curve.serve(self._pub)
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            self.bound_replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
                if config.curve is not None:
                    config.curve.serve(self._replay)
                self._replay.bind(config.replay_endpoint)
                self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"kv events for pool {config.pool!r}: cannot open {config.endpoint} / "
                          f"{config.replay_endpoint or '-'}: {err}") from None
        self._log_sockets()
        self.limiter = ReplayLimiter(config.replay_rate, config.replay_burst)
        self._sub: Subscription | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-zmq-{config.pool}", daemon=True)
        self.published = 0
        self.replays = 0

    def _log_sockets(self) -> None:
        c = self.config
        access = (f"CURVE, {c.curve.clients_dir} admitted" if c.curve is not None else "plaintext") + \
            ("" if c.token_ids else ", hashes only (no token ids)")
        log.info("kv events of pool %r (%s): PUB %s %s, topic %r, %s", c.pool, c.fmt,
                 "bound to" if c.binds else "connecting to", self.bound_endpoint, self.topic.decode(), access)
        if self._replay is not None:
            log.info("kv events of pool %r: replay ROUTER bound to %s (%s; %g requests/s per peer, bursts of %d)",
                     c.pool, self.bound_replay_endpoint, access, c.replay_rate, c.replay_burst)
        if c.allow_remote:
            remote = [e for e in (self.bound_endpoint if c.binds else "", self.bound_replay_endpoint)
                      if e and not endpoint_is_local(e)]
            if remote:
                log.warning("kv events of pool %r: %s reachable from other machines (--kv-events-allow-remote)%s",
                            c.pool, " and ".join(remote), "" if c.curve is not None else
                            "; anyone who reaches them reads the pool's cache; use --kv-events-curve-*")

    def start(self) -> ZmqPublisher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._sub is not None:
            self._sub.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()

    def _payload(self, lb: LoggedBatch) -> bytes:
        c = self.config
        key = f"vllm/{c.fmt}/{c.medium}/{c.data_parallel_rank}/{int(c.token_ids)}"
        data = lb.encoded.get(key)
        if data is None:
            data = lb.encoded[key] = _ENCODER.encode(to_vllm(lb, c.medium, c.data_parallel_rank, c.fmt,
                                                             c.token_ids))
        return data  # type: ignore[return-value]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:                     # keep publishing; a broken batch must not stop the stream
                log.exception("kv events publisher of pool %r failed; retrying", self.config.pool)
                self._stop.wait(0.5)

    def _step(self) -> None:
        for _ in range(REPLAYS_PER_TURN):
            if self._replay is None or not self._replay.poll(0):
                break
            self._serve_replay()
        if self._sub is None:
            try:
                self._sub = self.hub.subscribe(self.config.pool, None, "zmq", limit=False)
            except KVError:                        # the pool does not exist (yet)
                self._stop.wait(0.2)
                return
        items = self._sub.poll(0.05)
        if items is None:                          # the pool was deleted: wait for a new one
            self._sub = None
            return
        for lb in items:
            self._pub.send_multipart((self.topic, lb.seq.to_bytes(8, "big"), self._payload(lb)))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(copy=False)
        if len(frames) != 3 or len(frames[2].bytes) != 8:
            log.warning("ignored a replay request of %d frames (want identity, empty, 8-byte start)", len(frames))
            return
        ident, start = frames[0].bytes, frames[2].bytes
        if not self.limiter.allow(peer_of(frames[2], ident)):
            if self.limiter.refused % 100 == 1:
                log.warning("kv events of pool %r: replay request refused (over --kv-events-replay-rate; %d "
                            "refused so far)", self.config.pool, self.limiter.refused)
            self._replay.send_multipart((ident, b"", END_SEQ, REFUSED))
            return
        self.replays += 1
        try:
            # vLLM's sequences start at 0, ours at 1: a request from 0 means "everything retained".
            sub = self.hub.subscribe(self.config.pool, max(1, int.from_bytes(start, "big")), "zmq-replay",
                                     limit=False)
        except KVError:
            self._replay.send_multipart((ident, b"", END_SEQ, b""))
            return
        sub.token_ids = self.config.token_ids
        try:
            head = self.hub.pool_seq(self.config.pool)
            while sub.next_seq <= head:
                items = sub.poll(0)
                if not items:
                    break
                for lb in items:
                    self._replay.send_multipart((ident, b"", lb.seq.to_bytes(8, "big"), self._payload(lb)))
        finally:
            sub.close()
        self._replay.send_multipart((ident, b"", END_SEQ, b""))


__all__ = ["DEFAULT_FORMAT", "FORMATS", "REFUSED", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
           "KVEventBatch011", "ZmqConfig", "ZmqPublisher", "check_access", "to_vllm", "zmq_configs"]
