"""Transport security of the gRPC servers: TLS, mutual TLS, and bearer tokens scoped to pools.

Tokens file (``--tokens-file``, YAML)::

    tokens:
      - name: scheduler-a        # shown in logs and errors; the token itself never is
        sha256: 9f86d081...      # hex SHA-256 of the token (preferred), or `token: <the token>`
        pools: [llama-8b]        # pools it may touch; ["*"] = every pool
        role: write              # read | write | admin (default write)

Roles: ``read`` inspects its pools (GetPool, ListPools, ListSequences, GetStats,
ValidatePageTable, ListWorkers, ScorePrefix, WatchEvents, Plan, Echo; a worker's Info,
ValidatePageTable, CheckGuards);
``write`` adds Step, RegisterWorker, Heartbeat and a worker's kernels; ``admin`` adds
CreatePool and DeletePool. Listings are filtered to the token's pools. grpc.health.v1 needs no
token (probes). Clients send ``authorization: Bearer <token>`` metadata. See docs/SECURITY.md.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.received import unwrap
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice.contract.auth")
ROLES = ("read", "write", "admin")
HEALTH_SERVICE = "grpc.health.v1.Health"
#: Name of the token the current call was authorized with ("" without tokens); set around the handler.
_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("kvservice_principal", default="")
#: Pools that token may use (None = every pool, or no tokens); set with _PRINCIPAL.
_POOLS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("kvservice_pools", default=None)
BM = "kvservice.v1.BlockManager"
WORKER = "kvservice.v1.Worker"


def _read(path: str | Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise InvalidArgument(f"{flag}: cannot read {path}: {err.strerror}") from None


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """PEM server certificate chain and key; client_ca set = mutual TLS (clients must present a cert it signed)."""

    cert: bytes
    key: bytes = field(repr=False)
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> ServerTLS:
        return cls(_read(cert, "--tls-cert"), _read(key, "--tls-key"),
                   _read(client_ca, "--tls-client-ca") if client_ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token may do: its name (for logs), pools (None = all) and role."""

    name: str
    pools: frozenset[str] | None
    role: str

    def allows_role(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)

    def allows_pool(self, pool: str) -> bool:
        return self.pools is None or pool in self.pools


class TokenTable:
    """Token -> Grant, keyed by the token's SHA-256 so the table need not hold secrets."""

    def __init__(self, grants: dict[bytes, Grant]) -> None:
        self._by_digest = grants

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"TokenTable({', '.join(sorted(g.name for g in self._by_digest.values()))})"

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        return cls.from_yaml(_read(path, "--tokens-file").decode(), str(path))

    @classmethod
    def from_yaml(cls, text: str, source: str = "<tokens>") -> TokenTable:
        """Parse a tokens document; InvalidArgument naming the entry (never its secret) on a mistake."""
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            raise InvalidArgument(f"{source}: not valid YAML") from None
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise InvalidArgument(f"{source}: expected a mapping with a non-empty 'tokens' list")
        grants: dict[bytes, Grant] = {}
        for i, e in enumerate(entries):
            where = f"{source}: tokens[{i}]"
            if not isinstance(e, dict):
                raise InvalidArgument(f"{where}: expected a mapping")
            name = str(e.get("name") or f"token-{i}")
            if ("sha256" in e) == ("token" in e):
                raise InvalidArgument(f"{where} ({name}): give exactly one of sha256 or token")
            if "token" in e:
                secret = str(e["token"])
                if len(secret) < 16:
                    raise InvalidArgument(f"{where} ({name}): a token must have at least 16 characters")
                key = hashlib.sha256(secret.encode()).digest()
            else:
                try:
                    key = bytes.fromhex(str(e["sha256"]))
                except ValueError:
                    key = b""
                if len(key) != 32:
                    raise InvalidArgument(f"{where} ({name}): sha256 must be 64 hex digits")
            pools = e.get("pools")
            if not isinstance(pools, list) or not pools or not all(isinstance(p, str) for p in pools):
                raise InvalidArgument(f"{where} ({name}): pools must be a non-empty list of pool names or [\"*\"]")
            role = e.get("role", "write")
            if role not in ROLES:
                raise InvalidArgument(f"{where} ({name}): role must be one of {', '.join(ROLES)}, got {role!r}")
            if key in grants:
                raise InvalidArgument(f"{where} ({name}): same token as {grants[key].name!r}")
            grants[key] = Grant(name, None if "*" in pools else frozenset(pools), role)
        return cls(grants)

    def lookup(self, token: str) -> Grant | None:
        return self._by_digest.get(hashlib.sha256(token.encode()).digest())


#: The tenant of calls without a known token (refused by TokenAuthInterceptor; charged apart from every token).
UNAUTHENTICATED = "\x00unauthenticated"


def principal_of(table: TokenTable | None, metadata: Any) -> str:
    """The name of the token a call's metadata carries ("" without a table, UNAUTHENTICATED if unknown)."""
    if table is None:
        return ""
    token = _bearer(metadata)
    grant = table.lookup(token) if token else None
    return grant.name if grant is not None else UNAUTHENTICATED


def current_principal() -> str:
    """Name of the token the running call was authorized with; "" when the server takes no tokens."""
    return _PRINCIPAL.get()


def current_pools() -> frozenset[str] | None:
    """Pools the running call's token may use; None = every pool (a ["*"] token, or no tokens)."""
    return _POOLS.get()


@dataclass(frozen=True, slots=True)
class Rule:
    """Role an RPC needs, the pool its request touches (None = no pool), and a filter for listings.

    named: whether the caller named that pool itself. A pool found another way (the pool of the
    worker a Heartbeat names) is never named in a refusal: it may be another tenant's.
    """

    role: str
    pool: Callable[[Any], str | list[str] | None] = lambda r: None
    filter: Callable[[Any, Grant], Any] | None = None
    named: bool = True


def _pools_reply(reply: pb.ListPoolsReply, g: Grant) -> pb.ListPoolsReply:
    return pb.ListPoolsReply(pools=[p for p in reply.pools if g.allows_pool(p.name)])


def _stats_reply(reply: pb.StatsReply, g: Grant) -> pb.StatsReply:
    for name in [n for n in reply.pools if not g.allows_pool(n)]:
        del reply.pools[name]
    return reply


def _workers_reply(reply: pb.ListWorkersReply, g: Grant) -> pb.ListWorkersReply:
    return pb.ListWorkersReply(workers=[w for w in reply.workers if g.allows_pool(w.pool)])


def _scores_reply(reply: pb.ScorePrefixReply, g: Grant) -> pb.ScorePrefixReply:
    return pb.ScorePrefixReply(num_tokens=reply.num_tokens, scores=[s for s in reply.scores if g.allows_pool(s.pool)])


def _pool(r: Any) -> str:
    return r.pool


def _pool_or_all(r: Any) -> str | None:
    return r.pool or None


def manager_rules(worker_pool: Callable[[str], str | None]) -> dict[str, Rule]:
    """BlockManager RPC -> Rule; worker_pool(worker_id) names a registered worker's pool (None if unknown)."""
    return {
        "Plan": Rule("read"), "Echo": Rule("read"),
        "CreatePool": Rule("admin", lambda r: r.name), "DeletePool": Rule("admin", _pool),
        "GetPool": Rule("read", _pool), "ListSequences": Rule("read", _pool), "ValidatePageTable": Rule("read", _pool),
        "ListPools": Rule("read", filter=_pools_reply),
        "GetStats": Rule("read", _pool_or_all, _stats_reply),
        "ListWorkers": Rule("read", _pool_or_all, _workers_reply),
        "Step": Rule("write", _pool), "RegisterWorker": Rule("write", _pool),
        "StepStream": Rule("write", _pool), "EchoStream": Rule("read"),
        "Heartbeat": Rule("write", lambda r: r.pool or worker_pool(r.worker_id), named=False),
        "ScorePrefix": Rule("read", lambda r: list(r.pools), _scores_reply), "WatchEvents": Rule("read", _pool),
    }


def worker_rules(pool: str) -> dict[str, Rule]:
    """Worker RPC -> Rule: every call touches the worker's own pool."""
    def mine(_request: Any) -> str:
        return pool

    return {**{m: Rule("read", mine) for m in ("Info", "ValidatePageTable", "CheckGuards")},
            **{m: Rule("write", mine) for m in ("AppendKV", "DecodeAttention", "CopyBlocks", "CorruptGuard",
                                                "UpdateTables")}}


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that refuses the call."""
    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


def _run_in(ctx: contextvars.Context, replies: Any) -> Any:
    """Yield the replies of a handler's generator, resuming it each time in `ctx` (its token's context)."""
    try:
        while True:
            try:
                reply = ctx.run(next, replies)
            except StopIteration:
                return
            yield reply
    finally:
        close = getattr(replies, "close", None)
        if close is not None:
            ctx.run(close)


def _in_callers_context(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A server-streaming handler whose replies are produced in the context it was called in, where
    current_principal() and current_pools() are the caller's token's (not only while the call starts)."""
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        ctx = contextvars.copy_context()
        return _run_in(ctx, ctx.run(inner, request, context))
    return behavior


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a known bearer token (UNAUTHENTICATED) or outside its grant (PERMISSION_DENIED).

    rules: method name -> Rule for `service`; other services (reflection) need any known
    token; grpc.health.v1 needs none.
    """

    def __init__(self, table: TokenTable, service: str, rules: dict[str, Rule]) -> None:
        self.table = table
        self.service = service
        self.rules = rules

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        service, _, name = details.method.lstrip("/").partition("/")
        handler = continuation(details)
        if handler is None or service == HEALTH_SERVICE:
            return handler
        token = _bearer(details.invocation_metadata)
        grant = self.table.lookup(token) if token else None
        if grant is None:
            log.info("refused %s: %s bearer token", details.method, "unknown" if token else "no")
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                         f"{details.method} needs a known bearer token (metadata 'authorization: Bearer <token>')")
        rule = self.rules.get(name) if service == self.service else None
        if rule is None:
            return handler
        if not grant.allows_role(rule.role):
            log.warning("refused %s for token %r: role %s, needs %s", details.method, grant.name, grant.role, rule.role)
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"token {grant.name!r} has role {grant.role}; {name} needs {rule.role}")
        if handler.unary_stream is not None:           # WatchEvents: the pool is checked before streaming
            return grpc.unary_stream_rpc_method_handler(
                self._scoped(_in_callers_context(handler.unary_stream), rule, grant, name),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._scoped_stream(handler.stream_stream, rule, grant, name),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._scoped(handler.unary_unary, rule, grant, name), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    @staticmethod
    def _scoped_stream(inner: Callable[[Any, Any], Any], rule: Rule, grant: Grant,
                       name: str) -> Callable[[Any, Any], Any]:
        """A stream handler whose every request must name a pool of the grant (else the call ends PERMISSION_DENIED)."""
        def behavior(requests: Any, context: grpc.ServicerContext) -> Any:
            def checked() -> Any:
                for request in requests:
                    try:
                        pool = rule.pool(unwrap(request)[0])
                    except AttributeError:      # an unparsable request: the handler refuses it
                        pool = None
                    if pool is not None and not grant.allows_pool(pool):
                        log.warning("refused %s for token %r on pool %r", name, grant.name, pool)
                        allowed = "every pool" if grant.pools is None else ", ".join(sorted(grant.pools))
                        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                      f"token {grant.name!r} may not use pool {pool!r} (it may use: {allowed})")
                    yield request
                    request = None      # not kept while the stream waits for the next (the memory budget)
            # The handler runs (and is resumed, reply by reply) in a context of its own where
            # current_principal() is this token's name: streams are namespaced by tenant too.
            ctx = contextvars.copy_context()
            ctx.run(_PRINCIPAL.set, grant.name)
            ctx.run(_POOLS.set, grant.pools)
            yield from _run_in(ctx, ctx.run(inner, checked(), context))
        return behavior

    @staticmethod
    def _scoped(inner: Callable[[Any, Any], Any], rule: Rule, grant: Grant, name: str) -> Callable[[Any, Any], Any]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                named = rule.pool(unwrap(request)[0])
            except AttributeError:          # an unparsable request: the handler refuses it
                return inner(request, context)
            for pool in named if isinstance(named, list) else (named,):     # ScorePrefix names several
                if pool is not None and not grant.allows_pool(pool):
                    log.warning("refused %s for token %r on pool %r", name, grant.name, pool)
                    allowed = "every pool" if grant.pools is None else ", ".join(sorted(grant.pools))
                    what = f"pool {pool!r}" if rule.named or pool == getattr(request, "pool", None) else \
                        "the pool this request touches"
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  f"token {grant.name!r} may not use {what} (it may use: {allowed})")
            bound, pools = _PRINCIPAL.set(grant.name), _POOLS.set(grant.pools)
            try:
                reply = inner(request, context)
            finally:
                _POOLS.reset(pools)
                _PRINCIPAL.reset(bound)
            return rule.filter(reply, grant) if rule.filter is not None and grant.pools is not None else reply
        return behavior
