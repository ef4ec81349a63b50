"""Triton kernels for the decode step over the paged KV cache.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]``
in fp32/fp16/bf16, or int8 rows (``kv_cache_dtype="int8"``, ``ricllm.cache.kv_format``): raw bytes
``uint8 [num_blocks, block_size, n_kv_heads, head_dim + 4]``, each (token, KV head) row ``head_dim``
int8 values then their fp32 scale ``max|x| / 127`` (little-endian) at byte ``head_dim`` of the row.
GQA: query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``; the ``group`` query heads
of one KV head are computed together so every K/V tile is read once per (sequence, KV head).

Sink + window retention (``ricllm.kv_window``): given ``kv_sinks``/``kv_windows``, the decode
query (at position ``ctx - 1``) sees key ``j`` iff ``j < sinks`` or ``j >= ctx - window`` (window 0:
every key). Keys outside are neither loaded nor their block-table entries used: evicted blocks
have entry -1 and their pool blocks may already belong to another sequence.

Invariants the callers keep (the torch reference in ``ricllm.attention.reference`` keeps them too):

* ``context_lens[i] >= 1`` for every sequence and ``<= max_context_len``;
* ``block_tables[i, j]`` is a valid block id for every ``j < ceil(context_lens[i] / block_size)``
  whose block holds a key the query sees; later entries are never read, evicted ones (-1) never used;
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


INT8_MAX = tl.constexpr(127.0)
SCALE_BYTES = 4  # the fp32 scale after each int8 row


@triton.jit
def _round_half_even(y):
    """``y`` rounded to the nearest integer, ties to even, as ``torch.round`` and C ``lrintf``.

    The interpreter has no ``libdevice.rint``, so: round half up, then step back the ties that
    landed on an odd number. Exact for ``|y| < 2**22`` (here ``|y| <= 127``): ``y + 0.5`` and
    ``r - y`` are then computed without rounding.
    """
    r = tl.floor(y + 0.5)
    odd = r * 0.5 != tl.floor(r * 0.5)
    return tl.where((r - y == 0.5) & odd, r - 1.0, r)


@triton.jit
def _quantize_rows(x):
    """``x [rows, D_PAD]`` -> (int8 values as ``uint8 [rows, D_PAD]``, fp32 scales ``[rows]``).

    ``ricllm.cache.kv_format.quantize_rows`` step for step, so the bytes match it: ``s = max|x| / 127``
    and ``q = round(x * (1 / s))`` in fp32, clamped to +-127; an all-zero row has scale 0 and zeros.
    Padding columns must be 0 (they do not move the max). ``div_rn``: IEEE division like torch's,
    where ``/`` compiles to an approximate divide on NVIDIA GPUs. The launch disables FP fusion:
    an FMA of ``x * inverse + 0.5`` would skip the product's rounding and move some ties.
    """
    x = x.to(tl.float32)
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), INT8_MAX)
    inverse = tl.where(scale > 0.0, tl.div_rn(1.0, tl.where(scale > 0.0, scale, 1.0)), 0.0)  # no 1/0
    q = _round_half_even(x * inverse[:, None])
    q = tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX)
    return q.to(tl.int8).to(tl.uint8, bitcast=True), scale


@triton.jit
def _store_rows(src_ptr, cache_ptr, src_off, row_off, offs_d, row_mask,
                HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):
    """Copy rows ``src[src_off + d]`` to cache rows starting at ``row_off`` (element offsets of the
    cache; bytes when ``QUANTIZED``, then quantized with the scale at byte ``HEAD_DIM``)."""
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + src_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
    row_ptr = cache_ptr + row_off
    if QUANTIZED:
        q, scale = _quantize_rows(x)
        tl.store(row_ptr[:, None] + offs_d[None, :], q, mask=mask)
        tl.store((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=row_mask)
    else:
        tl.store(row_ptr[:, None] + offs_d[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    n_kv,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One program per token: write its ``[n_kv, d]`` K and V rows into cache slot ``slot``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, KV_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = offs_h < n_kv
    row_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h * stride_ch
    _store_rows(key_ptr, k_cache_ptr, token * stride_kt + offs_h * stride_kh, row_off, offs_d, heads,
                HEAD_DIM, QUANTIZED)
    _store_rows(value_ptr, v_cache_ptr, token * stride_vt + offs_h * stride_vh, row_off, offs_d, heads,
                HEAD_DIM, QUANTIZED)


def store_kv(
    key: torch.Tensor, value: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Write ``key/value: [T, n_kv, d]`` into the cache slots; slots ``< 0`` are skipped.

    The last dimension of every tensor must be contiguous; K/V are cast to the cache dtype, or
    quantized into int8 rows with their scales when the cache is ``uint8``.
    """
    n_tokens = key.shape[0]
    if n_tokens == 0:
        return
    head_dim = _check_cache(k_cache, v_cache)
    _, block_size, n_kv, _ = k_cache.shape
    if key.shape[1:] != (n_kv, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cache {tuple(k_cache.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    _store_kv_kernel[(n_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        n_kv,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, KV_PAD=triton.next_power_of_2(n_kv),
        D_PAD=triton.next_power_of_2(head_dim), QUANTIZED=k_cache.dtype == torch.uint8,
        enable_fp_fusion=False,  # int8 rounding as torch's, op by op (``_quantize_rows``)
    )


# --------------------------------------------------------------------------------------------
# paged decode attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(table_row_ptr, pos, visible, kv_off, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr):
    """Cache offsets of the K/V rows of positions ``pos`` (K and V share them).

    Positions not visible (past the context, outside the window) are masked in the block-table
    load, so their entries (unused, or -1 when evicted) never become an address: they get block 0,
    and every load through them is masked too.
    """
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
    return block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_off


@triton.jit
def _load_rows(cache_ptr, row_off, visible, offs_d, HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):
    """``[TILE, D_PAD]`` rows at ``row_off``, zeros where not ``visible``; int8 rows as their integer
    values in fp32, without their scales (``_load_scales``)."""
    mask = visible[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = tl.load(cache_ptr + row_off[:, None] + offs_d[None, :], mask=mask, other=0)
    if QUANTIZED:
        rows = rows.to(tl.int8, bitcast=True).to(tl.float32)
    return rows


@triton.jit
def _load_scales(cache_ptr, row_off, visible, HEAD_DIM: tl.constexpr):
    """``[TILE]`` fp32 scales of int8 rows: the 4 bytes after each row's values; 0 where not visible."""
    return tl.load((cache_ptr + row_off + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=visible, other=0.0)


@triton.jit
def _live_tiles(ctx_len, sinks_ptr, windows_ptr, seq, n_tiles, TILE: tl.constexpr, WINDOWED: tl.constexpr):
    """``(n_sink, window_lo, first_window_key, sinks)`` of sequence ``seq``'s decode query.

    The tiles holding a visible key are ``[0, n_sink)`` (the sinks) and ``[window_lo, n_tiles)``
    (the window, ``window_lo >= n_sink``); every one of them holds at least one visible key, so
    no tile's softmax row is all ``-inf``. Exact sequences (not ``WINDOWED``, or window 0) have
    ``window_lo == n_sink``: every tile is live.
    """
    if WINDOWED:
        sinks = tl.load(sinks_ptr + seq)
        window = tl.load(windows_ptr + seq)
        first_window_key = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
        n_sink = tl.minimum(tl.cdiv(sinks, TILE), n_tiles)
        window_lo = tl.maximum(first_window_key // TILE, n_sink)
    else:
        sinks = 0
        first_window_key = 0
        n_sink = n_tiles
        window_lo = n_tiles
    return n_sink, window_lo, first_window_key, sinks


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, sinks_ptr, windows_ptr, out_ptr, lse_ptr,
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
    QUANTIZED: tl.constexpr, WINDOWED: tl.constexpr,
):
    """Program ``(seq, kv_head, split)``: online softmax of the group's queries over one split.

    The sequence's live tiles (``_live_tiles``: all ``ceil(ctx / TILE)`` of them unless windowed)
    are cut into ``num_programs(2)`` equal runs; this program walks its run. With ``SPLIT`` it
    writes the normalised partial output ``out[seq, head, split, :]`` (fp32) and the base-2
    log-sum-exp ``lse[seq, head, split]`` (``-inf`` for an empty run); without it, the final
    output in ``out``'s dtype. ``qk_scale`` is ``scale * log2(e)``: scores live in the base-2
    domain. Dots run in fp32 (``FP32_DOT``) or in the query's half type (the cache's when exact).
    Int8 rows enter the dots as their integer values; their scales multiply the scores (K) and
    the probabilities (V) instead, which keeps the tile loop's register use near the exact path's.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    ctx_len = tl.load(ctx_ptr + seq)
    n_tiles = tl.cdiv(ctx_len, TILE)
    n_sink, window_lo, first_window_key, sinks = _live_tiles(ctx_len, sinks_ptr, windows_ptr, seq, n_tiles,
                                                              TILE, WINDOWED)
    # a windowed sequence's work is its live tiles, not its context: splits share those
    n_live = n_sink + n_tiles - window_lo
    tiles_per_split = tl.cdiv(n_live, num_splits)
    live_lo = split * tiles_per_split
    live_hi = tl.minimum(live_lo + tiles_per_split, n_live)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * group + offs_g
    q_mask = (offs_g[:, None] < group) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    elif not QUANTIZED:
        q = q.to(k_cache_ptr.dtype.element_ty)

    table_row_ptr = table_ptr + seq * stride_tb
    kv_off = kv_head.to(tl.int64) * stride_ch
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)

    for live in tl.range(live_lo, live_hi, num_stages=NUM_STAGES):
        if WINDOWED:  # live index -> tile: the sink tiles, then the window's
            tile = tl.where(live < n_sink, live, live - n_sink + window_lo)
        else:
            tile = live
        pos = tile * TILE + offs_t
        visible = pos < ctx_len
        if WINDOWED:
            visible = visible & ((pos < sinks) | (pos >= first_window_key))
        # K and V compute their offsets each: sharing them costs registers across the K dot
        k = _load_rows(k_cache_ptr, _row_offsets(table_row_ptr, pos, visible, kv_off, stride_cb, stride_cs,
                                                 BLOCK_SIZE), visible, offs_d, HEAD_DIM, QUANTIZED)
        v = _load_rows(v_cache_ptr, _row_offsets(table_row_ptr, pos, visible, kv_off, stride_cb, stride_cs,
                                                 BLOCK_SIZE), visible, offs_d, HEAD_DIM, QUANTIZED)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # int8 values are exact in fp16/bf16
            scores = tl.dot(q, tl.trans(k.to(q.dtype)))
        if QUANTIZED:  # q . (s_j k_j) = s_j (q . k_j): a [group, TILE] product, not a [TILE, d] one
            k_off = _row_offsets(table_row_ptr, pos, visible, kv_off, stride_cb, stride_cs, BLOCK_SIZE)
            scores = scores * (_load_scales(k_cache_ptr, k_off, visible, HEAD_DIM) * qk_scale)[None, :]
        else:
            scores = scores * qk_scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANTIZED:  # sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j
            v_off = _row_offsets(table_row_ptr, pos, visible, kv_off, stride_cb, stride_cs, BLOCK_SIZE)
            p = p * _load_scales(v_cache_ptr, v_off, visible, HEAD_DIM)[None, :]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
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
    kv_sinks: torch.Tensor | None = None, kv_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query [B, n_heads, d] -> [B, n_heads, d]`` (query dtype).

    Softmax in fp32 whatever the cache dtype. ``num_splits`` (default: ``choose_num_splits``)
    cuts each context into that many runs reduced by a second kernel; 1 is the one-pass path.
    ``max_context_len`` only feeds the heuristic; ``None`` reads it off ``context_lens`` (a host
    sync). Given either one, the call never syncs and can be captured in a CUDA graph.
    ``kv_sinks``/``kv_windows``: ``[B]`` int32, both or neither: each query sees only its sinks
    and window (window 0: every key); keys outside them are not read.
    """
    head_dim = _check_cache(k_cache, v_cache)
    batch, n_heads, query_dim = query.shape
    n_kv = k_cache.shape[2]
    if query_dim != head_dim or n_heads % n_kv:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if (kv_sinks is None) != (kv_windows is None):
        raise ValueError("kv_sinks and kv_windows go together: give both or neither")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    windows = None if kv_windows is None else (kv_sinks.to(torch.int32).contiguous(),
                                               kv_windows.to(torch.int32).contiguous())
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        # windowed sequences do less work than their context says: the heuristic may over-split,
        # which only leaves some splits empty
        num_splits = choose_num_splits(batch, n_kv, max_context_len, query.device)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits == 1:
        _launch_decode(query, k_cache, v_cache, block_tables, context_lens, windows, scale,
                       out, None, 1, config)
        return out
    partial = torch.empty(batch, n_heads, num_splits, head_dim, device=query.device,
                          dtype=torch.float32)
    lse = torch.empty(batch, n_heads, num_splits, device=query.device, dtype=torch.float32)
    _launch_decode(query, k_cache, v_cache, block_tables, context_lens, windows, scale,
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
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    windows: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
    out: torch.Tensor, lse: torch.Tensor | None, num_splits: int, config: DecodeConfig,
) -> None:
    """Launch ``_decode_kernel`` on grid ``(B, n_kv, num_splits)``; ``lse`` set iff split,
    ``windows`` (sinks, windows) iff some sequence is windowed."""
    batch, n_heads, head_dim = query.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    tile = block_size * max(1, config.tile_tokens // block_size)
    split = lse is not None
    sinks, window_sizes = windows if windows is not None else (context_lens, context_lens)  # unread if exact
    _decode_kernel[(batch, n_kv, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, sinks, window_sizes, out, lse if split else out,
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
        QUANTIZED=k_cache.dtype == torch.uint8, WINDOWED=windows is not None,
        num_warps=config.num_warps,
    )


def _needs_fp32_dot(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """fp32 (IEEE) dots for fp32 caches, and when the query's dtype differs from the cache's.

    Int8 rows: fp32 dots for an fp32 query; tensor cores for fp16/bf16 ones, whose type holds the
    int8 values exactly (the scales are applied in fp32 outside the dots).
    """
    if cache_dtype == torch.uint8:
        return query_dtype == torch.float32
    return cache_dtype == torch.float32 or query_dtype != cache_dtype


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Both caches share one shape/strides and have a contiguous row; returns the head dim.

    A ``uint8`` cache holds int8 rows of ``head_dim + 4`` bytes; ``head_dim`` must be a multiple
    of 4 so that every row's fp32 scale is 4-byte aligned (the kernels load it as one fp32).
    """
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1:
        raise ValueError("caches must be [num_blocks, block_size, n_kv, head_dim], last dim contiguous")
    if k_cache.dtype == torch.uint8:
        head_dim = k_cache.shape[-1] - SCALE_BYTES
        if head_dim <= 0 or head_dim % 4 or k_cache.data_ptr() % 4 or v_cache.data_ptr() % 4:
            raise ValueError(f"an int8 cache needs rows of head_dim + 4 bytes with head_dim a multiple of 4 and "
                             f"4-byte aligned storage, got shape {tuple(k_cache.shape)}")
        return head_dim
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    return k_cache.shape[-1]


__all__ = ["DecodeConfig", "DEFAULT_CONFIG", "choose_num_splits", "paged_decode_attention",
           "store_kv"]
