# syntax=docker/dockerfile:1
# The GPU worker image: CUDA runtime, torch built for CUDA 12.8, the engine, and optionally
# flash-attn (compiled here, slow: set MAX_JOBS to your builder's cores) and bitsandbytes.
#   docker build -f infra/docker/worker.Dockerfile -t sluicegate-worker:0.1.0 \
#     --build-arg WITH_FLASH_ATTN=1 --build-arg WITH_BITSANDBYTES=1 .
# The base images are pinned to a patch release; pin them by digest in your own registry mirror.

FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --index-url "${TORCH_INDEX_URL}" torch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY sluicegate ./sluicegate
COPY cli ./cli
COPY ingress ./ingress
COPY batch_service ./batch_service
COPY router ./router
COPY gpu_workers ./gpu_workers
COPY result_service ./result_service
RUN pip install .
# The optional kernels (the `gpu` extra of pyproject.toml), each behind a build argument.
ARG WITH_BITSANDBYTES=0
RUN if [ "${WITH_BITSANDBYTES}" = "1" ]; then pip install "bitsandbytes>=0.50"; fi
ARG WITH_FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
ARG MAX_JOBS=4
# --no-build-isolation: flash-attn compiles against the torch installed above, not a fresh one.
RUN if [ "${WITH_FLASH_ATTN}" = "1" ]; then \
        pip install packaging wheel \
        && MAX_JOBS="${MAX_JOBS}" pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
# Triton (the engine's triton attention backend and torch.compile) builds its small launcher modules
# with the system C compiler and Python headers on first use, so the runtime keeps gcc and python3-dev.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 sluicegate \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/sluicegate --shell /usr/sbin/nologin sluicegate \
    && mkdir -p /var/lib/sluicegate /models \
    && chown 10001:10001 /var/lib/sluicegate /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICEGATE_STATE_DIR=/var/lib/sluicegate \
    SLUICEGATE_DEVICE=cuda \
    HF_HOME=/var/lib/sluicegate/hf \
    TRITON_CACHE_DIR=/var/lib/sluicegate/triton
WORKDIR /var/lib/sluicegate
USER 10001:10001
# Worker metrics, /healthz and /readyz (SLUICEGATE_WORKER_METRICS_PORT).
EXPOSE 8002
ENTRYPOINT ["sluicegate"]
CMD ["worker"]
