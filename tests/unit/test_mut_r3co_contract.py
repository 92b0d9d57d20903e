"""Contract edges found by mutation sample 20 (package contract): the mirror names a malformed replaced_generations
field, grpc_server returns the port it bound (any port, 1 included) and refuses an address it cannot bind, and
Plan.summary (what `kvctl plan --json` prints) has exactly its documented keys, backends included.

Oracles: block_manager.proto's field names, the exact MirrorError text, gRPC's bound port, hand-written key sets."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.mirror import MirrorError
from kvservice.contract.serving import grpc_server
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.planner import plan
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
from tests.unit.test_delta_mirror import Twin

MANAGER = "kvservice.v1.BlockManager"


@pytest.mark.parametrize("damage", ["short", "int32"])
def test_a_malformed_replaced_generations_is_refused_naming_the_field(damage):
    """A copy-on-write delta (SpaceDelta.replaced) whose replaced_generations is not UINT32 [one per replaced page]
    is refused with a MirrorError naming `replaced_generations`, the space, the expected and the received shape."""
    twin = Twin("per_layer")
    twin.step({"admit": [1], "admit_tokens": [6]})
    ra = codec.step_request("a", fork=[(1, 2)], extend=[1], extend_tokens=1)
    reply = twin.delta_reply(ra)
    st = reply.tables[0]
    assert st.delta.HasField("replaced_generations") and len(st.delta.replaced.data) == 4    # one page replaced
    gens = np.frombuffer(st.delta.replaced_generations.data, np.uint32)
    bad = np.concatenate([gens, gens]) if damage == "short" else gens.astype(np.int32)
    st.delta.replaced_generations.CopyFrom(to_tensor(bad))
    got = "uint32 [2]" if damage == "short" else "int32 [1]"
    want = (f"index space {st.index_space}: replaced_generations must be UINT32 [1] (one per page), got {got}")
    with pytest.raises(MirrorError) as err:
        twin.mirror.apply(reply)
    assert want in str(err.value)
    assert twin.mirror.seq == 0


def _bindable(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


@pytest.mark.parametrize("which", ["free", "one"])
def test_grpc_server_returns_the_explicit_port_it_bound(which):
    """A server asked for a given port (not 0) is bound to it and returns that port: any port, 1 included (a
    privileged port; skipped where this process may not bind it or something holds it)."""
    if which == "free":
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
    else:
        port = 1
        if not _bindable(1):
            pytest.skip("port 1 is not bindable here (not root, or in use)")
    server, got, _ = grpc_server(MANAGER, pb_grpc.BlockManagerServicer(), f"127.0.0.1:{port}")
    try:
        assert got == port
    finally:
        server.stop(None)


def test_grpc_server_refuses_a_port_another_socket_listens_on():
    """A port held by a listening socket (SO_REUSEADDR off, grpc.so_reuseport 0) is not bound: building the server
    raises serving's OSError naming the address (grpc's own RuntimeError is translated), never returns a server
    bound elsewhere."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        listen = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(OSError, match=rf"^cannot listen on {listen} .*is another process bound to it\?$"):
            grpc_server(MANAGER, pb_grpc.BlockManagerServicer(), listen)
    finally:
        s.close()


def test_plan_summary_has_exactly_its_keys_and_the_checked_backends():
    """summary() is plain data with exactly these keys; backends is the plan's backend names, as a list."""
    spec = CacheSpec(tuple(LayerSpec(2, 64, "float16") for _ in range(3)), 16)
    p = dataclasses.replace(plan(spec, Sizing(num_slots=9, max_seq_len=128)), backends=("zeta", "alpha"))
    s = p.summary()
    assert set(s) == {"num_slots", "page_size", "layout", "num_layers", "max_seq_len", "max_pages_per_seq",
                      "bytes_per_layer", "bytes_per_slot", "total_bytes", "group_slots", "equal_sizing_bytes",
                      "saved_bytes", "max_byte_offset", "offsets_exceed_int32", "offsets_exceed_uint32",
                      "indices_need_int64", "pool_pages", "backends", "groups", "index_spaces", "warnings", "notes"}
    assert s["backends"] == ["zeta", "alpha"] and type(s["backends"]) is list
    assert plan(spec, Sizing(num_slots=9, max_seq_len=128)).summary()["backends"] == []


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path):
    """ServerTLS with client_ca (mutual TLS, auth.py's docstring: clients must present a cert it signed): a client
    presenting a certificate the CA signed is answered (health SERVING); a client trusting the server but presenting
    no certificate is refused (UNAVAILABLE), never answered. Certificate made with openssl (skipped without it); it
    is self-signed, so it is its own CA."""
    import subprocess

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvservice.contract.auth import ServerTLS
    from tests.ci import need_tool

    openssl = need_tool("openssl", "apt package openssl")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "k.pem", "-out", "c.pem", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    tls = ServerTLS.from_files(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "c.pem")
    server, port, _health = grpc_server(MANAGER, pb_grpc.BlockManagerServicer(), "127.0.0.1:0", tls)
    server.start()
    check = health_pb2.HealthCheckRequest(service="")
    try:
        mutual = grpc.ssl_channel_credentials(root_certificates=tls.cert, private_key=tls.key,
                                              certificate_chain=tls.cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", mutual) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(check, timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
        anonymous = grpc.ssl_channel_credentials(root_certificates=tls.cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", anonymous) as ch:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(check, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
