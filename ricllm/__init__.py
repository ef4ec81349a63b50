"""ricllm: a deadline-aware LLM inference engine for the O-RAN near-RT RIC.

The public names load lazily, so ``ricllm.engine.runtime.llama`` or ``ricllm.kernels`` can be imported
where only torch is installed (the GPU check script runs so).
"""

from __future__ import annotations

import os

from ricllm.version import __version__

# A cap below AMX applies to torch's oneDNN too, not only to ricllm's kernels. The avx2 cap leaves
# oneDNN alone: below AVX-512 BF16 torch's dtype auto turns fp32, which packed weights refuse.
if (os.environ.get("RICLLM_NO_AMX", "") not in ("", "0")
        or os.environ.get("RICLLM_CPU_KERNELS", "").strip().lower() == "avx512"):
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Template", "LoRARequest", "Fallback"]


def __getattr__(name: str):
    if name == "LLM":
        from ricllm.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ricllm.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from ricllm.outputs import RequestOutput

        return RequestOutput
    if name == "Template":
        from ricllm.template import Template

        return Template
    if name == "LoRARequest":
        from ricllm.lora_request import LoRARequest

        return LoRARequest
    if name == "Fallback":
        from ricllm.structured.fallback import Fallback

        return Fallback
    raise AttributeError(f"module 'ricllm' has no attribute {name!r}")
