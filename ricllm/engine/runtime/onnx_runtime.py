"""The ONNX runtime: the model as one ONNX Runtime session over ricllm's paged KV pool, no torch in the process.

The graph is written once from the GGUF (``onnx_export``) and cached like the native weights; the
engine above keeps its scheduler, paged pool and block tables, prefix caching and constrained
decoding. This module builds the runtime: the thread count, the graph, the session and the fp32
pool (``onnx_model``: one step is one ``session.run``).

On ``device="cuda"`` (``cuda:N``) the graph is the paged one (``onnx_paged_attention``: one
``PagedAttention`` per layer) in ONNX Runtime's CUDA provider, the pool fp16 on the GPU and bound in
place (``onnx_cuda``); that needs ONNX Runtime's CUDA build (``ricllm[onnx-gpu]``), and without it the
start names that extra. ``device="auto"`` stays on the CPU: the ONNX runtime uses a GPU only when asked.

On the CPU the pool is fp32 (ONNX Runtime's CPU kernels compute in fp32); int8 and windowed KV caches and
LoRA adapters (the runtime has no adapter slots, so loading one is refused by name) are not served here
yet. Gemma 3's hybrid pool (a block table per cache group) is served: each layer reads and writes its
slot through its group's tables (``onnx_model.view_step_inputs``). ONNX Runtime's threads follow the
engine's ``threads`` (``engine_cpus`` pins the process before the session starts its pool, so its
workers inherit the CPUs), and its workers do not spin between runs
(``session.intra_op.allow_spinning`` 0): on a shared RIC node a spinning pool burns the cores other
xApps run on.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from ricllm.cache.kv_cache import plan_cache
from ricllm.cache.kv_format import kv_format
from ricllm.config import EngineConfig
from ricllm.engine.runtime import numpy_sampler
from ricllm.engine.runtime.capabilities import NO_LIMITS
from ricllm.engine.runtime.interface import Runtime
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.runtime.native_runtime import default_threads
from ricllm.engine.runtime.onnx_export import OnnxExportUnsupported, load_or_export
from ricllm.engine.runtime.onnx_cuda import (OnnxCudaKVCache, OnnxCudaModel, OnnxCudaModelRunner,
                                              cuda_provider_problem, device_index)
from ricllm.engine.runtime.onnx_model import OnnxKVCache, OnnxModel, OnnxModelRunner
from ricllm.engine.runtime.onnx_paged_attention import ATTENTION_GRAPHS
from ricllm.errors import ConfigError
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer


def on_cuda(config: EngineConfig) -> bool:
    return config.device.startswith("cuda")


def onnx_unsupported_reason(config: EngineConfig) -> str | None:
    """Why the ONNX runtime cannot serve this configuration (None: it can)."""
    if on_cuda(config):
        return cuda_unsupported_reason(config)
    if config.dtype not in ("auto", "float32", "fp32"):
        return f"dtype {config.dtype!r}: the ONNX runtime computes in float32"
    if config.weights != "auto":
        return f"weights {config.weights!r}: the ONNX graph keeps the file's own formats (weights auto)"
    if config.kv_cache_dtype != "auto":
        return f"kv_cache_dtype {config.kv_cache_dtype!r}: the ONNX runtime keeps an fp32 KV pool"
    if config.attention_backend not in ("auto", "cpu"):
        return f"attention backend {config.attention_backend!r}: the ONNX runtime attends in its graph"
    return None


def cuda_unsupported_reason(config: EngineConfig) -> str | None:
    """Why the ONNX runtime cannot serve this configuration on a GPU (None: it can)."""
    if config.dtype not in ("auto", "float16", "fp16"):
        return (f"dtype {config.dtype!r}: on a GPU the ONNX runtime attends in float16 over a float16 pool "
                "(PagedAttention's type; its other nodes compute in float32)")
    if config.weights != "auto":
        return f"weights {config.weights!r}: the ONNX graph keeps the file's own formats (weights auto)"
    if config.kv_cache_dtype != "auto":
        return f"kv_cache_dtype {config.kv_cache_dtype!r}: the ONNX runtime on a GPU keeps a float16 KV pool"
    if config.attention_backend not in ("auto", "cuda"):
        return f"attention backend {config.attention_backend!r}: on a GPU the ONNX runtime attends with PagedAttention"
    if config.block_size < 16 or config.block_size & (config.block_size - 1):
        return f"block_size {config.block_size}: PagedAttention takes a power of two of at least 16"
    problem = cuda_provider_problem()
    return None if problem is None else f"device {config.device!r}: {problem}"


def build_onnx_runtime(config: EngineConfig, model_path: Path) -> Runtime:
    reason = onnx_unsupported_reason(config)
    if reason is not None:
        raise ConfigError(f"runtime 'onnx' cannot serve this configuration: {reason}")
    started = time.perf_counter()
    threads = default_threads(config)
    cuda = on_cuda(config)
    private = None if config.weight_cache else Path(tempfile.mkdtemp(prefix="ricllm-onnx-"))
    try:
        path, meta, source = load_or_export(model_path, config.weight_cache, private,
                                            ATTENTION_GRAPHS["paged" if cuda else "gather"])
        spec = ModelSpec.from_dict(meta["spec"])
        model = (OnnxCudaModel(path, spec, threads, device_index(config.device)) if cuda
                 else OnnxModel(path, spec, threads))
    except OnnxExportUnsupported as exc:
        raise ConfigError(f"runtime 'onnx' cannot serve this model: {exc}") from exc
    finally:
        if private is not None:  # the session holds what it needs of the file
            shutil.rmtree(private, ignore_errors=True)
    load_s = time.perf_counter() - started
    dtype = "float16" if cuda else "float32"
    geometry = plan_cache(spec, config.kv_cache_budget, config.block_size, kv_format("auto", dtype))
    if cuda:
        kv_cache = OnnxCudaKVCache(spec, geometry, model.device)
        runner = OnnxCudaModelRunner(model, kv_cache)
    else:
        kv_cache = OnnxKVCache(spec, geometry)
        runner = OnnxModelRunner(model, kv_cache)
    layers, head = meta["weight_formats"]
    return Runtime(
        name="onnx", why="runtime 'onnx' was asked for", spec=spec, tokenizer=Tokenizer.from_state(meta["tokenizer"]),
        model=model, kv_cache=kv_cache, runner=runner,
        lora=LoraSlots(spec, 0, bf16=False),  # no adapter slots: loading one is refused by name
        sample=numpy_sampler.sample, sample_allowed=numpy_sampler.sample_allowed,
        new_generator=numpy_sampler.new_generator, device=f"cuda:{model.device}" if cuda else "cpu", dtype=dtype,
        threads=threads, attention_backend="paged" if cuda else "onnx", weight_formats=(layers, head),
        weights_source=source,
        weight_cache_entry=None if private is not None else path, load_s=load_s, capabilities=NO_LIMITS)
