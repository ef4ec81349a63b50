"""The one object the engine holds for model execution: a ``Runtime``, built by either runtime.

Its model, cache, runner, device and dtype are each one of the runtimes' concrete types (torch's,
the native runtime's or the ONNX runtime's). They are named here only for type checking: the native
and ONNX runtimes must not import torch, and no runtime module may be imported by this one (each
imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ricllm.engine.runtime.capabilities import RuntimeCapabilities
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # only for the checker: importing torch here would load it into the native runtime
    import numpy as np
    import torch

    from ricllm.cache.kv_cache import KVCache, NativeKVCache
    from ricllm.engine.runtime.llama import LlamaModel
    from ricllm.engine.runtime.lora_delta import TorchLoraSlots
    from ricllm.engine.runtime.lora_slots import LoraSlots
    from ricllm.engine.runtime.model_runner import ModelRunner
    from ricllm.engine.runtime.native_model import NativeModel, NativeModelRunner
    from ricllm.engine.runtime.onnx_cuda import OnnxCudaKVCache, OnnxCudaModel, OnnxCudaModelRunner
    from ricllm.engine.runtime.onnx_model import OnnxKVCache, OnnxModel, OnnxModelRunner
    from ricllm.sampling_params import SamplingParams

# strings, so that nothing above is needed when the module runs
Model = Union["LlamaModel", "NativeModel", "OnnxModel", "OnnxCudaModel"]
KVStore = Union["KVCache", "NativeKVCache", "OnnxKVCache", "OnnxCudaKVCache"]  # ``geometry``, ``layers``, ``total_bytes()``
# ``run(batch) -> (fp32 logits [N, vocab], rows)``; ``run(batch, allowed) -> (StepLogits, rows)`` with
# each sampled row's allowed ids (None: unconstrained), the constrained rows on the k-wide head (``narrow_head``)
Runner = Union["ModelRunner", "NativeModelRunner", "OnnxModelRunner", "OnnxCudaModelRunner"]
# ``capacity``, ``load(slot, adapter)``, ``unload(slot)``, ``nbytes``: the C kernels' layout (the
# native runtime; the torch one on the CPU with the C kernels) or torch tensors on the device
AdapterSlots = Union["LoraSlots", "TorchLoraSlots"]
Device = Union["torch.device", str]  # the native runtime's is "cpu", the ONNX runtime's "cpu" or "cuda:N"
DType = Union["torch.dtype", str]  # the native runtime's is "bfloat16", the ONNX runtime's "float32" ("float16" on a GPU)
Generator = Union["torch.Generator", "np.random.Generator"]
Sampler = Callable[[Any, "list[SamplingParams]", "list[Generator | None]"], "list[int]"]
# (allowed ids ascending, their fp32 logits, params, generator) -> one of the ids
AllowedSampler = Callable[["np.ndarray", Any, "SamplingParams", "Generator | None"], int]


@dataclass(frozen=True)
class Runtime:
    name: str  # "torch", "native" or "onnx"
    why: str  # why this runtime serves the configuration
    spec: ModelSpec
    tokenizer: Tokenizer
    model: Model
    kv_cache: KVStore
    runner: Runner
    sample: Sampler  # (logits, params, generators) -> token ids
    sample_allowed: AllowedSampler  # a constrained row's token, from its allowed tokens' logits alone
    new_generator: Callable[[int], Generator]  # a seeded generator for one sampled request
    device: Device
    dtype: DType
    threads: int
    attention_backend: str
    weight_formats: tuple[str, str]
    weights_source: str
    weight_cache_entry: Path | None
    load_s: float  # loading (and converting) the weights
    capabilities: RuntimeCapabilities  # what admission, the scheduler and the latency model may rely on
    lora: AdapterSlots  # the resident LoRA adapters, ``config.max_loras`` slots; a sequence names its slot

    @property
    def runs_ricllm_kernels(self) -> bool:
        """Whether the model runs on ricllm's C kernels (the native and torch runtimes on the CPU):
        ONNX Runtime brings its own, so an ONNX start neither builds nor names them."""
        return str(self.device) == "cpu" and self.name != "onnx"
