"""The clients: TLSOptions' mutual TLS really presents the client's certificate (a gRPC server that requires one,
certificates made with openssl, answers with the common name it verified); WorkerClient.copy_blocks copies the
pages of the layer group it names (a pool of two layer groups: the copy is read back through the other group's
layer by decode_attention, which must equal the source's); a StepStream has no reply pending (its deadline 0,
stream.py) once a step returned or failed."""

from __future__ import annotations

import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.client import TLSOptions, make_channel
from kvservice.client.codec import ClientError
from kvservice.client.stream import StepStream
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from tests.ci import need_tool
from tests.faultnet import dead_address

ECHO = "/s18rest.Echo/Who"


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    need_tool("openssl", "apt package openssl; deploy/ci-install.sh installs it")
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=s18-ca")
    for name, usage in (("server", "serverAuth"), ("client-7f3a", "clientAuth")):
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
        _openssl(d, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return d


def test_mutual_tls_presents_the_clients_certificate_and_key(pki):
    def who(request: bytes, context) -> bytes:
        return b",".join(context.auth_context().get("x509_common_name", [])) + b"|" + request

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("s18rest.Echo", {
        "Who": grpc.unary_unary_rpc_method_handler(who)})])
    creds = grpc.ssl_server_credentials([((pki / "server.key").read_bytes(), (pki / "server.crt").read_bytes())],
                                        root_certificates=(pki / "ca.crt").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        tls = TLSOptions.from_files(pki / "ca.crt", pki / "client-7f3a.crt", pki / "client-7f3a.key")
        payload = np.random.default_rng().bytes(12)
        with make_channel(f"127.0.0.1:{port}", tls) as ch:
            assert ch.unary_unary(ECHO)(payload, timeout=30) == b"client-7f3a|" + payload
        with make_channel(f"127.0.0.1:{port}", TLSOptions.from_files(pki / "ca.crt")) as ch:   # no client cert
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(ECHO)(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


PS, HEADS, DIM = 4, 2, 32
# layer 0: full attention (group 0); layer 1: a 16-token sliding window, its own layer group 1
SPEC = CacheSpec((LayerSpec(HEADS, DIM, "float32"), LayerSpec(HEADS, DIM, "float32", 16)), PS, "per_layer")


def test_copy_blocks_copies_the_pages_of_the_group_it_names():
    from kvservice.worker.server import serve_worker

    rng = np.random.default_rng(1818)
    mgr = serve("127.0.0.1:0")
    c = BlockManagerClient(f"127.0.0.1:{mgr.port}")
    worker = wc = None
    try:
        c.create_pool("g2", SPEC, Sizing(num_slots=24, max_seq_len=64))
        worker = serve_worker(c.target, "g2", "w2")
        wc = WorkerClient(f"127.0.0.1:{worker.port}", "w2", timeout=20, pool_incarnation=c.get_pool("g2").incarnation)
        res = c.step("g2", admit=[21, 22], admit_tokens=[8, 8])
        layer = 1
        st = res.for_layer(layer)
        assert st.space.group == 1 and res.for_layer(0).space.group == 0
        t, gens = st.table, st.generations
        assert t.indptr.tolist() == [0, 2, 4]                             # 8 tokens: two pages each
        k = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
        v = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
        wc.append_kv(layer, k, v, st.slot_mapping[:8], slot_generations=st.slot_generations[:8])   # sequence 21
        q = rng.standard_normal((1, HEADS, DIM)).astype(np.float32)
        src = PageTable(t.indptr[:2], t.indices[:2], t.last_page_len[:1])
        want = wc.decode_attention(layer, q, src, generations=gens[:2])
        assert want.violation.count == 0 and np.isfinite(want.out).all()
        space = st.space
        slots = (t.indices.astype(np.int64) - space.base - space.offset) // space.scale
        pairs = np.stack([slots[0:2], slots[2:4]], axis=1)
        pair_gens = np.stack([gens[0:2], gens[2:4]], axis=1).astype(np.uint32)
        assert all(r.count == 0 for r in wc.copy_blocks(1, pairs, generations=pair_gens).violations)
        dst = PageTable(np.array([0, 2], np.int32), t.indices[2:4], t.last_page_len[1:2])
        got = wc.decode_attention(layer, q, dst, generations=gens[2:4])
        assert got.violation.count == 0
        np.testing.assert_array_equal(got.out, want.out)
        np.testing.assert_array_equal(got.lse, want.lse)
    finally:
        if wc is not None:
            wc.close()
        if worker is not None:
            worker.stop()
        c.close()
        mgr.stop()


def test_a_stream_has_no_reply_pending_once_a_step_returned_or_failed():
    rng = np.random.default_rng(18)
    mgr = serve("127.0.0.1:0")
    c = BlockManagerClient(f"127.0.0.1:{mgr.port}")
    try:
        c.create_pool("s", CacheSpec.uniform(1, HEADS, DIM, "float32", PS), Sizing(num_slots=32, max_seq_len=64))
        with c.step_stream("s", timeout=30) as s:
            assert s._deadline == 0.0
            ids = [int(x) for x in rng.choice(10**6, 3, replace=False) + 1]
            res = s.step(admit=ids, admit_tokens=[int(x) for x in rng.integers(1, 20, 3)])
            assert res.seq_ids.tolist() == ids and s._deadline == 0.0
            for _ in range(3):
                s.step(extend=ids, extend_tokens=1)
                assert s._deadline == 0.0
            with pytest.raises(ClientError):
                s.step(admit=[ids[0]], admit_tokens=[3])               # already admitted: refused
            assert s._deadline == 0.0
    finally:
        c.close()
        mgr.stop()
    with BlockManagerClient(dead_address(), timeout=5.0, retries=0) as dead:
        s = StepStream(dead, "s", page_size=PS)
        with pytest.raises(ClientError):
            s.step(admit=[1], admit_tokens=[1])
        assert s._deadline == 0.0
        s.close()
