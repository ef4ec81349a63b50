"""Torch reference attention over the paged cache: runs on CPU and CUDA, the oracle for kernels.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]``, or
``uint8 [..., head_dim + 4]`` int8 rows with their scales (``ricllm.cache.kv_format``): written
quantized, read dequantized. GQA: query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_format import dequantize_rows, quantize_rows


def store_kv(
    key: torch.Tensor, value: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = True,
) -> None:
    """Write ``key/value: [T, n_kv, d]`` into the cache slots; slots ``< 0`` are padding, skipped.

    ``has_padding=False`` promises there are none and saves a device sync per layer.
    """
    n_kv, row = k_cache.shape[2], k_cache.shape[3]
    if has_padding:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, n_kv, row).index_copy_(0, slot_mapping, _as_rows(key, k_cache.dtype))
    v_cache.view(-1, n_kv, row).index_copy_(0, slot_mapping, _as_rows(value, v_cache.dtype))


def _as_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return quantize_rows(x) if cache_dtype == torch.uint8 else x.to(cache_dtype)


def _as_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the query's type (int8 rows dequantized)."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.uint8 else rows.to(dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int,
              slot_index: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous copy ``[B, max_context_len, n_kv, d]`` of each sequence's paged K or V.

    Positions past a sequence's context read slot 0 of its first block: harmless, they are masked.
    """
    if slot_index is None:
        slot_index = gather_slot_index(block_tables, cache.shape[1], max_context_len)
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, slot_index.reshape(-1))  # faster than [] on CPU
    return flat.view(*slot_index.shape, *cache.shape[2:])


def gather_slot_index(block_tables: torch.Tensor, block_size: int, max_context_len: int) -> torch.Tensor:
    """Flat cache slot of every position ``[B, max_context_len]``, read through the block table."""
    positions = torch.arange(max_context_len, device=block_tables.device)
    blocks = block_tables.long()[:, positions // block_size].clamp_(min=0)  # evicted (-1): masked, read block 0
    return blocks * block_size + positions % block_size


def decode_mask(context_lens: torch.Tensor, max_context_len: int, kv_sinks: torch.Tensor | None = None,
                kv_windows: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1, 1, max_context_len]``: True where a position holds K/V the sequence's query sees."""
    positions = torch.arange(max_context_len, device=context_lens.device)
    mask = positions[None, :] < context_lens[:, None]
    if kv_windows is not None:
        mask &= in_window(positions[None, :], (context_lens - 1)[:, None], kv_sinks[:, None], kv_windows[:, None])
    return mask[:, None, None, :]


def in_window(key: torch.Tensor, query: torch.Tensor, sinks: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Sink + window visibility (``ricllm.kv_window``), broadcast; window 0: every key."""
    return (windows == 0) | (key < sinks) | (key > query - windows)


def _cached_slot_index(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """The gather index is the same for every layer: build it once per step."""
    index = meta.scratch.get("slot_index")
    if index is None:
        index = gather_slot_index(meta.block_tables, block_size, meta.max_context_len)
        meta.scratch["slot_index"] = index
    return index


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_context_len: int | None = None, slot_index: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query [B, n_heads, d] -> [B, n_heads, d]``.

    Softmax accumulates in fp32 (SDPA's CPU and CUDA kernels do); the output has the query's dtype.
    """
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if slot_index is None:
        slot_index = gather_slot_index(block_tables, k_cache.shape[1], max_context_len)
    keys = _as_values(gather_kv(k_cache, block_tables, max_context_len, slot_index), query.dtype).transpose(1, 2)
    values = _as_values(gather_kv(v_cache, block_tables, max_context_len, slot_index), query.dtype).transpose(1, 2)
    if visible is None:
        visible = decode_mask(context_lens, max_context_len)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=visible,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _padded_layout(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of each flat token in a ``[B, max_query_len]`` padded layout, and the mask.

    The mask ``[B, 1, max_q, max_ctx]`` is True where query may see key: key inside the
    sequence's context and not after the query's own position. Padding rows see key 0 so
    softmax stays finite; their outputs are dropped.
    """
    cached = meta.scratch.get("padded_layout")
    if cached is not None:
        return cached
    starts = meta.query_start_loc.to(device).long()
    q_lens = starts[1:] - starts[:-1]
    batch, max_q = q_lens.shape[0], meta.max_query_len
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
    offset_in_seq = torch.arange(int(starts[-1]), device=device) - starts[seq_of_token]
    flat_index = seq_of_token * max_q + offset_in_seq
    ctx = meta.context_lens.to(device).long()
    q_pos = (ctx - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
    k_pos = torch.arange(meta.max_context_len, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])
    if meta.kv_windows is not None:
        sinks, windows = (t.to(device).long()[:, None, None] for t in (meta.kv_sinks, meta.kv_windows))
        mask &= in_window(k_pos[None, None, :], q_pos[:, :, None], sinks, windows)
    is_pad_row = torch.arange(max_q, device=device)[None, :] >= q_lens[:, None]
    mask[:, :, 0] |= is_pad_row
    meta.scratch["padded_layout"] = (flat_index, mask[:, None])
    return flat_index, mask[:, None]


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Any mix of prefill chunks and decode tokens: ``query [T, n_heads, d] -> [T, n_heads, d]``.

    The K/V of this step's tokens must already be in the cache (``store_kv`` first).
    """
    slot_index = _cached_slot_index(meta, k_cache.shape[1])
    if meta.is_decode_only:
        visible = meta.scratch.get("decode_mask")
        if visible is None:
            visible = meta.scratch["decode_mask"] = decode_mask(meta.context_lens, meta.max_context_len,
                                                                meta.kv_sinks, meta.kv_windows)
        return paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      meta.max_context_len, slot_index, visible)
    n_tokens, n_heads, head_dim = query.shape
    flat_index, mask = _padded_layout(meta, query.device)
    batch, max_q = meta.num_seqs, meta.max_query_len
    q = query.new_zeros(batch * max_q, n_heads, head_dim).index_copy_(0, flat_index, query)
    q = q.view(batch, max_q, n_heads, head_dim).transpose(1, 2)
    keys, values = (_as_values(gather_kv(cache, meta.block_tables, meta.max_context_len, slot_index),
                               query.dtype).transpose(1, 2) for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch * max_q, n_heads, head_dim)
    return out.index_select(0, flat_index)
