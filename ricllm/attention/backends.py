"""Attention backends behind one interface: write this step's K/V, then attend over the cache.

``torch`` is the reference and runs anywhere; ``cpu`` is a C kernel (``ricllm.kernels``,
built on first use) that reads K/V in place through the block tables in decode steps and small
prefill steps; large bf16 prefills too where its prefill kernel runs on AMX tiles (faster than
SDPA there, measured), else they keep SDPA while the decodes beside them stay in the C kernel;
``triton`` and ``cuda`` use
the GPU decode kernels for decode-only steps and the reference (SDPA over the gathered cache)
for prefill. The Triton kernels also take int8 caches and sink + window retention; the CUDA
kernel reads exact bf16/fp16/fp32 caches only and leaves windowed steps to the reference.
"""

from __future__ import annotations

import torch

from ricllm.attention import reference
from ricllm.attention.cpu_policy import C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK, c_kernel_attends  # noqa: F401
from ricllm.attention.metadata import AttentionMetadata
from ricllm.errors import ConfigError

BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")


class TorchAttention:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)


class CpuKernelAttention:
    """The reference's ``store_kv``, then the C kernel for decode steps: no gathered copy of the context.

    It also offers the model ``fused_ops``, the C versions of the layers' elementwise steps
    (the fused model then stores K/V itself, fused with RoPE, and calls ``attend``).
    """

    name = "cpu"

    def __init__(self, dtype: torch.dtype, large_prefill_in_c: bool | None = None):
        """``large_prefill_in_c``: attend steps beyond ``c_kernel_attends`` in C too (None: where
        ``prefill_kernel_beats_sdpa``), else split them between SDPA and the C kernel."""
        from ricllm.kernels.cpu_attention import cpu_paged_attention, prefill_kernel_beats_sdpa
        from ricllm.kernels.cpu_fused import CpuFusedOps

        self._attend = cpu_paged_attention
        self.fused_ops = CpuFusedOps(dtype)
        self.large_prefill_in_c = prefill_kernel_beats_sdpa(dtype) if large_prefill_in_c is None else large_prefill_in_c

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V."""
        if meta.kv_windows is not None:  # the paged kernel walks each query's sinks and window, prefill too
            return self._attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                scale, meta.kv_sinks, meta.kv_windows)
        if c_kernel_attends(meta) or self.large_prefill_in_c:
            # the runner builds these int32 and contiguous already: the kernel wrapper passes them as they are
            return self._attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                scale)
        split = meta.scratch.get("decode_prefill_split")
        if split is None:
            split = meta.scratch["decode_prefill_split"] = meta.split_decodes()
        if split is None:  # no decodes beside the prefill: SDPA for all
            return reference.paged_attention(q, k_cache, v_cache, meta, scale)
        (decode_rows, decode_meta), (prefill_rows, prefill_meta) = split
        out = torch.empty_like(q)
        out[decode_rows] = self._attend(q[decode_rows], k_cache, v_cache, decode_meta.block_tables,
                                        decode_meta.query_start_loc, decode_meta.context_lens, scale)
        out[prefill_rows] = reference.paged_attention(q[prefill_rows], k_cache, v_cache, prefill_meta, scale)
        return out


class KernelAttention:
    """GPU kernels for the bandwidth-bound decode; prefill stays on SDPA.

    ``windowed_decode``: ``decode`` takes ``kv_sinks``/``kv_windows`` (the Triton kernel); without
    it, windowed decode steps take the reference, which masks what the kernel would read.
    """

    def __init__(self, name: str, store_kv, decode, windowed_decode: bool = False):
        self.name = name
        self._store_kv = store_kv
        self._decode = decode
        self.windowed_decode = windowed_decode

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        windowed = meta.kv_windows is not None
        if not meta.is_decode_only or (windowed and not self.windowed_decode):
            return reference.paged_attention(q, k_cache, v_cache, meta, scale)
        if windowed:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                meta.max_context_len, kv_sinks=meta.kv_sinks, kv_windows=meta.kv_windows)
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                            meta.max_context_len)


def select_backend(name: str, device: torch.device, cache_dtype: torch.dtype = torch.float32,
                   activation_dtype: torch.dtype | None = None):
    """``auto`` picks Triton on CUDA (when importable), the C kernel on the CPU (when it builds
    and takes the cache dtype), and the torch reference otherwise. ``cache_dtype`` ``uint8`` is an
    int8 cache (rows with their scales: ``ricllm.cache.kv_format``): Triton and the reference read
    it, the CUDA kernel does not; the C kernels too, beside ``activation_dtype`` activations."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "torch":
        return TorchAttention()
    if device.type == "cpu" and name in ("auto", "cpu"):
        return _cpu_backend(name, cache_dtype, activation_dtype or cache_dtype)
    if name == "cpu":
        raise ConfigError(f"attention backend 'cpu' runs on the CPU, but the engine runs on {device}")
    if device.type != "cuda":
        raise ConfigError(f"attention backend {name!r} needs a CUDA device, but the engine runs on {device}")
    if name == "cuda" and cache_dtype == torch.uint8:
        raise ConfigError("attention backend 'cuda' reads bf16/fp16/fp32 caches, not kv_cache_dtype int8; "
                          "use attention_backend triton or torch (both read int8) or kv_cache_dtype auto")
    from ricllm import kernels

    if name in ("auto", "triton"):
        ok, reason = kernels.triton_available()
        if ok:
            return KernelAttention("triton", kernels.store_kv, kernels.paged_decode_attention, windowed_decode=True)
        if name == "triton":
            raise ConfigError(f"attention backend 'triton' is not available: {reason}")
        return TorchAttention()
    from ricllm.kernels import cuda_ext

    return KernelAttention("cuda", kernels.store_kv, cuda_ext.paged_decode_attention)


def _cpu_backend(name: str, cache_dtype: torch.dtype, activation_dtype: torch.dtype):
    from ricllm.kernels.cpu_attention import SUPPORTED_DTYPES, cpu_kernel_available

    if cache_dtype not in SUPPORTED_DTYPES:
        kind = "kv_cache_dtype int8" if cache_dtype == torch.uint8 else str(cache_dtype).removeprefix("torch.")
        reason = f"the CPU kernel takes {' or '.join(_dtype_names(SUPPORTED_DTYPES))} caches, not {kind}"
    else:
        ok, reason = cpu_kernel_available()
        if ok:
            return CpuKernelAttention(activation_dtype)
    if name == "cpu":
        raise ConfigError(f"attention backend 'cpu' is not available: {reason}")
    from ricllm.logging import get_logger  # here: the GPU check imports this module without structlog

    get_logger("ricllm.attention").warning("cpu_attention_kernel_unavailable", reason=reason, fallback="torch")
    return TorchAttention()


def _dtype_names(dtypes) -> list[str]:
    return ["int8 (kv_cache_dtype)" if d == torch.uint8 else str(d).removeprefix("torch.") for d in dtypes]
