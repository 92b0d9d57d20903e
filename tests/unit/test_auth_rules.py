"""The token rules of kvservice/contract/auth.py without a server: the role each RPC needs against the role table
written in the module's docstring and docs/SECURITY.md (typed here from that prose, not read from the code), the
pool each request touches, and who a call's metadata names. The end-to-end checks (a refused call's status) are
tests/integration/test_security.py; these run in the mutation check's contract selection."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvservice.contract import auth
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb

# The documented table: read inspects, write adds Step/RegisterWorker/Heartbeat and the worker's kernels, admin adds
# CreatePool and DeletePool; the streaming twins take their unary call's role.
MANAGER_ROLES = {
    "read": {"GetPool", "ListPools", "ListSequences", "GetStats", "ValidatePageTable", "ListWorkers", "ScorePrefix",
             "WatchEvents", "Plan", "Echo", "EchoStream"},
    "write": {"Step", "StepStream", "RegisterWorker", "Heartbeat"},
    "admin": {"CreatePool", "DeletePool"},
}
WORKER_ROLES = {"read": {"Info", "ValidatePageTable", "CheckGuards"},
                "write": {"AppendKV", "DecodeAttention", "CopyBlocks", "CorruptGuard", "UpdateTables"}}


def _service_methods(module, name: str) -> set[str]:
    return {m.name for m in module.DESCRIPTOR.services_by_name[name].methods}


# The rules are built inside the test, not at collection: a mutation run collects once, before any mutant is active.
@pytest.mark.parametrize(("make_rules", "table", "module", "service"), [
    (lambda: auth.manager_rules(lambda w: None), MANAGER_ROLES, pb, "BlockManager"),
    (lambda: auth.worker_rules("p"), WORKER_ROLES, wpb, "Worker"),
])
def test_every_rpc_needs_the_documented_role(make_rules, table, module, service):
    rules = make_rules()
    want = {m: role for role, ms in table.items() for m in ms}
    assert set(rules) == set(want) == _service_methods(module, service)   # no RPC of the service without a rule
    assert {m: r.role for m, r in rules.items()} == want


def test_roles_rank_read_below_write_below_admin():
    for held in auth.ROLES:
        g = auth.Grant("t", None, held)
        assert [g.allows_role(r) for r in ("read", "write", "admin")] == \
               {"read": [True, False, False], "write": [True, True, False], "admin": [True, True, True]}[held]


def test_each_rule_names_the_pool_its_request_touches():
    rules = auth.manager_rules({"w-1": "pool-of-w1"}.get)
    assert rules["CreatePool"].pool(pb.CreatePoolRequest(name="new")) == "new"
    for m in ("DeletePool", "GetPool", "ListSequences", "ValidatePageTable", "Step", "RegisterWorker", "StepStream",
              "WatchEvents"):
        assert rules[m].pool(type("R", (), {"pool": "p7"})()) == "p7", m
    for m in ("GetStats", "ListWorkers"):          # an empty pool asks about every pool: filtered, not refused
        assert rules[m].pool(type("R", (), {"pool": ""})()) is None
        assert rules[m].pool(type("R", (), {"pool": "p2"})()) == "p2"
    assert rules["Heartbeat"].pool(type("R", (), {"pool": "", "worker_id": "w-1"})()) == "pool-of-w1"
    assert rules["Heartbeat"].named is False and all(r.named for m, r in rules.items() if m != "Heartbeat")
    assert rules["ScorePrefix"].pool(type("R", (), {"pools": ["a", "b"]})()) == ["a", "b"]
    for m in ("Plan", "Echo", "EchoStream", "ListPools"):
        assert rules[m].pool(object()) is None
    assert {r.pool(None) for r in auth.worker_rules("mine").values()} == {"mine"}


def _table(entries: str) -> auth.TokenTable:
    return auth.TokenTable.from_yaml(f"tokens:\n{entries}")


def test_principal_of_names_the_token_of_the_bearer_metadata():
    secret = os.urandom(12).hex()
    other = os.urandom(12).hex()
    table = _table(f"  - {{name: sched, token: {secret}, pools: [a]}}\n"
                   f"  - {{name: ops, sha256: {hashlib.sha256(other.encode()).hexdigest()}, pools: ['*'], "
                   "role: admin}\n")
    assert auth.principal_of(table, [("x-other", "1"), ("authorization", f"Bearer {secret}")]) == "sched"
    assert auth.principal_of(table, [("authorization", f"bearer   {other} ")]) == "ops"
    assert auth.principal_of(table, [("authorization", "Bearer " + "0" * 24)]) == auth.UNAUTHENTICATED
    assert auth.principal_of(table, [("authorization", secret)]) == auth.UNAUTHENTICATED    # no "Bearer "
    assert auth.principal_of(table, None) == auth.UNAUTHENTICATED
    assert auth.principal_of(None, [("authorization", f"Bearer {secret}")]) == ""
    g = table.lookup(other)
    assert g.role == "admin" and g.pools is None and table.lookup(secret).pools == frozenset({"a"})


def test_server_tls_names_the_flag_of_an_unreadable_file(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(b"CERT"), key.write_bytes(b"KEY")
    assert auth.ServerTLS.from_files(cert, key) == auth.ServerTLS(b"CERT", b"KEY", None)
    assert auth.ServerTLS.from_files(cert, key, cert).client_ca == b"CERT"
    with pytest.raises(auth.InvalidArgument, match=r"--tls-client-ca: cannot read .*missing"):
        auth.ServerTLS.from_files(cert, key, tmp_path / "missing")
    with pytest.raises(auth.InvalidArgument, match="--tls-key: cannot read"):
        auth.ServerTLS.from_files(cert, tmp_path / "nokey")


@pytest.mark.parametrize(("req_stream", "resp_stream"), [(False, False), (False, True), (True, False), (True, True)])
def test_a_refusal_keeps_the_methods_streaming_kind_and_its_message_codecs(req_stream, resp_stream):
    """auth._deny: the handler that refuses a call is of the method's streaming kind and decodes the request with the
    method's own deserializer (gRPC runs it before the handler), so a refused caller's malformed request is answered
    as anyone's is; the refusal is the handler's only behaviour."""
    import grpc

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    decode, encode = pb.StepRequest.FromString, pb.StepReply.SerializeToString
    handler = make[req_stream, resp_stream](lambda r, c: None, request_deserializer=decode,
                                            response_serializer=encode)
    denied = auth._deny(handler, grpc.StatusCode.PERMISSION_DENIED, "token 'x' may not call Step")
    assert (denied.request_streaming, denied.response_streaming) == (req_stream, resp_stream)
    assert denied.request_deserializer is decode and denied.response_serializer is encode
    behaviour = {(False, False): denied.unary_unary, (False, True): denied.unary_stream,
                 (True, False): denied.stream_unary, (True, True): denied.stream_stream}[req_stream, resp_stream]
    assert behaviour is not None


def test_a_tokens_file_mistake_names_the_file(tmp_path):
    """TokenTable.from_file parses like from_yaml and names the file it read (not the "<tokens>" default) when the
    document is wrong; an unreadable file names the --tokens-file flag."""
    path = tmp_path / f"tokens-{os.getpid()}.yaml"
    path.write_text("tokens: []\n")
    with pytest.raises(auth.InvalidArgument) as err:
        auth.TokenTable.from_file(path)
    assert err.value.message.startswith(f"{path}: expected a mapping with a non-empty 'tokens' list")
    with pytest.raises(auth.InvalidArgument, match="--tokens-file: cannot read"):
        auth.TokenTable.from_file(tmp_path / "absent.yaml")


def test_a_streaming_handler_is_closed_in_its_callers_context():
    """A server-streaming handler wrapped by _in_callers_context runs in the context it was called in, and so
    does its cleanup when the call ends early (a client cancel closes the reply iterator): the generator's
    finally still sees the caller's context variables."""
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    seen: list[str] = []
    secret = os.urandom(4).hex()

    def handler(request, context):
        var.set(secret)                      # as the token interceptor sets the principal for this call

        def replies():
            try:
                for i in range(5):
                    seen.append(var.get())
                    yield i
            finally:
                seen.append("closed:" + var.get())
        return replies()

    it = auth._in_callers_context(handler)(None, None)
    assert next(it) == 0 and next(it) == 1
    it.close()                                           # the call ends after two replies
    assert seen == [secret, secret, "closed:" + secret]
    assert var.get() == "nobody"                         # nothing leaked into this (the server's) context
