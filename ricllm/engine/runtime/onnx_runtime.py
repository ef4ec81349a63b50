"""The ONNX runtime: the model as one ONNX Runtime session over ricllm's paged KV pool, no torch in the process.

The graph is written once from the GGUF (``onnx_export``) and cached like the native weights; the
engine above keeps its scheduler, paged pool and block tables, prefix caching and constrained
decoding. This module builds the runtime: the thread count, the graph, the session and the fp32
pool (``onnx_model``: one step is one ``session.run``).

The pool is fp32 (ONNX Runtime's CPU kernels compute in fp32); int8 and windowed KV caches and LoRA
adapters (the runtime has no adapter slots, so loading one is refused by name) are not served here
yet. Gemma 3's hybrid pool (a block table per cache group) is served: each layer reads and writes
its slot through its group's tables (``onnx_model.view_step_inputs``). ONNX Runtime's threads follow
the engine's ``threads`` (``engine_cpus`` pins the process before the session starts its pool, so
its workers inherit the CPUs), and its workers do not spin between runs
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
from ricllm.engine.runtime.onnx_model import OnnxKVCache, OnnxModel, OnnxModelRunner
from ricllm.errors import ConfigError
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer


def onnx_unsupported_reason(config: EngineConfig) -> str | None:
    """Why the ONNX runtime cannot serve this configuration (None: it can)."""
    if config.device not in ("auto", "cpu"):
        return f"device {config.device!r}: the ONNX runtime runs on ONNX Runtime's CPU provider here"
    if config.dtype not in ("auto", "float32", "fp32"):
        return f"dtype {config.dtype!r}: the ONNX runtime computes in float32"
    if config.weights != "auto":
        return f"weights {config.weights!r}: the ONNX graph keeps the file's own formats (weights auto)"
    if config.kv_cache_dtype != "auto":
        return f"kv_cache_dtype {config.kv_cache_dtype!r}: the ONNX runtime keeps an fp32 KV pool"
    if config.attention_backend not in ("auto", "cpu"):
        return f"attention backend {config.attention_backend!r}: the ONNX runtime attends in its graph"
    return None


def build_onnx_runtime(config: EngineConfig, model_path: Path) -> Runtime:
    reason = onnx_unsupported_reason(config)
    if reason is not None:
        raise ConfigError(f"runtime 'onnx' cannot serve this configuration: {reason}")
    started = time.perf_counter()
    threads = default_threads(config)
    private = None if config.weight_cache else Path(tempfile.mkdtemp(prefix="ricllm-onnx-"))
    try:
        path, meta, source = load_or_export(model_path, config.weight_cache, private)
        spec = ModelSpec.from_dict(meta["spec"])
        model = OnnxModel(path, spec, threads)
    except OnnxExportUnsupported as exc:
        raise ConfigError(f"runtime 'onnx' cannot serve this model: {exc}") from exc
    finally:
        if private is not None:  # the session holds what it needs of the file
            shutil.rmtree(private, ignore_errors=True)
    load_s = time.perf_counter() - started
    geometry = plan_cache(spec, config.kv_cache_budget, config.block_size, kv_format("auto", "float32"))
    kv_cache = OnnxKVCache(spec, geometry)
    layers, head = meta["weight_formats"]
    return Runtime(
        name="onnx", why="runtime 'onnx' was asked for", spec=spec, tokenizer=Tokenizer.from_state(meta["tokenizer"]),
        model=model, kv_cache=kv_cache, runner=OnnxModelRunner(model, kv_cache),
        lora=LoraSlots(spec, 0, bf16=False),  # no adapter slots: loading one is refused by name
        sample=numpy_sampler.sample, sample_allowed=numpy_sampler.sample_allowed,
        new_generator=numpy_sampler.new_generator, device="cpu", dtype="float32",
        threads=threads, attention_backend="onnx", weight_formats=(layers, head), weights_source=source,
        weight_cache_entry=None if private is not None else path, load_s=load_s, capabilities=NO_LIMITS)
