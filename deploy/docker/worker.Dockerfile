# syntax=docker/dockerfile:1.7
# kvworker with the CUDA backend (CuPy from the `gpu` extra: cupy-cuda12x).
#
#   docker build -f deploy/docker/worker.Dockerfile -t kvworker:0.1.0 .       (from the repository root)
#
# The CUDA *runtime* image carries libcudart and NVRTC, which CuPy's RawModule uses to
# compile kvservice/worker/kernels/*.cu at first use (cached under CUPY_CACHE_DIR, an emptyDir in
# Kubernetes). Ubuntu 24.04's python3 is 3.12 (the project needs >= 3.11).
# Pinned by exact tag; pin by digest for production (docker buildx imagetools inspect ...).

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvservice ./kvservice
RUN python3 -m venv /opt/kvservice \
 && /opt/kvservice/bin/pip install --no-cache-dir '.[gpu]' \
 && /opt/kvservice/bin/python -c "import kvservice.worker.server, cupy, grpc_health.v1"

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04
LABEL org.opencontainers.image.title="kvworker" \
      org.opencontainers.image.description="kvservice GPU worker: bounds-checked paged CUDA kernels"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvservice \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin kvservice \
 && install -d -o 10001 -g 10001 -m 0750 /var/cache/kvworker
COPY --from=build /opt/kvservice /opt/kvservice
COPY --chmod=0755 deploy/docker/grpc_health_check.py /opt/kvservice/bin/grpc-health-check
ENV PATH=/opt/kvservice/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    CUPY_CACHE_DIR=/var/cache/kvworker/cupy NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/cache/kvworker
# 50061 gRPC (Worker, grpc.health.v1), 9500 /metrics
EXPOSE 50061 9500
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["grpc-health-check", "127.0.0.1:50061"]
ENTRYPOINT ["kvworker"]
CMD ["serve", "--listen", "0.0.0.0:50061", "--metrics-port", "9500", "--backend", "cuda"]
