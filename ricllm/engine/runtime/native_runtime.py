"""The native runtime: the model as ricllm's C kernels on numpy arrays, with no torch in the process.

This module builds it: the thread count, the weights, the model (``native_model``; Gemma 3's in
``native_gemma3``), its KV store and the numpy sampler. Every step runs as one C call for all layers (``kernels/cpu_decoder.c``: the
same kernels, order and roundings as the torch runtime's decoder stack), prefill chunks included:
the C attention kernel attends causally through the block tables. Where the torch runtime also
uses the stack (decode steps, small prefills) the two give bit-identical logits.

The weights come from a native weights file (``ricllm.model.native_weights``), converted once
from the model file by the torch runtime's code in a child process (``ricllm.engine.runtime.native_convert``:
this process never imports torch), then mapped: later starts read it in milliseconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ricllm.cache.kv_cache import NativeKVCache, plan_cache
from ricllm.cache.kv_format import kv_format
from ricllm.config import EngineConfig
from ricllm.engine.runtime import numpy_sampler
from ricllm.engine.runtime.capabilities import C_KERNEL_CAPABILITIES
from ricllm.engine.runtime.interface import Runtime
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.runtime.native_convert import load_weights
from ricllm.engine.runtime.native_gemma3 import NativeGemma3Model
from ricllm.engine.runtime.native_model import NativeModel, NativeModelRunner


def default_threads(config: EngineConfig) -> int:
    """:meth:`EngineConfig.requested_threads`, else the physical cores this process may run on (as
    torch counts: a second hyperthread per core only contends for the same vector units)."""
    return config.requested_threads() or physical_cores()


def physical_cores() -> int:
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:  # no topology to read: count what may run
            return len(cpus)
    return len(cores) or len(cpus)


def build_native_runtime(config: EngineConfig, model_path: Path) -> Runtime:
    started = time.perf_counter()
    threads = default_threads(config)
    weights, source, entry = load_weights(config, model_path)
    load_s = time.perf_counter() - started
    model = (NativeGemma3Model if weights.spec.architecture == "gemma3" else NativeModel)(weights, threads)
    geometry = plan_cache(weights.spec, config.kv_cache_budget, config.block_size,
                          kv_format(config.kv_cache_dtype, "bfloat16"))
    kv_cache = NativeKVCache(weights.spec, geometry)
    lora = LoraSlots(weights.spec, config.max_loras, bf16=True)  # in the activations' type: bf16
    return Runtime(
        name="native", why="the C decoder stack serves this model whole", spec=weights.spec,
        tokenizer=weights.tokenizer, model=model, kv_cache=kv_cache,
        runner=NativeModelRunner(model, kv_cache, lora, config.pin_threads), lora=lora,
        sample=numpy_sampler.sample, sample_allowed=numpy_sampler.sample_allowed,
        new_generator=numpy_sampler.new_generator, device="cpu", dtype="bfloat16",
        threads=threads, attention_backend="cpu", weight_formats=weights.weight_formats, weights_source=source,
        weight_cache_entry=entry, load_s=load_s, capabilities=C_KERNEL_CAPABILITIES)
