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
  ``(identity, b"", -1 as 8 signed bytes, b"")``.

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
from kvservice.manager.event_log import EventHub, LoggedBatch, Subscription

log = logging.getLogger("kvservice.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
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
            fmt: str = DEFAULT_FORMAT) -> KVEventBatch | KVEventBatch011:
    """A logged batch as vLLM's structs of wire format `fmt` (hashes as Python ints < 2^64)."""
    events: list[Any] = []
    old = fmt == "vllm-0.11"
    for e in lb.batch.events:
        if isinstance(e, DomainStored):
            if old:
                events.append(BlockStored011(e.block_hashes.tolist(), e.parent_block_hash or None,
                                             e.token_ids.tolist(), e.block_size, None, medium))
            else:
                events.append(BlockStored(
                    block_hashes=e.block_hashes.tolist(), parent_block_hash=e.parent_block_hash or None,
                    token_ids=e.token_ids.tolist(), block_size=e.block_size, lora_id=None, medium=medium,
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

    @property
    def binds(self) -> bool:
        return self.mode == "bind" or (self.mode == "auto" and _binds(self.endpoint))


def zmq_configs(endpoints: list[str], replays: list[str], default_pool: str, topic: str = "",
                medium: str = MEDIUM_GPU, fmt: str = DEFAULT_FORMAT) -> tuple[ZmqConfig, ...]:
    """Publishers from ``[POOL=][bind:|connect:]ENDPOINT`` flags (no POOL = default_pool; no mode = vLLM's
    rule); each replay endpoint goes to the publisher of its pool. InvalidArgument for a replay endpoint
    without a publisher, a pool named twice or an unknown format."""
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
    return tuple(ZmqConfig(pool, endpoint, rep.get(pool, ""), topic, medium, mode=modes[pool], fmt=fmt)
                 for pool, endpoint in pubs.items())


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """Publishes one pool's committed batches on PUB and answers replay requests on ROUTER, from one thread.

    It reads the pool's log like any subscriber (from the next batch on when it starts; a pool
    created later is waited for). ``bound_endpoint`` / ``bound_replay_endpoint``: the addresses
    actually bound (a "*" port resolved).
    """

    def __init__(self, hub: EventHub, config: ZmqConfig, context: zmq.Context | None = None) -> None:
        self.hub = hub
        self.config = config
        self.topic = config.topic.replace("{pool}", config.pool).encode()
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if config.binds:
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
            self.bound_replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"kv events for pool {config.pool!r}: cannot open {config.endpoint} / "
                          f"{config.replay_endpoint or '-'}: {err}") from None
        log.info("kv events of pool %r (%s): PUB %s %s, topic %r", config.pool, config.fmt,
                 "bound to" if config.binds else "connecting to", self.bound_endpoint, self.topic.decode())
        if self._replay is not None:
            log.info("kv events of pool %r: replay ROUTER bound to %s", config.pool, self.bound_replay_endpoint)
        self._sub: Subscription | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-zmq-{config.pool}", daemon=True)
        self.published = 0
        self.replays = 0

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

    def _payload(self, lb: LoggedBatch) -> bytes:
        c = self.config
        key = f"vllm/{c.fmt}/{c.medium}/{c.data_parallel_rank}"
        data = lb.encoded.get(key)
        if data is None:
            data = lb.encoded[key] = _ENCODER.encode(to_vllm(lb, c.medium, c.data_parallel_rank, c.fmt))
        return data  # type: ignore[return-value]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:                     # keep publishing; a broken batch must not stop the stream
                log.exception("kv events publisher of pool %r failed; retrying", self.config.pool)
                self._stop.wait(0.5)

    def _step(self) -> None:
        if self._replay is not None and self._replay.poll(0):
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
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a replay request of %d frames (want identity, empty, 8-byte start)", len(frames))
            return
        ident, _, start = frames
        self.replays += 1
        try:
            # vLLM's sequences start at 0, ours at 1: a request from 0 means "everything retained".
            sub = self.hub.subscribe(self.config.pool, max(1, int.from_bytes(start, "big")), "zmq-replay",
                                     limit=False)
        except KVError:
            self._replay.send_multipart((ident, b"", END_SEQ, b""))
            return
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


__all__ = ["DEFAULT_FORMAT", "FORMATS", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch",
           "KVEventBatch011", "ZmqConfig", "ZmqPublisher", "to_vllm", "zmq_configs"]
