#!/usr/bin/env python3
"""gRPC health check for the kvservice images (Docker HEALTHCHECK, exec probes).

    grpc_health_check.py [ADDR] [--service NAME] [--timeout S] [--tls-ca F [--tls-cert F --tls-key F]]

Exit 0 when ADDR (default 127.0.0.1:50051) answers grpc.health.v1 Check with
SERVING for NAME (default "": the whole server), 1 otherwise, with one line
saying why. It uses grpcio-health-checking, already a dependency of the
images, because a grpc_health_probe binary cannot be fetched at build time
everywhere; Kubernetes itself probes with native `grpc:` probes and does not use
this script unless TLS is on (kubelet's gRPC probes speak plaintext only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None) -> tuple[bool, str]:
    """(serving, reason) for one Check call."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes(),
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
        channel = grpc.secure_channel(addr, creds)
    else:
        channel = grpc.insecure_channel(addr)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{addr} service {service!r}: {exc.code().name}: {exc.details()}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{addr} service {service!r}: {status}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr", nargs="?", default="127.0.0.1:50051")
    ap.add_argument("--service", default="")
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--tls-ca")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    args = ap.parse_args(argv)
    ok, reason = check(args.addr, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key)
    print(("healthy: " if ok else "unhealthy: ") + reason, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
