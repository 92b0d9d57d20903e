"""What the contract package hands to clients and operators, checked without a server: the gRPC status of a domain
error (code, message, ErrorInfo reason and metadata, unpacked from the wire bytes), the reply-size refusal, the
plain-data plan summary (`kvctl plan --json`) and JSON log lines. The integration tests see the same through
servers in other processes; these run in the mutation check's contract selection."""

from __future__ import annotations

import io
import json
import logging
import random

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvservice.contract import logs, status, transport
from kvservice.contract.errors import FailedPrecondition, InvalidArgument, KVError, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan


@pytest.mark.parametrize(("cls", "code", "number"), [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, 3),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, 9),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, 8), (KVError, grpc.StatusCode.INTERNAL, 13)])
def test_a_domain_error_becomes_a_status_with_its_error_info(cls, code, number):
    rng = random.Random(number)
    meta = {f"k{i}": rng.randint(1, 10**9) for i in range(3)}
    err = cls(f"message {rng.random()}", reason="SOME_REASON", **meta)
    st = status.to_status(err)
    assert st.code == code and st.details == err.message
    # The trailing metadata carries google.rpc.Status bytes (numbers from google/rpc/code.proto, not from kvservice).
    (key, raw), = st.trailing_metadata
    assert key == "grpc-status-details-bin"
    wire = status_pb2.Status.FromString(raw)
    assert wire.code == number and wire.message == err.message
    info = error_details_pb2.ErrorInfo()
    assert wire.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == ("SOME_REASON", "kvservice.v1",
                                                               {k: str(v) for k, v in meta.items()})


def test_a_reply_over_the_limit_is_refused_with_its_size_and_the_limit():
    transport.check_reply_bytes(1000, 1000, "GetPool", "ask for less")        # at the limit: fine
    transport.check_reply_bytes(10**12, 0, "GetPool", "ask for less")         # 0 = no limit
    with pytest.raises(ResourceExhausted) as e:
        transport.check_reply_bytes(1001, 1000, "GetPool of p", "ask for less")
    assert e.value.reason == "REPLY_TOO_LARGE"
    assert e.value.metadata == {"reply_bytes": "1001", "limit": "1000"}
    assert "GetPool of p would take 1001 bytes" in e.value.message and e.value.message.endswith("ask for less")


def test_plan_summary_is_the_documented_plain_data():
    spec = CacheSpec((LayerSpec(2, 64, "float16"), LayerSpec(2, 64, "float16", 64)) * 2, 16)
    p = plan(spec, Sizing(max_batch=4, max_seq_len=256))
    s = p.summary()
    json.dumps(s)                                                             # plain data, as kvctl prints it
    assert s["num_slots"] == p.num_slots == 4 * 256 // 16                     # the full group: batch x pages
    assert (s["page_size"], s["num_layers"], s["layout"], s["max_seq_len"]) == (16, 4, "per_layer", 256)
    assert s["max_pages_per_seq"] == 16
    page = 2 * 16 * 2 * 64 * 2                                                # K and V x tokens x heads x dim x 2 B
    groups = {g["sliding_window"]: g for g in s["groups"]}
    assert sorted(groups) == [0, 64] and groups[0]["layers"] == [0, 2] and groups[64]["layers"] == [1, 3]
    assert groups[0]["num_slots"] == 64 and groups[0]["slot_bytes"] == 2 * page
    assert s["group_slots"] == [g["num_slots"] for g in s["groups"]]
    assert s["total_bytes"] == sum(g["num_slots"] * g["slot_bytes"] for g in s["groups"])
    assert s["saved_bytes"] == s["equal_sizing_bytes"] - s["total_bytes"] > 0


def test_json_log_lines_carry_record_fields_over_process_fields():
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("kvservice.test_contract_edges")
    log.addHandler(h)
    log.propagate = False
    epoch = [7]
    try:
        logs.set_process_fields(node="n-3", epoch=lambda: epoch[0])
        log.warning("first %d", 1)
        epoch[0] = 8
        log.warning("second", extra={"pool": "p1", "node": "own"})
        logs.set_process_fields(node=None, epoch=None)
        log.warning("third")
    finally:
        logs.set_process_fields(node=None, epoch=None)
        log.removeHandler(h)
    a, b, c = (json.loads(line) for line in out.getvalue().splitlines())
    assert (a["message"], a["level"], a["node"], a["epoch"]) == ("first 1", "WARNING", "n-3", 7)
    assert "pool" not in a
    assert (b["pool"], b["node"], b["epoch"]) == ("p1", "own", 8)
    assert set(c) == {"ts", "level", "logger", "message"}
    with pytest.raises(ValueError) as err:
        logs.set_process_fields(tenant="x")
    assert str(err.value) == "unknown log field 'tenant'; known: pool, request_id, stream_id, worker_id, epoch, node"


def test_configure_writes_lines_of_the_chosen_format_on_the_given_stream():
    root = logging.getLogger()
    saved, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        with pytest.raises(ValueError, match="--log-format 'xml': expected one of text, json"):
            logs.configure("INFO", "xml", stream=out)
        logs.configure("warning", "json", stream=out)
        logging.getLogger("kvservice.t").info("below the level")
        logging.getLogger("kvservice.t").warning("pool %s is full", "p-7")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(saved_level)
    lines = out.getvalue().splitlines()                 # every line on `stream`, none on stderr
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert (doc["level"], doc["logger"], doc["message"]) == ("WARNING", "kvservice.t", "pool p-7 is full")


def test_received_reads_its_message_fields_and_unwrap_gives_the_bytes_back():
    from kvservice.contract.received import Received, unwrap
    from kvservice.v1 import block_manager_pb2 as pb
    msg = pb.ListSequencesRequest(pool=f"p{random.randint(1, 999)}", limit=random.randint(1, 10**6))
    r = Received(msg, msg.SerializeToString())
    assert (r.pool, r.limit) == (msg.pool, msg.limit)              # attribute reads go to the message
    assert unwrap(r) == (msg, msg.SerializeToString()) and unwrap(msg) == (msg, None)


def test_grpc_server_with_tls_listens_only_over_tls(tmp_path):
    """grpc_server(tls=...) binds a TLS port: a client trusting the server's certificate is answered (health
    SERVING), a plaintext client on that port is not (certificate made with openssl; skipped without it)."""
    import subprocess

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvservice.contract.auth import ServerTLS
    from kvservice.contract.serving import grpc_server
    from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
    from tests.ci import need_tool

    openssl = need_tool("openssl", "apt package openssl")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "k.pem", "-out", "c.pem", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    tls = ServerTLS.from_files(tmp_path / "c.pem", tmp_path / "k.pem")
    server, port, _health = grpc_server("kvservice.v1.BlockManager", pb_grpc.BlockManagerServicer(),
                                        "127.0.0.1:0", tls)
    server.start()
    try:
        assert port > 0
        check = health_pb2.HealthCheckRequest(service="")
        creds = grpc.ssl_channel_credentials(root_certificates=tls.cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(check, timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(check, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
