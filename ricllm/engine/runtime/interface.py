"""The one object the engine holds for model execution: a ``Runtime``, built by either runtime.

Its model, cache, runner, device and dtype are each one of two concrete types (torch's or the
native runtime's). They are named here only for type checking: the native runtime must not
import torch, and neither runtime module may be imported by this one (each imports it).
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
    from ricllm.sampling_params import SamplingParams

# strings, so that nothing above is needed when the module runs
Model = Union["LlamaModel", "NativeModel"]
KVStore = Union["KVCache", "NativeKVCache"]  # ``geometry``, ``layers``, ``total_bytes()``
Runner = Union["ModelRunner", "NativeModelRunner"]  # ``run(batch) -> (fp32 logits [N, vocab], rows)``
# ``capacity``, ``load(slot, adapter)``, ``unload(slot)``, ``nbytes``: the C kernels' layout (the
# native runtime; the torch one on the CPU with the C kernels) or torch tensors on the device
AdapterSlots = Union["LoraSlots", "TorchLoraSlots"]
Device = Union["torch.device", str]  # the native runtime's is "cpu"
DType = Union["torch.dtype", str]  # the native runtime's is "bfloat16"
Generator = Union["torch.Generator", "np.random.Generator"]
Sampler = Callable[[Any, "list[SamplingParams]", "list[Generator | None]"], "list[int]"]
Masker = Callable[[Any, "list[int]", "np.ndarray"], Any]  # (logits, rows, allowed) -> the masked logits
# (logits, rows, token ids) -> logits[rows[i], token_ids[i]] for each i, float64 on the host
AllowedLogits = Callable[[Any, "np.ndarray", "np.ndarray"], "np.ndarray"]


@dataclass(frozen=True)
class Runtime:
    name: str  # "torch" or "native"
    why: str  # why this runtime serves the configuration
    spec: ModelSpec
    tokenizer: Tokenizer
    model: Model
    kv_cache: KVStore
    runner: Runner
    sample: Sampler  # (logits, params, generators) -> token ids
    mask: Masker  # forbids on the constrained rows what their grammar does not allow, before sampling
    allowed_logits: AllowedLogits  # what a constrained step's decision confidence is computed from
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
