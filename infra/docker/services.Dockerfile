# syntax=docker/dockerfile:1
# The services image (CPU only): ingress, router, result service, the Celery batch worker, and a CPU
# worker for small models. Build from the repository root:
#   docker build -f infra/docker/services.Dockerfile -t sluicegate:0.1.0 .
# The base images are pinned to a patch release; pin them by digest in your own registry mirror.

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch from the CPU wheel index first: the default index would bring the CUDA build (gigabytes of
# libraries this image never uses); `pip install .` below then finds torch already satisfied.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch
# The project last, so that editing code does not re-download torch.
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

FROM python:3.11.13-slim-bookworm
# One unprivileged user with a fixed numeric id, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --gid 10001 sluicegate \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/sluicegate --shell /usr/sbin/nologin sluicegate \
    && mkdir -p /var/lib/sluicegate /models \
    && chown 10001:10001 /var/lib/sluicegate /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICEGATE_STATE_DIR=/var/lib/sluicegate \
    HF_HOME=/var/lib/sluicegate/hf
WORKDIR /var/lib/sluicegate
USER 10001:10001
# ingress, result service, worker metrics, router metrics (see docs/configuration.md).
EXPOSE 8000 8001 8002 8003
ENTRYPOINT ["sluicegate"]
CMD ["--help"]
