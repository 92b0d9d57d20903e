"""Whole contracts of three small state modules, against the documentation and hand-written values:

- JournalConfig: the defaults docs/DURABILITY.md gives (--sync full, --compact-every 10,000 or 256 MiB,
  --idempotency-window 100,000 ids and 600 s, 64 MiB of replies, 256 replies per snapshot, 1,024 replies rebuilt,
  snapshots on a thread), and the smallest values each check accepts (1, 1, 0, 0).
- IdempotencyWindow.lookup: None for an unknown id; a reuse and an id whose reply is gone are refused with their
  exact messages, reasons and metadata {request_id} (docs/DURABILITY.md: they name only the id), leaving hits as
  they were; a retry returns the very reply stored and counts one hit.
- startup.ensure_pools: each missing configured pool becomes one journal.execute("CreatePool", request,
  journal.api.CreatePool) whose request carries every configured field (prefix caching, model, prefix hash and
  seed included); a pool config without those fields gets their defaults.
"""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest

from kvservice.contract.convert import cache_spec_from_proto, sizing_from_proto
from kvservice.contract.errors import AlreadyExists, InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal_config import JournalConfig
from kvservice.state.startup import ensure_pools
from kvservice.v1 import block_manager_pb2 as pb


# ---- JournalConfig -------------------------------------------------------------------------------------------
def test_journal_config_defaults_are_the_documented_ones():
    c = JournalConfig()
    assert (c.sync, c.compact_every, c.compact_bytes, c.id_window, c.id_window_seconds, c.reply_cache_bytes,
            c.snapshot_replies, c.replay_replies, c.background_snapshots) == \
        ("full", 10_000, 256 * 2**20, 100_000, 600.0, 64 * 2**20, 256, 1024, True)


def test_journal_config_accepts_the_smallest_valid_values():
    c = JournalConfig(sync="normal", compact_every=1, id_window=1, replay_replies=0, snapshot_replies=0)
    assert (c.sync, c.compact_every, c.id_window, c.replay_replies, c.snapshot_replies) == ("normal", 1, 1, 0, 0)


# ---- IdempotencyWindow.lookup ------------------------------------------------------------------------------------
def test_lookup_answers_retries_and_refuses_reuse_and_forgotten_replies_exactly():
    cache, replay = 100 + secrets.randbelow(50), 1 + secrets.randbelow(2000)
    w = IdempotencyWindow(JournalConfig(reply_cache_bytes=cache, replay_replies=replay))
    rid, fp = "rid-" + secrets.token_hex(4), secrets.token_bytes(16)
    assert w.lookup(rid, "Step", fp) is None and w.hits == 0
    reply = pb.StepReply(num_free_slots=1 + secrets.randbelow(1000))
    w.remember(rid, "Step", fp, 5, 100.0, reply)
    assert w.lookup(rid, "Step", fp) is reply and w.hits == 1
    for method, other in (("Step", bytes(16)), ("CreatePool", fp)):
        with pytest.raises(InvalidArgument) as reused:
            w.lookup(rid, method, other)
        assert (reused.value.message, reused.value.reason, reused.value.metadata) == (
            f"request_id {rid!r} was already used by a different Step request; use a fresh id per request",
            "REQUEST_ID_REUSED", {"request_id": rid})
    assert w.hits == 1
    w.remember("big", "CreatePool", fp, 6, 101.0, pb.PoolInfo(name="x" * (cache + 1)))     # pushes both out
    assert w.replies == {} and list(w.ids) == [rid, "big"]
    with pytest.raises(AlreadyExists) as applied:
        w.lookup(rid, "Step", fp)
    assert (applied.value.message, applied.value.reason, applied.value.metadata) == (
        f"Step {rid!r} was already applied; its reply is no longer kept (the reply cache keeps {cache} bytes; a "
        f"restart rebuilds the replies of the last {replay} Steps)", "REQUEST_ALREADY_APPLIED", {"request_id": rid})
    assert w.hits == 1


# ---- startup.ensure_pools ------------------------------------------------------------------------------------
class RecordingJournal:
    """What ensure_pools uses of a Journal: manager (pool_names, locked), execute(method, request, handler), api."""

    def __init__(self) -> None:
        self.manager = BlockManager()
        self.api = SimpleNamespace(CreatePool=object())
        self.calls = []

    def execute(self, method, request, handler):
        self.calls.append((method, request, handler))


def test_ensure_pools_journals_one_create_pool_per_missing_pool_with_every_configured_field():
    spec, sizing = CacheSpec.uniform(3, 2, 64, page_size=16), Sizing(num_slots=40, max_seq_len=512)
    full = SimpleNamespace(name="p-" + secrets.token_hex(3), spec=spec, sizing=sizing, backends=("cpu", "cuda"),
                           prefix_caching=True, model="m-" + secrets.token_hex(3), prefix_hash="sha256_cbor",
                           prefix_hash_seed="seed-" + secrets.token_hex(3))
    bare = SimpleNamespace(name="q", spec=spec, sizing=sizing, backends=())
    j = RecordingJournal()
    assert ensure_pools(j, [full, bare]) == [full.name, "q"]
    assert [(m, h) for m, _, h in j.calls] == [("CreatePool", j.api.CreatePool)] * 2
    r, q = j.calls[0][1], j.calls[1][1]
    assert isinstance(r, pb.CreatePoolRequest)
    assert (r.name, list(r.backends), r.enable_prefix_caching, r.model, r.prefix_hash, r.prefix_hash_seed) == \
        (full.name, ["cpu", "cuda"], True, full.model, "sha256_cbor", full.prefix_hash_seed)
    assert cache_spec_from_proto(r.cache) == spec and sizing_from_proto(r.sizing) == sizing
    assert (q.name, list(q.backends), q.enable_prefix_caching, q.model, q.prefix_hash, q.prefix_hash_seed) == \
        ("q", [], False, "", "", "")
    assert q.HasField("cache") and q.HasField("sizing") and r.request_id == q.request_id == ""
