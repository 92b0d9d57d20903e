"""KV events over ZeroMQ in vLLM's wire format, for routers that already consume vLLM (llm-d, Dynamo).

Format (vLLM's ``vllm/distributed/kv_events.py``, the version whose events are tagged maps):

- a ``KVEventBatch`` is msgpack-encoded as an array ``[ts, events, data_parallel_rank]``
  (msgspec ``array_like``, ``omit_defaults``: a ``None`` rank would be left off);
- each event is a map tagged by its class name under ``"type"``: ``BlockStored``
  (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window; fields with a
  default are left off while they hold it), ``BlockRemoved`` (block_hashes, medium, group_idx),
  ``AllBlocksCleared``; block hashes are unsigned 64-bit integers;
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
from kvservice.events.hub import EventHub, LoggedBatch, Subscription

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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()


def to_vllm(lb: LoggedBatch, medium: str = MEDIUM_GPU, data_parallel_rank: int = 0) -> KVEventBatch:
    """A logged batch as vLLM's structs (hashes as Python ints < 2^64)."""
    events: list[Any] = []
    for e in lb.batch.events:
        if isinstance(e, DomainStored):
            events.append(BlockStored(
                block_hashes=e.block_hashes.tolist(), parent_block_hash=e.parent_block_hash or None,
                token_ids=e.token_ids.tolist(), block_size=e.block_size, lora_id=None, medium=medium, lora_name=None,
                group_idx=e.group, kv_cache_spec_kind=e.kind, kv_cache_spec_sliding_window=e.sliding_window or None))
        elif isinstance(e, DomainRemoved):
            events.append(BlockRemoved(block_hashes=e.block_hashes.tolist(), medium=medium, group_idx=e.group))
        else:
            assert isinstance(e, DomainCleared), f"unknown event {type(e).__name__}"
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=lb.ts, events=events, data_parallel_rank=data_parallel_rank)


@dataclass(frozen=True, slots=True)
class ZmqConfig:
    """One pool's ZeroMQ publisher.

    endpoint: PUB address; bound if it holds "*", "::" or is ipc:// / inproc:// (vLLM's rule), else connected.
    replay_endpoint: ROUTER address for replay requests (always bound); "" = none.
    topic: first frame of every message ("{pool}" is replaced by the pool's name).
    """

    pool: str
    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    medium: str = MEDIUM_GPU
    data_parallel_rank: int = 0
    hwm: int = 100_000


def zmq_configs(endpoints: list[str], replays: list[str], default_pool: str, topic: str = "",
                medium: str = MEDIUM_GPU) -> tuple[ZmqConfig, ...]:
    """Publishers from ``[POOL=]ENDPOINT`` flags (no POOL = default_pool); each replay endpoint goes to the
    publisher of its pool. InvalidArgument for a replay endpoint without a publisher or a pool named twice."""
    def split(flag: str) -> tuple[str, str]:
        pool, sep, endpoint = flag.partition("=")
        return (pool, endpoint) if sep and "://" not in pool else (default_pool, flag)

    pubs: dict[str, str] = {}
    for flag in endpoints:
        pool, endpoint = split(flag)
        if pool in pubs:
            raise InvalidArgument(f"--kv-events-zmq: pool {pool!r} is published twice ({pubs[pool]}, {endpoint})")
        pubs[pool] = endpoint
    rep: dict[str, str] = {}
    for flag in replays:
        pool, endpoint = split(flag)
        if pool not in pubs:
            raise InvalidArgument(f"--kv-events-replay {flag}: pool {pool!r} has no --kv-events-zmq publisher")
        rep[pool] = endpoint
    return tuple(ZmqConfig(pool, endpoint, rep.get(pool, ""), topic, medium) for pool, endpoint in pubs.items())


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
            if _binds(config.endpoint):
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
        data = lb.encoded.get("vllm")
        if data is None:
            c = self.config
            data = lb.encoded["vllm"] = _ENCODER.encode(to_vllm(lb, c.medium, c.data_parallel_rank))
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


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch", "ZmqConfig", "ZmqPublisher", "to_vllm",
           "zmq_configs"]
