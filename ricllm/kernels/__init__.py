"""ricllm's compute kernels: C kernels for the CPU and decode kernels for GPUs. This package is
their Python side; the C and CUDA sources are the repository's top-level ``kernels/`` folder
(``ricllm/kernels/csrc`` in the wheel; ``ricllm.paths.shipped_folder`` finds either).

- CPU (``kernels/cpu_*.c``, built on first use into one shared library by ``cpu_library``): paged
  attention (``cpu_attention``), fused layer steps (``cpu_fused``), int4/int8 weight products
  (``cpu_quant``), the whole decoder stack in one call (``cpu_decoder``, its argument block in
  ``decoder_stack_call``, which the torch-free native runtime uses too) and LoRA updates for rows
  grouped by adapter (``cpu_lora``, numpy only).
- GPU: paged decode attention and the K/V store in Triton (``triton_decode``, exposed below) and
  as a CUDA extension (``cuda_ext``), with the split-K choice they share (``splits``).

Importing this package needs neither triton nor a GPU nor torch: the Triton module is imported
on the first kernel call, and ``triton_available()`` says beforehand whether that can work.
The GPU functions match ``ricllm.attention.reference`` (same arguments, same results up to
rounding); see ``triton_decode`` for the invariants on block tables and context lengths.
On CPU tensors they run only under the Triton interpreter (``TRITON_INTERPRET=1``, set
before triton is imported), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a kernel runs: the torch-free runtime imports this package
    import torch


def triton_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the Triton kernels can run here, and why (not).

    The reason is never empty: it names the backend when ``ok`` and the missing piece when not.
    """
    try:
        triton = importlib.import_module("triton")
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return False, f"triton is not importable: {exc}"
    version = getattr(triton, "__version__", "?")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, f"triton {version} in interpreter mode (TRITON_INTERPRET=1)"
    import torch

    if torch.cuda.is_available():
        return True, f"triton {version} on {torch.cuda.get_device_name()}"
    return False, f"triton {version} is installed but there is no CUDA device and TRITON_INTERPRET is not 1"


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType:
    """The ``triton_decode`` module, imported on first use (then cached: the decode step calls
    this once per layer); a ``RuntimeError`` with the reason when Triton cannot run here."""
    ok, reason = triton_available()
    if not ok:
        raise RuntimeError(f"Triton kernels unavailable: {reason}")
    return importlib.import_module(f"{__name__}.triton_decode")


def store_kv(
    key: torch.Tensor, value: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value: [T, n_kv, d]`` into cache slots ``slot_mapping`` (int64, ``-1`` = skip);
    a ``uint8`` cache gets int8 rows with their scales (``ricllm.cache.kv_format``)."""
    _triton_module().store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_context_len: int | None = None, num_splits: int | None = None,
    kv_sinks: torch.Tensor | None = None, kv_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query [B, n_heads, d] -> [B, n_heads, d]`` (query dtype).

    ``num_splits``: context splits (split-K); ``None`` picks by batch size and SM count, 1 is
    the one-pass kernel. ``kv_sinks``/``kv_windows`` (``[B]`` int32, both or neither): sink +
    window retention, keys outside a query's sinks and window are neither seen nor read.
    """
    return _triton_module().paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale,
        max_context_len=max_context_len, num_splits=num_splits, kv_sinks=kv_sinks, kv_windows=kv_windows)


__all__ = ["paged_decode_attention", "store_kv", "triton_available"]
