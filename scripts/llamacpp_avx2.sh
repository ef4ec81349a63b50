#!/usr/bin/env bash
# A second llama.cpp, held to AVX2, for like-for-like comparisons of ricllm's avx2 family on a machine with
# AVX-512: llama-cpp-python at the locked version, compiled here with GGML_NATIVE off and only x86-64-v3's
# instructions on (AVX, AVX2, FMA, F16C, BMI2; no AVX-VNNI, AVX-512 or AMX), in .venv-llamacpp-avx2 (several
# minutes). bench_cpu.py records the build's CMake flags beside its results. Then:
#   .venv/bin/python benchmarks/bench_cpu.py --avx2-only --llamacpp-python .venv-llamacpp-avx2/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(grep -iE '^llama[-_]cpp[-_]python==' constraints.txt | cut -d= -f3)
[ -x .venv-llamacpp-avx2/bin/python ] || python3 -m venv .venv-llamacpp-avx2
isa_on="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
isa_off="-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
isa_off="$isa_off -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# no cached wheel: pip's cache holds the native build under the same name and version
CMAKE_ARGS="-DGGML_NATIVE=OFF $isa_on $isa_off" .venv-llamacpp-avx2/bin/pip install --quiet --disable-pip-version-check \
    --no-cache-dir --no-binary llama-cpp-python -c constraints.txt "llama-cpp-python==$version"
.venv-llamacpp-avx2/bin/python -c "import llama_cpp; print('llama.cpp (AVX2 build):', llama_cpp.llama_print_system_info().decode())"
