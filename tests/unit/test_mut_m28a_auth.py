"""TokenAuthInterceptor.intercept_service without a server: the handler it hands gRPC for each kind of call, what
that handler's behaviour does (the reply passed through, filtered, or the call aborted with the documented status
and message), the context the wrapped handler runs in (current_principal / current_pools), and the log line of
each refusal. The oracle is the rules in kvservice/contract/auth.py's docstring and docs/SECURITY.md, typed here.

gRPC calls intercept_service(continuation, details) with details carrying `method` and `invocation_metadata`,
and a handler's behaviour with (request, context); context.abort raises (it never returns). _Context below records
the abort and raises as gRPC's does; everything else is the real interceptor and real grpc method handlers."""

from __future__ import annotations

import logging
import os
import random
from collections import namedtuple

import grpc
import pytest

from kvservice.contract import auth
from kvservice.v1 import block_manager_pb2 as pb

BM = "/kvservice.v1.BlockManager/"
Details = namedtuple("Details", ["method", "invocation_metadata"])


class Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    def abort(self, code, message):
        self.aborted = (code, message)
        raise Aborted(message)


def _tokens():
    secrets = {n: os.urandom(10).hex() for n in ("ro", "rw", "adm", "all")}
    doc = (f"tokens:\n"
           f"  - {{name: ro, token: {secrets['ro']}, pools: [pa, pb], role: read}}\n"
           f"  - {{name: rw, token: {secrets['rw']}, pools: [pa], role: write}}\n"
           f"  - {{name: adm, token: {secrets['adm']}, pools: [pz, pa], role: admin}}\n"
           f"  - {{name: all, token: {secrets['all']}, pools: ['*']}}\n")
    return auth.TokenTable.from_yaml(doc), secrets


def _md(secret: str | None):
    return [("x-request-id", "1")] + ([("authorization", f"Bearer {secret}")] if secret else [])


def _interceptor():
    table, secrets = _tokens()
    return auth.TokenAuthInterceptor(table, "kvservice.v1.BlockManager", auth.manager_rules({"w9": "pb"}.get)), secrets


def _unary(fn):
    return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=pb.GetPoolRequest.FromString,
                                               response_serializer=pb.StepReply.SerializeToString)


def test_health_and_unknown_methods_are_passed_through_untouched():
    """grpc.health.v1 needs no token (probes): its handler comes back as is; a method the server does not serve
    (continuation gives None) stays None, so gRPC answers UNIMPLEMENTED."""
    icpt, _ = _interceptor()
    health = _unary(lambda r, c: "ok")
    assert icpt.intercept_service(lambda d: health, Details("/grpc.health.v1.Health/Check", [])) is health
    assert icpt.intercept_service(lambda d: None, Details(BM + "GetPool", [])) is None
    assert icpt.intercept_service(lambda d: None, Details(BM + "GetPool", _md("0" * 20))) is None


def test_an_unknown_or_missing_token_is_refused_unauthenticated_and_logged(caplog):
    caplog.set_level(logging.INFO, logger="kvservice.contract.auth")
    icpt, _ = _interceptor()
    calls = []
    for md, word in ((_md(None), "no"), (_md(os.urandom(10).hex()), "unknown")):
        h = icpt.intercept_service(lambda d: _unary(lambda req, c: calls.append(req)), Details(BM + "GetPool", md))
        ctx = _Context()
        with pytest.raises(Aborted):
            h.unary_unary(pb.GetPoolRequest(pool="pa"), ctx)
        assert ctx.aborted == (grpc.StatusCode.UNAUTHENTICATED, f"{BM}GetPool needs a known bearer token "
                                                                "(metadata 'authorization: Bearer <token>')")
        msgs = [r.getMessage() for r in caplog.records if r.name == "kvservice.contract.auth"]
        assert f"refused {BM}GetPool: {word} bearer token" in msgs, msgs
    assert calls == []


def test_a_role_refusal_names_the_tokens_role_and_the_needed_one(caplog):
    caplog.set_level(logging.WARNING, logger="kvservice.contract.auth")
    icpt, s = _interceptor()
    for who, method, need in (("ro", "Step", "write"), ("rw", "DeletePool", "admin"), ("ro", "CreatePool", "admin")):
        caplog.clear()
        h = icpt.intercept_service(lambda d: _unary(lambda r, c: "ran"), Details(BM + method, _md(s[who])))
        ctx = _Context()
        with pytest.raises(Aborted):
            h.unary_unary(pb.GetPoolRequest(pool="pa"), ctx)
        role = {"ro": "read", "rw": "write"}[who]
        assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED,
                               f"token {who!r} has role {role}; {method} needs {need}")
        msgs = [r.getMessage() for r in caplog.records]
        assert msgs == [f"refused {BM}{method} for token {who!r}: role {role}, needs {need}"]


def test_a_unary_call_runs_as_its_token_and_returns_the_handlers_reply():
    """Inside the handler current_principal()/current_pools() are the token's; after it, the server's ("", None).
    The reply is the handler's own object (unfiltered RPCs), or filtered to the token's pools (ListPools)."""
    icpt, s = _interceptor()
    seen = []
    token = object()

    def handler(request, context):
        seen.append((auth.current_principal(), auth.current_pools()))
        return token

    for who, pools in (("rw", frozenset({"pa"})), ("all", None)):
        h = icpt.intercept_service(lambda d: _unary(handler), Details(BM + "Step", _md(s[who])))
        assert h.unary_unary(pb.StepRequest(pool="pa"), _Context()) is token
        assert seen[-1] == (who, pools)
    assert (auth.current_principal(), auth.current_pools()) == ("", None)

    names = [f"p{random.randrange(1000)}" for _ in range(4)] + ["pa", "pb"]
    full = pb.ListPoolsReply(pools=[pb.PoolInfo(name=n) for n in names])
    for who, want in (("ro", ["pa", "pb"]), ("adm", ["pa"]), ("all", names)):
        h = icpt.intercept_service(lambda d: _unary(lambda r, c: full), Details(BM + "ListPools", _md(s[who])))
        assert [p.name for p in h.unary_unary(pb.ListPoolsRequest(), _Context()).pools] == want


def test_a_unary_call_on_a_pool_outside_the_grant_is_refused_naming_the_allowed_pools(caplog):
    caplog.set_level(logging.WARNING, logger="kvservice.contract.auth")
    icpt, s = _interceptor()
    ran = []
    h = icpt.intercept_service(lambda d: _unary(lambda r, c: ran.append(r)), Details(BM + "GetPool", _md(s["adm"])))
    ctx = _Context()
    with pytest.raises(Aborted):
        h.unary_unary(pb.GetPoolRequest(pool="pq"), ctx)
    assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED, "token 'adm' may not use pool 'pq' (it may use: pa, pz)")
    assert [r.getMessage() for r in caplog.records] == ["refused GetPool for token 'adm' on pool 'pq'"]
    assert ran == []


def _stream_handler(fn):
    return grpc.stream_stream_rpc_method_handler(fn, request_deserializer=pb.StepRequest.FromString,
                                                 response_serializer=pb.StepReply.SerializeToString)


def test_a_step_stream_runs_as_its_token_and_passes_requests_on_allowed_pools():
    icpt, s = _interceptor()
    seen = []

    def handler(requests, context):
        for r in requests:
            seen.append((r.pool, auth.current_principal(), auth.current_pools()))
            yield r.pool.upper()

    for who, pools in (("rw", frozenset({"pa"})), ("all", None)):
        seen.clear()
        h = icpt.intercept_service(lambda d: _stream_handler(handler), Details(BM + "StepStream", _md(s[who])))
        assert h.stream_stream is not None
        out = list(h.stream_stream(iter([pb.StepRequest(pool="pa"), pb.StepRequest(pool="pa")]), _Context()))
        assert out == ["PA", "PA"]
        assert seen == [("pa", who, pools)] * 2
    assert (auth.current_principal(), auth.current_pools()) == ("", None)


def test_a_step_stream_request_on_another_pool_ends_the_call_permission_denied(caplog):
    caplog.set_level(logging.WARNING, logger="kvservice.contract.auth")
    icpt, s = _interceptor()
    seen = []

    def handler(requests, context):
        for r in requests:
            seen.append(r.pool)
            yield r.pool

    h = icpt.intercept_service(lambda d: _stream_handler(handler), Details(BM + "StepStream", _md(s["ro"])))
    # read may not StepStream at all: a role refusal first
    ctx = _Context()
    with pytest.raises(Aborted):
        list(h.stream_stream(iter([pb.StepRequest(pool="pa")]), ctx))
    assert ctx.aborted[0] == grpc.StatusCode.PERMISSION_DENIED
    caplog.clear()
    h = icpt.intercept_service(lambda d: _stream_handler(handler), Details(BM + "StepStream", _md(s["rw"])))
    ctx = _Context()
    got = []
    with pytest.raises(Aborted):
        for reply in h.stream_stream(iter([pb.StepRequest(pool="pa"), pb.StepRequest(pool="pb")]), ctx):
            got.append(reply)
    assert got == ["pa"] and seen == ["pa"]
    assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED, "token 'rw' may not use pool 'pb' (it may use: pa)")
    assert [r.getMessage() for r in caplog.records] == ["refused StepStream for token 'rw' on pool 'pb'"]


def test_a_tokens_document_gives_the_documented_grants():
    """The tokens file format of auth.py's docstring / docs/SECURITY.md: name, sha256 (hex of the token) or token,
    pools (["*"] = every pool), role (read | write | admin, default write); unnamed entries are token-<i>."""
    import hashlib

    secrets = [os.urandom(12).hex() for _ in range(4)]
    digest = hashlib.sha256(secrets[1].encode()).hexdigest()
    table = auth.TokenTable.from_yaml(
        "tokens:\n"
        f"  - {{name: zed, token: '{secrets[0]}', pools: [p1, p2], role: read}}\n"
        f"  - {{sha256: {digest.upper()}, pools: ['*'], role: admin}}\n"
        f"  - {{name: mid, token: '{secrets[2]}', pools: [p3, '*']}}\n"
        f"  - {{name: abc, token: '{secrets[3][:16]}', pools: [p4]}}\n")
    assert len(table) == 4 and repr(table) == "TokenTable(abc, mid, token-1, zed)"
    assert table.lookup(secrets[0]) == auth.Grant("zed", frozenset({"p1", "p2"}), "read")
    assert table.lookup(secrets[1]) == auth.Grant("token-1", None, "admin")
    assert table.lookup(secrets[2]) == auth.Grant("mid", None, "write")
    assert table.lookup(secrets[3][:16]) == auth.Grant("abc", frozenset({"p4"}), "write")
    assert table.lookup(secrets[3]) is None and table.lookup(secrets[0] + " ") is None


@pytest.mark.parametrize(("doc", "message"), [
    ("tokens: [", "<tokens>: not valid YAML"),
    ("- a\n- b\n", "<tokens>: expected a mapping with a non-empty 'tokens' list"),
    ("tokens: {a: 1}\n", "<tokens>: expected a mapping with a non-empty 'tokens' list"),
    ("tokens:\n  - just-a-string\n", "<tokens>: tokens[0]: expected a mapping"),
    ("tokens:\n  - {name: a, pools: [p]}\n", "<tokens>: tokens[0] (a): give exactly one of sha256 or token"),
    ("tokens:\n  - {name: a, token: aaaaaaaaaaaaaaaa, sha256: " + "0" * 64 + ", pools: [p]}\n",
     "<tokens>: tokens[0] (a): give exactly one of sha256 or token"),
    ("tokens:\n  - {token: aaaaaaaaaaaaaaa, pools: [p]}\n",
     "<tokens>: tokens[0] (token-0): a token must have at least 16 characters"),
    ("tokens:\n  - {name: h, sha256: xyz, pools: [p]}\n", "<tokens>: tokens[0] (h): sha256 must be 64 hex digits"),
    ("tokens:\n  - {name: h, sha256: " + "ab" * 31 + ", pools: [p]}\n",
     "<tokens>: tokens[0] (h): sha256 must be 64 hex digits"),
    ("tokens:\n  - {name: q, token: aaaaaaaaaaaaaaaa}\n",
     "<tokens>: tokens[0] (q): pools must be a non-empty list of pool names or [\"*\"]"),
    ("tokens:\n  - {name: q, token: aaaaaaaaaaaaaaaa, pools: []}\n",
     "<tokens>: tokens[0] (q): pools must be a non-empty list of pool names or [\"*\"]"),
    ("tokens:\n  - {name: q, token: aaaaaaaaaaaaaaaa, pools: [p, 3]}\n",
     "<tokens>: tokens[0] (q): pools must be a non-empty list of pool names or [\"*\"]"),
    ("tokens:\n  - {name: q, token: aaaaaaaaaaaaaaaa, pools: p}\n",
     "<tokens>: tokens[0] (q): pools must be a non-empty list of pool names or [\"*\"]"),
    ("tokens:\n  - {name: r, token: aaaaaaaaaaaaaaaa, pools: [p], role: root}\n",
     "<tokens>: tokens[0] (r): role must be one of read, write, admin, got 'root'"),
    ("tokens:\n  - {name: one, token: aaaaaaaaaaaaaaaa, pools: [p]}\n"
     "  - {name: two, sha256: " + __import__("hashlib").sha256(b"a" * 16).hexdigest() + ", pools: [q]}\n",
     "<tokens>: tokens[1] (two): same token as 'one'"),
])
def test_a_tokens_document_mistake_is_named(doc, message):
    with pytest.raises(auth.InvalidArgument) as err:
        auth.TokenTable.from_yaml(doc)
    assert err.value.message == message


def test_listings_are_filtered_to_the_tokens_pools_and_several_named_pools_are_all_checked():
    icpt, s = _interceptor()
    names = [*sorted({f"q{random.randrange(10**6)}" for _ in range(3)}), "pa", "pb"]
    stats = pb.StatsReply()
    for i, n in enumerate(names):
        stats.pools[n].num_slots = 10 + i
    workers = pb.ListWorkersReply(workers=[pb.WorkerInfo(worker_id=f"w{i}", pool=n) for i, n in enumerate(names)])
    scores = pb.ScorePrefixReply(num_tokens=17, scores=[pb.PrefixScore(pool=n, cached_tokens=i + 1)
                                                        for i, n in enumerate(names)])

    def call(method, who, reply, request):
        fresh = type(reply)()            # _stats_reply filters the reply in place: a copy per call
        fresh.CopyFrom(reply)
        h = icpt.intercept_service(lambda d: _unary(lambda r, c: fresh), Details(BM + method, _md(s[who])))
        return h.unary_unary(request, _Context())

    got = call("GetStats", "ro", stats, pb.GetStatsRequest())
    assert {n: v.num_slots for n, v in got.pools.items()} == {n: 10 + names.index(n) for n in ("pa", "pb")}
    assert set(call("GetStats", "all", stats, pb.GetStatsRequest()).pools) == set(names)
    got = call("ListWorkers", "adm", workers, pb.ListWorkersRequest())
    assert [(w.worker_id, w.pool) for w in got.workers] == [(f"w{names.index('pa')}", "pa")]
    got = call("ScorePrefix", "ro", scores, pb.ScorePrefixRequest(pools=["pb", "pa"]))
    assert got.num_tokens == 17 and [(x.pool, x.cached_tokens) for x in got.scores] == \
        [("pa", names.index("pa") + 1), ("pb", names.index("pb") + 1)]
    ctx = _Context()
    h = icpt.intercept_service(lambda d: _unary(lambda r, c: scores), Details(BM + "ScorePrefix", _md(s["ro"])))
    with pytest.raises(Aborted):
        h.unary_unary(pb.ScorePrefixRequest(pools=["pa", names[0]]), ctx)
    assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED,
                           f"token 'ro' may not use pool {names[0]!r} (it may use: pa, pb)")


def test_a_heartbeat_for_another_tenants_worker_does_not_name_its_pool():
    """Heartbeat's pool comes from the worker registry when the request names none (Rule.named False): a refusal
    says "the pool this request touches"; a pool the caller named itself is named back."""
    icpt, s = _interceptor()                # worker w9 belongs to pool pb
    for request, what in ((pb.HeartbeatRequest(worker_id="w9"), "the pool this request touches"),
                          (pb.HeartbeatRequest(worker_id="w9", pool="pb"), "pool 'pb'")):
        h = icpt.intercept_service(lambda d: _unary(lambda r, c: "beat"), Details(BM + "Heartbeat", _md(s["rw"])))
        ctx = _Context()
        with pytest.raises(Aborted):
            h.unary_unary(request, ctx)
        assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED, f"token 'rw' may not use {what} (it may use: pa)")
    h = icpt.intercept_service(lambda d: _unary(lambda r, c: "beat"), Details(BM + "Heartbeat", _md(s["adm"])))
    assert h.unary_unary(pb.HeartbeatRequest(worker_id="w-unknown"), _Context()) == "beat"


def test_a_watch_stream_is_checked_before_streaming_and_runs_as_its_token():
    icpt, s = _interceptor()
    seen = []

    def watch(request, context):
        for i in range(3):
            seen.append((auth.current_principal(), auth.current_pools()))
            yield i

    def handler():
        return grpc.unary_stream_rpc_method_handler(watch, request_deserializer=pb.WatchEventsRequest.FromString,
                                                    response_serializer=pb.KVEventBatch.SerializeToString)
    h = icpt.intercept_service(lambda d: handler(), Details(BM + "WatchEvents", _md(s["ro"])))
    assert h.unary_stream is not None and h.unary_unary is None
    assert list(h.unary_stream(pb.WatchEventsRequest(pool="pb"), _Context())) == [0, 1, 2]
    assert seen == [("ro", frozenset({"pa", "pb"}))] * 3
    ctx = _Context()
    with pytest.raises(Aborted):
        list(icpt.intercept_service(lambda d: handler(), Details(BM + "WatchEvents", _md(s["rw"]))).unary_stream(
            pb.WatchEventsRequest(pool="pb"), ctx))
    assert ctx.aborted == (grpc.StatusCode.PERMISSION_DENIED, "token 'rw' may not use pool 'pb' (it may use: pa)")
    assert len(seen) == 3


def test_server_tls_without_a_client_ca_asks_no_client_certificate():
    """Plain TLS (no --tls-client-ca) builds server credentials that do not require client certificates (gRPC
    refuses to require them without a CA to check them against); mutual TLS with a CA builds too."""
    key, cert, ca = (os.urandom(16) for _ in range(3))
    assert isinstance(auth.ServerTLS(cert, key).credentials(), grpc.ServerCredentials)
    assert isinstance(auth.ServerTLS(cert, key, ca).credentials(), grpc.ServerCredentials)
    assert "key" not in repr(auth.ServerTLS(cert, key)) and repr(key) not in repr(auth.ServerTLS(cert, key))
