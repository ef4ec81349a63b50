"""Torch reference attention over the paged cache: runs on CPU and CUDA, the oracle for kernels.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]``.
GQA: query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ricllm.attention.metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor, value: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value: [T, n_kv, d]`` into the cache slots; slots ``< 0`` are padding, skipped."""
    n_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Contiguous copy ``[B, max_context_len, n_kv, d]`` of each sequence's paged K or V."""
    block_size = cache.shape[1]
    num_blocks = -(-max_context_len // block_size)
    gathered = cache[block_tables[:, :num_blocks].long()]  # [B, nb, bs, n_kv, d]
    batch = block_tables.shape[0]
    return gathered.reshape(batch, num_blocks * block_size, *cache.shape[2:])[:, :max_context_len]


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query [B, n_heads, d] -> [B, n_heads, d]``.

    Softmax in fp32 whatever the cache dtype; the output has the query's dtype.
    """
    batch, n_heads, head_dim = query.shape
    n_kv = k_cache.shape[2]
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    keys = gather_kv(k_cache, block_tables, max_context_len).float()
    values = gather_kv(v_cache, block_tables, max_context_len).float()
    q = query.float().view(batch, n_kv, n_heads // n_kv, head_dim)
    scores = torch.einsum("bkgd,btkd->bkgt", q, keys) * scale
    positions = torch.arange(max_context_len, device=query.device)
    visible = positions[None, :] < context_lens[:, None].to(positions.device)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)
    return out.reshape(batch, n_heads, head_dim).to(query.dtype)


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
    if meta.is_decode_only:
        return paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len)
    n_tokens, n_heads, head_dim = query.shape
    flat_index, mask = _padded_layout(meta, query.device)
    batch, max_q = meta.num_seqs, meta.max_query_len
    q = query.new_zeros(batch * max_q, n_heads, head_dim).index_copy_(0, flat_index, query)
    q = q.view(batch, max_q, n_heads, head_dim).transpose(1, 2)
    keys = gather_kv(k_cache, meta.block_tables, meta.max_context_len).to(query.dtype).transpose(1, 2)
    values = gather_kv(v_cache, meta.block_tables, meta.max_context_len).to(query.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch * max_q, n_heads, head_dim)
    return out.index_select(0, flat_index)
