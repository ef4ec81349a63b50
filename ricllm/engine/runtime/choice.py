"""Which runtime executes the model: ``torch`` (the torch model, any device, every format),
``native`` (numpy and ricllm's C kernels: no torch in the process) or ``onnx`` (the model as an ONNX
graph in ONNX Runtime, no torch either; only when asked for), and why.

A process that imports torch holds about 230 MB before any model: its libraries and ~770
modules. On a RIC node whose memory other xApps share that is most of the serving footprint of
a 135M model, so where the C decoder stack serves the model whole (CPU, bf16 activations,
every projection and the head packed in ricllm's layout) ``auto`` runs it without torch. The
engine above sees one interface: a ``Runtime`` (``interface``). Each runtime module is imported
only once chosen, so the native one never loads torch.
"""

from __future__ import annotations

import glob
from pathlib import Path

from ricllm.config import EngineConfig
from ricllm.engine.runtime.interface import Runtime
from ricllm.errors import ConfigError

NATIVE_ARCHITECTURES = ("llama", "mistral", "gemma3")  # its C decoder stacks: Llama's and Gemma 3's


def native_unsupported_reason(config: EngineConfig, model_path: Path) -> str | None:
    """Why the native runtime cannot serve this configuration (None: it can), from the
    configuration and, for ``weights="auto"`` without converted weights yet, the file's header.
    A converted model can still turn out unsupported (a shape that does not tile): the
    conversion says so then."""
    from ricllm.kernels.cpu_library import quant_gemm_available
    from ricllm.model.loader import read_architecture

    if config.device not in ("auto", "cpu"):
        return f"device {config.device!r}: the native runtime runs on the CPU"
    if config.device == "auto" and glob.glob("/dev/nvidia[0-9]*"):
        return "device auto on a machine with an NVIDIA GPU: the torch runtime may use it"
    if config.dtype not in ("auto", "bfloat16", "bf16"):
        return f"dtype {config.dtype!r}: the native runtime computes in bfloat16"
    if config.attention_backend not in ("auto", "cpu"):
        return f"attention backend {config.attention_backend!r}: the native runtime attends in its C kernel"
    if config.max_packed_rows is not None:
        return "max_packed_rows keeps a dense bf16 copy, which only the torch runtime multiplies"
    architecture = read_architecture(model_path)
    if architecture is not None and architecture not in NATIVE_ARCHITECTURES:
        return f"architecture {architecture!r}: the native runtime runs Llama-family models and Gemma 3 only"
    if not (quant_gemm_available(4) and quant_gemm_available(8)):
        return "ricllm's packed-weight kernels do not run here (they need a C compiler and an x86-64-v3 CPU: AVX2, FMA, F16C)"
    return _dense_weights_reason(config, model_path)


def _dense_weights_reason(config: EngineConfig, model_path: Path) -> str | None:
    """Whether ``weights`` leaves something dense. ``int4``/``int8`` pack everything; ``auto``
    follows the file, whose header (its tokenizer arrays: about a second for SmolLM2) is read
    only when no converted weights say it already."""
    from ricllm.model.formats import resolve_formats
    from ricllm.model.loader import read_tensor_types

    if config.weights == "auto" and config.weight_cache:
        from ricllm.engine.runtime.native_convert import entry_path

        entry = entry_path(model_path, config.weights)
        if entry.is_file() or entry.with_suffix(".unsupported").is_file():
            return None  # converted before (or refused: loading says why)
    layers, head = resolve_formats(config.weights, read_tensor_types(model_path) if config.weights == "auto" else {},
                                   packable=True)
    if "dense" in (layers, head):
        return f"weights {config.weights!r} leave the {'layers' if layers == 'dense' else 'LM head'} dense for this file"
    return None


def build_runtime(config: EngineConfig, model_path: Path) -> Runtime:
    """The runtime ``config.runtime`` asks for; ``auto``: native where it can serve, else torch
    (``onnx`` only when asked for)."""
    if config.runtime == "onnx":
        from ricllm.engine.runtime.onnx_runtime import build_onnx_runtime

        return build_onnx_runtime(config, model_path)
    reason = None if config.runtime == "torch" else native_unsupported_reason(config, model_path)
    if config.runtime == "native" and reason is not None:
        raise ConfigError(f"runtime 'native' cannot serve this configuration: {reason}")
    if config.runtime == "torch":
        reason = "runtime 'torch' was asked for"
    if reason is None:
        from ricllm.engine.runtime.native_convert import NativeUnsupported
        from ricllm.engine.runtime.native_runtime import build_native_runtime

        try:
            return build_native_runtime(config, model_path)
        except NativeUnsupported as exc:
            if config.runtime == "native":
                raise ConfigError(f"runtime 'native' cannot serve this model: {exc}") from exc
            reason = str(exc)
    from ricllm.engine.runtime.torch_runtime import build_torch_runtime

    return build_torch_runtime(config, model_path, why=reason)
