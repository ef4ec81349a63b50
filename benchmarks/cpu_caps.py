"""How a benchmark on an AMX Xeon measures what a CPU without AMX (AMD Zen 4, older Xeons) runs.

``RICLLM_NO_AMX=1`` caps ricllm's own C kernels at the avx512 family. torch brings its own
libraries, which pick AMX by themselves: on this project's Xeon, SDPA's bf16 products ran MKL's
``gemm_bf16bf16f32_kernel_b0_amx`` even with oneDNN capped (``perf``: ``tdpbf16ps``), at a rate
above the AVX-512 FMA peak of the two cores. ``MKL_ENABLE_INSTRUCTIONS=AVX512_E3`` (AVX-512 with
VNNI and BF16, no AMX) and ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` cap MKL and oneDNN the same
way, so the torch runtime and SDPA run what they would run on such a CPU. Standard library only:
``bench_cpu.py``'s children import this before anything else.
"""

from __future__ import annotations

WITHOUT_AMX = {"RICLLM_NO_AMX": "1", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
# An AVX2-only CPU (AMD Zen 2/3, Xeons before Skylake-SP): ricllm's avx2 family, ricllm's bf16 probe answering
# no, and torch's own kernels (ATen's vector code, MKL, oneDNN) held to AVX2. The test suite runs its
# CPU-dependent part under this too (tests/test_avx2_only.py).
AVX2_ONLY = {"RICLLM_CPU_KERNELS": "avx2", "RICLLM_CPU_BF16": "0", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
