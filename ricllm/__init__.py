"""ricllm: a deadline-aware LLM inference engine for the O-RAN near-RT RIC."""

from ricllm.engine.llm import LLM
from ricllm.outputs import RequestOutput
from ricllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
