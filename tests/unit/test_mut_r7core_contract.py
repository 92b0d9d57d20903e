"""The small modules of kvservice/contract pinned whole: errors.py (every domain class's documented reason, message
and metadata as strings), status.py (each class's gRPC code from google/rpc/code.proto, the ErrorInfo detail, and
error_info reading it back off a failed call), transport.py (the reply-size refusal's whole message and its
bounds), received.py (which methods keep their request bytes) and sizing.py's Sizing checks (every field's
refusal by name, group_slots normalised to a tuple of ints)."""

from __future__ import annotations

import random

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from kvservice.contract import status, transport
from kvservice.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    JournalUnavailable,
    KVError,
    NotFound,
    ResourceExhausted,
    StateError,
)
from kvservice.contract.received import KEEP_BYTES
from kvservice.contract.sizing import Sizing
from tests.support_client import RpcErr

#: class -> (documented reason, grpc status, google.rpc code number from google/rpc/code.proto)
CLASSES = {
    KVError: ("KV_ERROR", grpc.StatusCode.INTERNAL, 13),
    InvalidArgument: ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT, 3),
    FailedPrecondition: ("FAILED_PRECONDITION", grpc.StatusCode.FAILED_PRECONDITION, 9),
    ResourceExhausted: ("RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED, 8),
    NotFound: ("NOT_FOUND", grpc.StatusCode.NOT_FOUND, 5),
    AlreadyExists: ("ALREADY_EXISTS", grpc.StatusCode.ALREADY_EXISTS, 6),
    StateError: ("STATE_ERROR", grpc.StatusCode.INTERNAL, 13),
}


KEY = "grpc-status-details-bin"


@pytest.mark.parametrize("cls", list(CLASSES))
def test_every_domain_error_keeps_its_message_reason_and_string_metadata(cls):
    """KVError's fields: message (also str()), the class's reason unless one is given, metadata values as str."""
    reason, _, _ = CLASSES[cls]
    rng = random.Random(reason)
    msg = f"pool 'p{rng.randint(1, 99)}': something to act on"
    err = cls(msg)
    assert isinstance(err, KVError) and isinstance(err, Exception)
    assert (err.message, str(err), err.reason, err.metadata) == (msg, msg, reason, {})
    n = rng.randint(1, 10**9)
    err = cls(msg, "OWN_REASON", needed=n, free=0, group=None, flag=True)
    assert (err.message, err.reason) == (msg, "OWN_REASON")
    assert err.metadata == {"needed": str(n), "free": "0", "group": "None", "flag": "True"}
    assert cls.reason == reason                                   # the class's own is untouched
    assert not issubclass(JournalUnavailable, KVError)


@pytest.mark.parametrize("cls", list(CLASSES))
def test_to_status_gives_each_class_its_code_and_error_info_reads_it_back(cls):
    """to_status: the google.rpc code of the class (INTERNAL for any other KVError), the message as written, one
    ErrorInfo(reason, domain kvservice.v1, metadata); error_info on a call failed with that status returns it."""
    reason, code, number = CLASSES[cls]
    rng = random.Random(number * 7 + len(reason))
    meta = {f"k{i}": rng.randint(1, 10**9) for i in range(rng.randint(1, 4))}
    err = cls(f"refused {rng.random()}", **meta)
    st = status.to_status(err)
    assert (st.code, st.details) == (code, err.message)
    (key, raw), = st.trailing_metadata
    assert key == "grpc-status-details-bin"
    wire = status_pb2.Status.FromString(raw)
    assert (wire.code, wire.message, len(wire.details)) == (number, err.message, 1)
    info = error_details_pb2.ErrorInfo()
    assert wire.details[0].Unpack(info)
    want = (reason, "kvservice.v1", {k: str(v) for k, v in meta.items()})
    assert (info.reason, info.domain, dict(info.metadata)) == want
    got = status.error_info(RpcErr(st.code, st.details, st.trailing_metadata))
    assert isinstance(got, error_details_pb2.ErrorInfo)
    assert (got.reason, got.domain, dict(got.metadata)) == want


def test_error_info_is_none_without_an_error_info_detail_and_skips_other_details():
    """No trailing metadata, metadata without the status key, or a status whose details hold no ErrorInfo: None.
    An ErrorInfo after another detail is still found."""
    assert status.error_info(RpcErr(grpc.StatusCode.UNAVAILABLE, "gone", None)) is None
    assert status.error_info(RpcErr(grpc.StatusCode.UNAVAILABLE, "gone", (("x-other", "1"),))) is None
    other = any_pb2.Any()
    other.Pack(error_details_pb2.RetryInfo())
    only_other = status_pb2.Status(code=14, message="gone", details=[other])
    call = RpcErr(grpc.StatusCode.UNAVAILABLE, "gone", ((KEY, only_other.SerializeToString()),))
    assert status.error_info(call) is None
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="LATE", domain="kvservice.v1", metadata={"a": "1"}))
    both = status_pb2.Status(code=14, message="gone", details=[other, info])
    call = RpcErr(grpc.StatusCode.UNAVAILABLE, "gone", ((KEY, both.SerializeToString()),))
    got = status.error_info(call)
    assert (got.reason, got.domain, dict(got.metadata)) == ("LATE", "kvservice.v1", {"a": "1"})


def test_the_reply_size_refusal_is_the_whole_documented_message():
    """check_reply_bytes: nothing at or under the limit or with limit 0; one byte over: ResourceExhausted
    REPLY_TOO_LARGE with the sizes as metadata and the whole message."""
    rng = random.Random(27)
    limit = rng.randint(1000, 10**9)
    assert transport.check_reply_bytes(limit, limit, "GetPool", "x") is None
    assert transport.check_reply_bytes(0, limit, "GetPool", "x") is None
    assert transport.check_reply_bytes(10**15, 0, "GetPool", "x") is None
    with pytest.raises(ResourceExhausted) as e:
        transport.check_reply_bytes(limit + 1, limit, "ListSequences of pool 'p'", "page with a smaller limit")
    assert e.value.message == (f"the reply to ListSequences of pool 'p' would take {limit + 1} bytes, more than the "
                               f"message limit of {limit} bytes; page with a smaller limit")
    assert (e.value.reason, e.value.metadata) == ("REPLY_TOO_LARGE", {"reply_bytes": str(limit + 1),
                                                                     "limit": str(limit)})
    assert transport.MAX_MESSAGE_BYTES == 256 * 1024 * 1024
    assert (transport.STREAM_ID_KEY, transport.EPOCH_METADATA, transport.NODE_METADATA) == (
        "kvservice-stream-id", "kvservice-leader-epoch", "kvservice-leader-node")


def test_only_step_and_step_stream_keep_their_request_bytes():
    assert frozenset({"Step", "StepStream"}) == KEEP_BYTES


SIZES = ("max_batch", "max_seq_len", "memory_budget_bytes", "num_slots", "max_num_batched_tokens",
         "prefix_headroom_slots")


@pytest.mark.parametrize("name", SIZES)
def test_a_negative_size_is_refused_naming_the_field(name):
    """Sizing: every count must be >= 0 (0 = unset); the refusal names the field and the value."""
    for v in (-1, -random.Random(name).randint(2, 10**6)):
        with pytest.raises(InvalidArgument) as e:
            Sizing(**{name: v})
        assert e.value.message == f"{name} must be >= 0, got {v}"
    s = Sizing(**{name: 0})
    assert getattr(s, name) == 0


def test_group_slots_are_a_tuple_of_positive_ints():
    s = Sizing(group_slots=[3, True, 7])
    assert s.group_slots == (3, 1, 7) and type(s.group_slots) is tuple
    assert all(type(n) is int for n in s.group_slots)
    assert Sizing().group_slots == () and Sizing(max_batch=1, max_seq_len=2, memory_budget_bytes=3, num_slots=4,
                                                 max_num_batched_tokens=5, prefix_headroom_slots=6) == \
        Sizing(1, 2, 3, 4, 5, 6, False, ())
    for bad in ([4, 0], [-2], [1, 2, -1]):
        with pytest.raises(InvalidArgument) as e:
            Sizing(group_slots=bad)
        assert e.value.message == f"group_slots must all be > 0, got {bad}"


def test_an_unreadable_tls_or_tokens_file_names_its_flag_path_and_the_reason(tmp_path):
    """auth: each file a server reads names the flag it came from, the path and the OS's reason, whole."""
    from kvservice.contract import auth

    good = tmp_path / "ok.pem"
    good.write_bytes(b"PEM")
    absent = tmp_path / "absent"
    for call, flag in ((lambda: auth.ServerTLS.from_files(absent, good), "--tls-cert"),
                       (lambda: auth.ServerTLS.from_files(good, absent), "--tls-key"),
                       (lambda: auth.ServerTLS.from_files(good, good, absent), "--tls-client-ca"),
                       (lambda: auth.TokenTable.from_file(absent), "--tokens-file")):
        with pytest.raises(InvalidArgument) as e:
            call()
        assert e.value.message == f"{flag}: cannot read {absent}: No such file or directory"


def test_plan_summary_is_every_figure_computed_by_hand():
    """Plan.summary (kvctl plan --json) of a per-layer hybrid, every key by hand: 4 layers of 2 heads x 64 float16,
    layers 1 and 3 sliding over 64 tokens, page size 16, max_batch 4 x max_seq_len 256. A page of one layer is
    K and V x 16 tokens x 2 heads x 64 x 2 bytes = 8192 bytes; the full group gets 4 x 256 / 16 = 64 slots, the
    sliding one 4 x (ceil(64 / 16) + 1) + ceil(256 / 16) = 36; per-layer buffers: a page per slot."""
    from kvservice.contract.geometry import CacheSpec, LayerSpec
    from kvservice.core.planner import plan

    spec = CacheSpec((LayerSpec(2, 64, "float16"), LayerSpec(2, 64, "float16", 64)) * 2, 16)
    page = 2 * 16 * 2 * 64 * 2
    full, sliding = 64, 36
    want = {
        "num_slots": full, "page_size": 16, "layout": "per_layer", "num_layers": 4, "max_seq_len": 256,
        "max_pages_per_seq": 16, "bytes_per_layer": page * full, "bytes_per_slot": 4 * page,
        "total_bytes": 2 * page * (full + sliding), "group_slots": [full, sliding],
        "equal_sizing_bytes": full * 4 * page, "saved_bytes": 2 * page * (full - sliding),
        "max_byte_offset": page * full - 1, "offsets_exceed_int32": False, "offsets_exceed_uint32": False,
        "indices_need_int64": False, "pool_pages": full + sliding, "backends": ["native"],
        "groups": [{"group": 0, "sliding_window": 0, "layers": [0, 2], "num_slots": full, "slot_bytes": 2 * page,
                    "bytes": 2 * page * full, "buffer_bytes": page * full},
                   {"group": 1, "sliding_window": 64, "layers": [1, 3], "num_slots": sliding, "slot_bytes": 2 * page,
                    "bytes": 2 * page * sliding, "buffer_bytes": page * sliding}],
        "index_spaces": [{"id": 0, "group": 0, "scale": 1, "offset": 0, "base": 0, "upper_bound": full,
                          "layers": [0, 2], "index_dtype": "int32"},
                         {"id": 1, "group": 1, "scale": 1, "offset": 0, "base": full, "upper_bound": full + sliding,
                          "layers": [1, 3], "index_dtype": "int32"}],
        "warnings": [],
        "notes": ["group 1 (sliding window 64): 36 slots = 4 sequences x (ceil(64 / 16) + 1) + ceil(256 batched "
                  "tokens / 16)"],
    }
    assert plan(spec, Sizing(max_batch=4, max_seq_len=256), ["native"]).summary() == want
