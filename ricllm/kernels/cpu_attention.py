"""The CPU attention kernels (``kernels/cpu_paged_attention.c``, ``kernels/cpu_prefill_attention.c``; built by
``cpu_library``)."""

from __future__ import annotations

import torch
from ricllm.kernels.cpu_fused import CACHE_TYPES
from ricllm.kernels.cpu_library import cpu_kernels_available, library
from ricllm.kernels.decoder_stack_call import INT8_ROW_EXTRA

SUPPORTED_DTYPES = CACHE_TYPES  # the caches the kernels read, by dtype -> kernels/cpu_common.h's code


def cpu_kernel_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the CPU kernels build and load here."""
    return cpu_kernels_available()


def prefill_kernel_beats_sdpa(dtype: torch.dtype) -> bool:
    """Whether a large bf16 prefill attends faster in the C kernel than in SDPA here: where its
    products run in AMX tiles (measured by ``benchmarks/bench_prefill_attention.py``: 1.9-3.7×
    SDPA as the torch runtime calls it, 512-2048 tokens). Its AVX-512 vector products, and fp32
    caches (the paged kernel), are slower than SDPA on long prompts."""
    return dtype == torch.bfloat16 and bool(library().ricllm_prefill_attention_uses_amx())


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu":
        return t  # the common case, checked without dispatching a copy
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def cpu_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, kv_sinks: torch.Tensor | None = None,
                        kv_windows: torch.Tensor | None = None) -> torch.Tensor:
    """``query [T, n_heads, d] -> [T, n_heads, d]``; each query attends causally within its
    sequence, reading K/V in place through the block table (same contract as
    ``reference.paged_attention``: this step's K/V already stored). The C side picks the kernel
    (``ricllm_attention``): the blocked prefill kernel for steps with a long enough prompt chunk
    in bf16, else the decode-shaped paged kernel. The cache may hold int8 rows (``uint8 [..., d + 4]``);
    ``kv_sinks``/``kv_windows`` (int32 per sequence) give sink + window retention: the paged kernel
    then attends the whole step, reading only the keys each query sees."""
    return _attend("ricllm_attention", query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                   kv_sinks, kv_windows)


def cpu_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``cpu_paged_attention``'s contract, always in the blocked prefill kernel
    (``kernels/cpu_prefill_attention.c``): bf16 products where the CPU has AVX-512 BF16, else fp32."""
    return _attend("ricllm_prefill_attention", query, k_cache, v_cache, block_tables, query_start_loc,
                   context_lens, scale)


def _attend(entry: str, query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
            kv_sinks=None, kv_windows=None) -> torch.Tensor:
    if k_cache.dtype not in SUPPORTED_DTYPES or k_cache.device.type != "cpu":
        raise ValueError(f"the CPU attention kernel takes bf16, fp32 or int8 (uint8 rows) caches on the CPU, got "
                         f"{k_cache.dtype} on {k_cache.device}")
    tables, starts, lens = _int32(block_tables), _int32(query_start_loc), _int32(context_lens)
    # activations in the cache's type, or, beside int8 rows, bf16 or fp32 as they come
    act = k_cache.dtype if k_cache.dtype != torch.uint8 else query.dtype if query.dtype == torch.float32 \
        else torch.bfloat16
    q = query if query.dtype == act and query.is_contiguous() else query.to(act).contiguous()
    out = torch.empty_like(q)
    _, block_size, n_kv, row = k_cache.shape
    head_dim = row - INT8_ROW_EXTRA if k_cache.dtype == torch.uint8 else row
    sinks, windows = (None, None) if kv_windows is None else (_int32(kv_sinks), _int32(kv_windows))
    code = getattr(library(), entry)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), lens.shape[0], q.shape[1], n_kv, head_dim, block_size,
        tables.shape[1], scale, int(act == torch.bfloat16), SUPPORTED_DTYPES[k_cache.dtype],
        None if sinks is None else sinks.data_ptr(), None if windows is None else windows.data_ptr(),
        torch.get_num_threads())
    if code != 0:
        raise ValueError(f"the CPU attention kernel does not take {q.shape[1]} heads over {n_kv} KV heads "
                         f"of dim {head_dim} (at most 8 query heads per KV head, head_dim <= 256)"
                         + (" or a KV window (the prefill kernel)" if windows is not None else ""))
    return out if out.dtype == query.dtype else out.to(query.dtype)
