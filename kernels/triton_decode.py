"""Triton kernels for the decode step over the paged KV cache.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]``.
GQA: query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``; the ``group`` query heads
of one KV head are computed together so every K/V tile is read once per (sequence, KV head).

Invariants the callers keep (the torch reference in ``ricllm.attention.reference`` keeps them too):

* ``context_lens[i] >= 1`` for every sequence and ``<= max_context_len``;
* ``block_tables[i, j]`` is a valid block id for every ``j < ceil(context_lens[i] / block_size)``;
  later entries are never read;
* ``slot_mapping`` entries are ``block * block_size + offset`` or ``-1`` (padding, skipped).

Cache offsets are computed in int64: ``block_id * stride`` overflows int32 on large pools.
Importing this module needs triton; ``ricllm.kernels`` imports it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .splits import choose_num_splits

LOG2E = 1.4426950408889634
# The query group is padded to at least this many rows: tl.dot needs M >= 16.
MIN_DOT_ROWS = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel.

    tile_tokens: keys per loop iteration; rounded to a multiple of the cache block size.
    num_warps / num_stages: Triton launch options (stages = software-pipelining depth).
    """

    tile_tokens: int = 32
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = DecodeConfig()


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    n_kv,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per token: copy its ``[n_kv, d]`` K and V rows into cache slot ``slot``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, KV_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    mask = (offs_h < n_kv) & (offs_d < HEAD_DIM)
    block = slot // BLOCK_SIZE
    cache_off = block * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h * stride_ch + offs_d
    key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(k_cache_ptr + cache_off, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value: [T, n_kv, d]`` into the cache slots; slots ``< 0`` are skipped.

    The last dimension of every tensor must be contiguous; K/V are cast to the cache dtype.
    """
    n_tokens = key.shape[0]
    if n_tokens == 0:
        return
    _check_cache(k_cache, v_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    _, block_size, n_kv, head_dim = k_cache.shape
    _store_kv_kernel[(n_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        n_kv,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, KV_PAD=triton.next_power_of_2(n_kv),
        D_PAD=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------------
# paged decode attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(
    cache_ptr, table_row_ptr, tile_start, ctx_len, kv_off,
    stride_cb, stride_cs, offs_t, offs_d,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """``[TILE, D_PAD]`` K or V rows of positions ``tile_start + offs_t``, zeros past the context.

    Positions past ``ctx_len`` are masked, so their block-table entries are never read.
    """
    pos = tile_start + offs_t
    valid = pos < ctx_len
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_off
    mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    return tl.load(cache_ptr + row_off[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, out_ptr, lse_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    group,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr,
    SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program ``(seq, kv_head, split)``: online softmax of the group's queries over one split.

    The sequence's tiles ``0 .. ceil(ctx / TILE)`` are cut into ``num_programs(2)`` equal runs;
    this program walks its run. With ``SPLIT`` it writes the normalised partial output
    ``out[seq, head, split, :]`` (fp32) and the base-2 log-sum-exp ``lse[seq, head, split]``
    (``-inf`` for an empty run); without it, the final output in ``out``'s dtype.
    ``qk_scale`` is ``scale * log2(e)``: scores live in the base-2 domain.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    ctx_len = tl.load(ctx_ptr + seq)
    n_tiles = tl.cdiv(ctx_len, TILE)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * group + offs_g
    q_mask = (offs_g[:, None] < group) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    table_row_ptr = table_ptr + seq * stride_tb
    kv_off = kv_head.to(tl.int64) * stride_ch
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)

    for tile in tl.range(tile_lo, tile_hi, num_stages=NUM_STAGES):
        tile_start = tile * TILE
        k = _load_tile(k_cache_ptr, table_row_ptr, tile_start, ctx_len, kv_off,
                       stride_cb, stride_cs, offs_t, offs_d, BLOCK_SIZE, HEAD_DIM)
        v = _load_tile(v_cache_ptr, table_row_ptr, tile_start, ctx_len, kv_off,
                       stride_cb, stride_cs, offs_t, offs_d, BLOCK_SIZE, HEAD_DIM)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * qk_scale
        scores = tl.where((tile_start + offs_t)[None, :] < ctx_len, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        tl.store(out_ptrs + split * stride_os, out, mask=q_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=offs_g < group)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """Program ``(seq, head)``: weight each split's partial output by ``2**lse`` and normalise.

    Split 0 is never empty (``ctx >= 1``), so the maximum lse is finite.
    """
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s,
                  mask=offs_s < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    mask = (offs_s[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
    part = tl.load(part_ptr + seq * stride_pb + head * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(part * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_context_len: int | None = None, num_splits: int | None = None,
    config: DecodeConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """One query token per sequence: ``query [B, n_heads, d] -> [B, n_heads, d]`` (query dtype).

    Softmax in fp32 whatever the cache dtype. ``num_splits`` (default: ``choose_num_splits``)
    cuts each context into that many runs reduced by a second kernel; 1 is the one-pass path.
    ``max_context_len`` only feeds the heuristic; ``None`` reads it off ``context_lens`` (a host
    sync). Given either one, the call never syncs and can be captured in a CUDA graph.
    """
    _check_cache(k_cache, v_cache)
    batch, n_heads, head_dim = query.shape
    _, block_size, n_kv, cache_dim = k_cache.shape
    if cache_dim != head_dim or n_heads % n_kv:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_num_splits(batch, n_kv, max_context_len, query.device)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits == 1:
        _launch_decode(query, k_cache, v_cache, block_tables, context_lens, scale,
                       out, None, 1, config)
        return out
    partial = torch.empty(batch, n_heads, num_splits, head_dim, device=query.device,
                          dtype=torch.float32)
    lse = torch.empty(batch, n_heads, num_splits, device=query.device, dtype=torch.float32)
    _launch_decode(query, k_cache, v_cache, block_tables, context_lens, scale,
                   partial, lse, num_splits, config)
    _merge_splits_kernel[(batch, n_heads)](
        partial, lse, out,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, S_PAD=triton.next_power_of_2(num_splits),
        D_PAD=triton.next_power_of_2(head_dim),
    )
    return out


def _launch_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    out: torch.Tensor, lse: torch.Tensor | None, num_splits: int, config: DecodeConfig,
) -> None:
    """Launch ``_decode_kernel`` on grid ``(B, n_kv, num_splits)``; ``lse`` set iff split."""
    batch, n_heads, head_dim = query.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    tile = block_size * max(1, config.tile_tokens // block_size)
    split = lse is not None
    _decode_kernel[(batch, n_kv, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, lse if split else out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2) if split else 0,
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        group,
        BLOCK_SIZE=block_size, TILE=tile, HEAD_DIM=head_dim,
        GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLIT=split, FP32_DOT=_needs_fp32_dot(query.dtype, k_cache.dtype),
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )


def _needs_fp32_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """fp32 (IEEE) dots for fp32 caches, and when the query's dtype differs from the cache's."""
    return cache_dtype == torch.float32 or query_dtype != cache_dtype


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches share one shape/strides and have a contiguous head dimension."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1:
        raise ValueError("caches must be [num_blocks, block_size, n_kv, head_dim], last dim contiguous")
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")


__all__ = ["DecodeConfig", "DEFAULT_CONFIG", "choose_num_splits", "paged_decode_attention",
           "store_kv"]
