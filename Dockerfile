# kvscope: one image for the engine and the gateway (the compose services pick the command).
#   CPU (default):  docker build -t kvscope:0.1.0 .
#   GPU (CUDA 12.8, NVIDIA driver on the host + NVIDIA container toolkit):
#     docker build -t kvscope:0.1.0-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg KVSCOPE_EXTRAS=engine,gateway,kernels .
#     docker compose -f compose.yaml -f compose.gpu.yaml up
# The CUDA wheels of torch bundle the CUDA runtime, so the same slim base image serves both variants.
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG KVSCOPE_EXTRAS=engine,gateway
# 1: download SmolLM2-135M into the image at build time (otherwise on first start, into the volume).
ARG PRELOAD_MODEL=0

# PYTHONSAFEPATH: `python -m ...` in /opt/kvscope does not put the source folders on sys.path (the top-level
# name `kernels` is Hugging Face's package, which transformers imports, not kvscope's kernels/ folder).
ENV PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVSCOPE_CACHE=/var/lib/kvscope

# curl: health checks and the one-shot Kibana import (compose service kibana-setup).
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kvscope \
    && install -d -o kvscope -g kvscope /var/lib/kvscope /var/log/kvscope

# torch first, from the PyTorch index of the chosen variant (PyPI's default torch pulls the CUDA build).
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/kvscope
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY gateway ./gateway
COPY kernels ./kernels
COPY dashboards ./dashboards
# the console evaluates the shipped alert rules: gateway/console/kvscope.rules.yaml links to this file
COPY alerts ./alerts
# kvscope/ links engine, gateway, kernels and dashboards in as kvscope.engine, ...; src/kvscope links to kvscope/
# (the package root pyproject.toml installs from). The wheel holds real files.
COPY kvscope ./kvscope
COPY src ./src
RUN pip install --no-cache-dir ".[${KVSCOPE_EXTRAS}]"

USER kvscope
RUN if [ "${PRELOAD_MODEL}" = "1" ]; then kvscope pull smollm2-135m; fi

EXPOSE 8000 4000
CMD ["kvscope", "engine", "--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
