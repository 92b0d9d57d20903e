# syntax=docker/dockerfile:1.7
# kvservice block manager (also carries `kvworker` for the CPU backend, used by overlays/dev-cpu).
#
#   docker build -f deploy/docker/manager.Dockerfile -t kvservice:0.1.0 .      (from the repository root)
#
# The base is pinned by exact tag (no registry is reachable where this was written, so no
# digest could be read). Pin it by digest for production builds:
#   docker buildx imagetools inspect python:3.11.12-slim-bookworm   ->  FROM python:3.11.12-slim-bookworm@sha256:...

FROM python:3.11.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvservice ./kvservice
RUN python -m venv /opt/kvservice \
 && /opt/kvservice/bin/pip install --no-cache-dir . \
 && /opt/kvservice/bin/python -c "import kvservice.server.app, kvservice.client, grpc_health.v1"

FROM python:3.11.12-slim-bookworm
LABEL org.opencontainers.image.title="kvservice" \
      org.opencontainers.image.description="gRPC block manager for paged KV caches"
RUN groupadd --system --gid 10001 kvservice \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin kvservice \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/kvservice /etc/kvservice
COPY --from=build /opt/kvservice /opt/kvservice
COPY --chmod=0755 deploy/docker/grpc_health_check.py /opt/kvservice/bin/grpc-health-check
# Bytecode is compiled at build time; the root filesystem is read-only at run time.
ENV PATH=/opt/kvservice/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/kvservice
# 50051 gRPC (BlockManager, grpc.health.v1, reflection), 9400 /metrics
EXPOSE 50051 9400
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["grpc-health-check", "127.0.0.1:50051", "--service", "kvservice.v1.BlockManager"]
ENTRYPOINT ["kvservice"]
CMD ["serve", "--listen", "0.0.0.0:50051", "--metrics-addr", "0.0.0.0", "--metrics-port", "9400"]
