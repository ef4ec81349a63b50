"""The torch runtime: the torch model (``ricllm.engine.runtime.llama``, with the C kernels swapped in
by ``llama_fused`` for the ``cpu`` backend; ``gemma3`` for Gemma 3) on any device, in every weight
format (``llama_weights``, ``gemma3_weights``), with the attention backend the configuration picks."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ricllm.attention.backends import select_backend
from ricllm.cache.kv_cache import KVCache, plan_cache
from ricllm.cache.kv_format import kv_format
from ricllm.config import EngineConfig
from ricllm.engine.runtime import gemma3, gemma3_weights, llama_weights, weight_cache
from ricllm.engine.runtime.capabilities import C_KERNEL_CAPABILITIES, NO_LIMITS, RuntimeCapabilities
from ricllm.engine.runtime.interface import Runtime
from ricllm.engine.runtime.llama import LlamaModel
from ricllm.engine.runtime.llama_fused import FusedLlamaModel, enable_decoder_stack, model_class
from ricllm.engine.runtime.lora_delta import TorchLoraSlots
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.runtime.model_runner import ModelRunner
from ricllm.engine.runtime.sampler import sample, sample_allowed
from ricllm.model.formats import projection_formats
from ricllm.model.heap import release_free_heap
from ricllm.model.loader import open_checkpoint
from ricllm.model.packed_linear import resolve_formats
from ricllm.model.spec import ModelSpec


class LoadedModel:
    """A torch model as loaded: from the weight cache when it holds this configuration, else
    converted from the file (and then cached)."""

    def __init__(self, config: EngineConfig, model_path: Path, device: torch.device, dtype: torch.dtype):
        self.config, self.model_path, self.device, self.dtype = config, model_path, device, dtype
        self.weight_cache_entry = None
        if config.weight_cache:
            self.weight_cache_entry = weight_cache.entry_path(model_path, dtype, device, config.weights,
                                                              config.max_packed_rows)
            if self._from_cache():
                return
        self._from_file()

    def _backend(self, spec: ModelSpec):
        """The attention backend the configuration asks for, as far as the model's family allows."""
        name = self.config.attention_backend
        if spec.architecture == "gemma3":
            name = gemma3.attention_backend_name(name, self.device, spec.head_dim)
        quantized_kv = kv_format(self.config.kv_cache_dtype, str(self.dtype)).quantized
        backend = select_backend(name, self.device, torch.uint8 if quantized_kv else self.dtype, self.dtype)
        self.attention_backend = backend.name
        return backend

    def _from_cache(self) -> bool:
        cached = weight_cache.load(self.weight_cache_entry)
        if cached is None:
            return False
        self.weight_formats = cached.weight_formats
        backend = self._backend(cached.spec)
        with torch.device("meta"):
            model = _model_class(cached.spec, backend)(cached.spec, backend)
        self.model = weight_cache.adopt(model, cached, self.config.max_packed_rows).to(self.device).eval()
        self.spec, self.tokenizer = cached.spec, cached.tokenizer
        self.weights_source = f"cache {self.weight_cache_entry}"
        return True

    def _from_file(self) -> None:
        checkpoint = open_checkpoint(self.model_path)
        self.model = self._convert(checkpoint, self._backend(checkpoint.spec))
        self.weights_source = f"file {self.model_path}"
        if self.weight_cache_entry is not None:
            weight_cache.save(self.weight_cache_entry, checkpoint.spec, checkpoint.tokenizer, self.model,
                              self.weight_formats)
        self.spec, self.tokenizer = checkpoint.spec, checkpoint.tokenizer
        del checkpoint  # the file's reader: its objects join the conversion's freed temporaries
        release_free_heap()  # and the heap gives them all back before the KV pool is allocated

    def _convert(self, checkpoint, backend) -> LlamaModel:
        from tqdm import tqdm

        tensor_types = checkpoint.tensor_types()
        self.weight_formats = resolve_formats(self.config.weights, tensor_types, self.dtype, self.device)
        layer_format, head_format = self.weight_formats
        max_rows = self.config.max_packed_rows
        # each weight gets memory as it is read and each layer is packed once complete: the whole
        # dense model never exists at once (a first start's peak RSS)
        spec = checkpoint.spec
        model = _model_class(spec, backend).build(spec, backend, self.dtype, self.device, allocate=False)
        tensors = tqdm(checkpoint.tensors(), desc="loading weights", unit="tensor", disable=None, leave=False)

        def pack(index: int) -> None:
            llama_weights.pack_layer(model, index, projection_formats(layer_format, tensor_types, index), max_rows)
            release_free_heap()  # else the heap keeps its freed dense weights, between packed ones

        load = gemma3_weights.load_weights if spec.architecture == "gemma3" else llama_weights.load_weights
        load(model, tensors, self.device, None if layer_format == "dense" else pack)
        llama_weights.pack_head(model, head_format, max_rows)
        return model.eval()


def _model_class(spec: ModelSpec, backend) -> type[LlamaModel] | type[gemma3.Gemma3Model]:
    """The network of the model's family: Gemma 3's, or the Llama model (fused where the backend
    offers the C ops)."""
    return gemma3.Gemma3Model if spec.architecture == "gemma3" else model_class(backend)


def build_torch_runtime(config: EngineConfig, model_path: Path, why: str) -> Runtime:
    started = time.perf_counter()
    threads = config.apply_threads()
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    loaded = LoadedModel(config, model_path, device, dtype)
    load_s = time.perf_counter() - started
    enable_decoder_stack(loaded.model)
    geometry = plan_cache(loaded.spec, config.kv_cache_budget, config.block_size,
                          kv_format(config.kv_cache_dtype, str(dtype)))
    kv_cache = KVCache(loaded.spec, geometry, dtype, device)
    lora = adapter_slots(loaded.model, config.max_loras, device, dtype)
    return Runtime(
        name="torch", why=why, spec=loaded.spec, tokenizer=loaded.tokenizer, model=loaded.model,
        kv_cache=kv_cache, runner=ModelRunner(loaded.model, kv_cache, device, lora), lora=lora, sample=sample,
        sample_allowed=sample_allowed, new_generator=lambda seed: torch.Generator().manual_seed(seed), device=device,
        dtype=dtype, threads=threads, attention_backend=loaded.attention_backend, weight_formats=loaded.weight_formats,
        weights_source=loaded.weights_source, weight_cache_entry=loaded.weight_cache_entry, load_s=load_s,
        capabilities=capabilities_of(loaded.attention_backend))


def adapter_slots(model: LlamaModel | gemma3.Gemma3Model, capacity: int, device: torch.device,
                  dtype: torch.dtype) -> LoraSlots | TorchLoraSlots:
    """Where the C kernels run the model (the fused Llama model: its decoder stack, its per-op path;
    Gemma 3 on the ``cpu`` backend) the adapters are laid out for the C LoRA kernel; elsewhere they
    are tensors on the device. Either way in the activations' type."""
    if isinstance(model, FusedLlamaModel) or (isinstance(model, gemma3.Gemma3Model) and model.adapters_in_c):
        return LoraSlots(model.spec, capacity, bf16=dtype == torch.bfloat16)
    return TorchLoraSlots(model.spec, capacity, device, dtype)


def capabilities_of(attention_backend: str) -> RuntimeCapabilities:
    """The C kernels' limits where the ``cpu`` backend attends (and the decoder stack may run the
    step whole); none for the GPU kernels and the torch reference, whose step costs have no
    threshold in the size of the prefill."""
    return C_KERNEL_CAPABILITIES if attention_backend == "cpu" else NO_LIMITS
