"""TLS, mutual TLS and pool-scoped bearer tokens on the manager and the worker (certificates made with openssl)."""

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import TLSOptions
from kvservice.contract.auth import ServerTLS, TokenTable
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.tools.launch import wait_for_ports
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from tests.ci import need_tool

from .conftest import ROOT, ManagerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True, scope="module")
def _openssl() -> None:
    """The openssl CLI makes the test certificates (skip locally without it; fail under CI)."""
    need_tool("openssl", "apt package openssl; deploy/ci-install.sh installs it")
TOKENS = {"admin": "admin-0123456789abcdef", "sched-a": "sched-a-0123456789abcdef",
          "reader": "reader-0123456789abcdef", "worker-w": "worker-w-0123456789abcdef"}
TOKENS_YAML = f"""
tokens:
  - {{name: admin, sha256: {hashlib.sha256(TOKENS["admin"].encode()).hexdigest()}, pools: ["*"], role: admin}}
  - {{name: sched-a, token: {TOKENS["sched-a"]}, pools: [a], role: write}}
  - {{name: reader, token: {TOKENS["reader"]}, pools: ["*"], role: read}}
  - {{name: worker-w, token: {TOKENS["worker-w"]}, pools: [w]}}
"""
SMALL = (CacheSpec.uniform(2, 1, 32, "float32", 16), Sizing(num_slots=16, max_seq_len=128))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, name: str, ca: str, usage: str) -> None:
    (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca signs server and client; rogue (another CA) signs rogue-client. Files: NAME.crt, NAME.key."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN={ca}-ca", cwd=d)
    _issue(d, "server", "ca", "serverAuth")
    _issue(d, "client", "ca", "clientAuth")
    _issue(d, "rogue-client", "rogue", "clientAuth")
    (d / "tokens.yaml").write_text(TOKENS_YAML)
    for name, tok in TOKENS.items():
        (d / f"{name}.token").write_text(tok + "\n")
    return d


def tls(pki, client="client", ca="ca"):
    return TLSOptions.from_files(pki / f"{ca}.crt", pki / f"{client}.crt" if client else None,
                                 pki / f"{client}.key" if client else None)


@pytest.fixture(scope="module")
def secure_manager(pki, tmp_path_factory):
    m = ManagerProcess(tmp_path_factory.mktemp("secure"), "--no-pools", "--tls-cert", str(pki / "server.crt"),
                       "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.crt"),
                       "--tokens-file", str(pki / "tokens.yaml"))
    with BlockManagerClient(m.target, tls=tls(pki), token=TOKENS["admin"]) as c:
        c.wait_ready()
        for name in ("a", "b", "w"):
            c.create_pool(name, *SMALL)
    yield m
    m.stop()


def refused(fn, code):
    with pytest.raises(ClientError) as exc:
        fn()
    assert exc.value.code == code, exc.value
    return exc.value


def test_mutual_tls_refuses_clients_without_the_right_certificate(pki, secure_manager):
    t = secure_manager.target
    for opts in (None, tls(pki, client=None), tls(pki, client="rogue-client"), tls(pki, ca="rogue")):
        with BlockManagerClient(t, timeout=3, retries=0, tls=opts, token=TOKENS["admin"]) as c:
            refused(c.list_pools, grpc.StatusCode.UNAVAILABLE)
    with BlockManagerClient(t, tls=tls(pki), token=TOKENS["admin"]) as c:
        assert sorted(p.name for p in c.list_pools()) == ["a", "b", "w"]


def test_tokens_are_required_and_scoped_to_pools(pki, secure_manager):
    t = secure_manager.target
    for token in (None, "not-a-known-token-at-all"):
        with BlockManagerClient(t, retries=0, tls=tls(pki), token=token) as c:
            err = refused(lambda c=c: c.step("a", admit=[1], admit_tokens=[3]), grpc.StatusCode.UNAUTHENTICATED)
            assert "bearer token" in err.message
    with BlockManagerClient(t, retries=0, tls=tls(pki), token=TOKENS["sched-a"]) as c:
        assert c.step("a", admit=[1], admit_tokens=[3]).num_tokens.tolist() == [3]
        err = refused(lambda: c.step("b", admit=[1], admit_tokens=[3]), grpc.StatusCode.PERMISSION_DENIED)
        assert "may not use pool 'b'" in err.message and TOKENS["sched-a"] not in err.message
        refused(lambda: c.sequences("b"), grpc.StatusCode.PERMISSION_DENIED)
        refused(lambda: c.step("nope", admit=[1], admit_tokens=[3]), grpc.StatusCode.PERMISSION_DENIED)
        refused(lambda: c.create_pool("a2", *SMALL), grpc.StatusCode.PERMISSION_DENIED)
        refused(lambda: c.delete_pool("a", force=True), grpc.StatusCode.PERMISSION_DENIED)
        assert [p.name for p in c.list_pools()] == ["a"] and list(c.stats()) == ["a"]
    with BlockManagerClient(t, retries=0, tls=tls(pki), token=TOKENS["reader"]) as c:
        assert sorted(c.stats()) == ["a", "b", "w"]
        err = refused(lambda: c.step("b", admit=[1], admit_tokens=[3]), grpc.StatusCode.PERMISSION_DENIED)
        assert "role read" in err.message
    with grpc.secure_channel(t, tls(pki).credentials()) as ch:      # probes need a certificate, no token
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    log = (secure_manager.port_file.parent / "manager.log").read_text()
    assert "refused" in log and not [tok for tok in TOKENS.values() if tok in log]


def test_kvctl_flags(pki, secure_manager):
    def kvctl(*extra):
        return subprocess.run([sys.executable, "-m", "kvservice.tools.kvctl", "--target", secure_manager.target,
                               "--tls-ca", str(pki / "ca.crt"), "--tls-cert", str(pki / "client.crt"),
                               "--tls-key", str(pki / "client.key"), *extra, "pools"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    ok = kvctl("--token-file", str(pki / "reader.token"))
    assert ok.returncode == 0 and "\nw " in ok.stdout, ok.stderr
    bad = kvctl()
    assert bad.returncode == 2 and "UNAUTHENTICATED" in bad.stderr


def test_worker_with_tls_and_tokens_both_ways(pki, secure_manager, tmp_path):
    ports = tmp_path / "ports"
    log = open(tmp_path / "worker.log", "w+")
    cert = ["--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.crt"), "--tokens-file", str(pki / "tokens.yaml")]
    to_manager = ["--manager-ca", str(pki / "ca.crt"), "--manager-cert", str(pki / "client.crt"),
                  "--manager-key", str(pki / "client.key"), "--manager-token-file", str(pki / "worker-w.token")]
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.worker.cli", "serve", "--manager", secure_manager.target,
                             "--pool", "w", "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--port-file",
                             str(ports), "--worker-id", "tw", *cert, *to_manager],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        target = f"127.0.0.1:{wait_for_ports(proc, ports, 60, Path(log.name), 'worker tw')[0]}"
        with BlockManagerClient(secure_manager.target, tls=tls(pki), token=TOKENS["worker-w"]) as c:
            assert [w.worker_id for w in c.workers("w")] == ["tw"]     # it registered through mTLS + token

        def info(opts, token):
            with grpc.secure_channel(target, opts.credentials()) as ch:
                md = (("authorization", f"Bearer {token}"),) if token else None
                return wpb_grpc.WorkerStub(ch).Info(wpb.WorkerInfoRequest(), timeout=5, metadata=md)
        assert info(tls(pki), TOKENS["worker-w"]).worker_id == "tw"
        for opts, token, code in ((tls(pki), None, grpc.StatusCode.UNAUTHENTICATED),
                                  (tls(pki), TOKENS["sched-a"], grpc.StatusCode.PERMISSION_DENIED),
                                  (tls(pki, client="rogue-client"), TOKENS["worker-w"], grpc.StatusCode.UNAVAILABLE)):
            with pytest.raises(grpc.RpcError) as exc:
                info(opts, token)
            assert exc.value.code() == code
        log.seek(0)
        assert not [tok for tok in TOKENS.values() if tok in log.read()]
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_server_tls_without_client_certificates(pki):
    running = serve(tls=ServerTLS.from_files(pki / "server.crt", pki / "server.key"))
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, tls=tls(pki, client=None)) as c:
            c.create_pool("t", *SMALL)
        for opts in (None, tls(pki, client=None, ca="rogue")):
            with BlockManagerClient(target, timeout=3, retries=0, tls=opts) as c:
                refused(c.list_pools, grpc.StatusCode.UNAVAILABLE)

        async def go():
            async with AsyncBlockManagerClient(target, tls=tls(pki, client=None)) as c:
                return (await c.step("t", admit=[1], admit_tokens=[5])).num_tokens.tolist()
        assert asyncio.run(go()) == [5]
    finally:
        running.stop()


@pytest.mark.parametrize(("text", "words"), [
    ("tokens: []", "non-empty 'tokens' list"),
    ("tokens: [{name: x, token: short, pools: [a]}]", "at least 16 characters"),
    ("tokens: [{name: x, token: aaaaaaaaaaaaaaaaaaaa, sha256: ab, pools: [a]}]", "exactly one of"),
    ("tokens: [{name: x, token: aaaaaaaaaaaaaaaaaaaa, pools: []}]", "non-empty list"),
    ("tokens: [{name: x, token: aaaaaaaaaaaaaaaaaaaa, pools: [a], role: root}]", "role must be one of"),
    ("tokens: [{name: x, sha256: zz, pools: [a]}]", "64 hex digits"),
    ("tokens: [{name: x, token: aaaaaaaaaaaaaaaaaaaa, pools: [a]}, {name: y, token: aaaaaaaaaaaaaaaaaaaa, "
     "pools: [b]}]", "same token as 'x'"),
])
def test_tokens_file_errors_name_the_entry_never_the_secret(text, words):
    with pytest.raises(InvalidArgument) as exc:
        TokenTable.from_yaml(text)
    assert words in exc.value.message and "aaaaaaaaaaaaaaaa" not in exc.value.message
