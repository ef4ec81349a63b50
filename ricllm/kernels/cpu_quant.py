"""Weight-only int4/int8 products on AVX-512, AMX or AVX2 (``kernels/cpu_quant_gemm.c``, one library per
kernel family: ``cpu_library``): pack, then multiply. The layouts and results are the same in every family.

The layouts are the kernel's own (see the C file): N in tiles of 16 rows, K in groups of 32,
fp16 scales per (row, group); 4-bit weights as 16 pairs of k per (tile, group), 8-bit ones as
8 blocks of 4 k. ``pack_int4`` takes Q4_1's form ``w = d·q + c``, c the group's minimum and d
the step of the grid the group's values lie on (``grid_levels``): a Q4_1 source is recovered
exactly (its d and c are fp16 already), a Q4_K one up to the fp16 rounding of its sub-block's
step and offset (each a 6-bit multiple of an fp16 scale); ``pack_int8`` takes Q8_0's form
``w = d·q`` per group of 32. 8-bit products quantize the activations to int8
per group of 32 inside the kernel, as llama.cpp does for the same products (AVX-512 VNNI, or
AVX2's maddubs, bit for bit the same); so do 4-bit ones on VNNI (every row count without AMX,
1-13 rows with it) and on AVX2 (every row count), while AMX tiles (14+ rows) keep them in bf16
(``cpu_library.int4_path`` says which runs).
"""

from __future__ import annotations

import functools

import torch

from ricllm.kernels.cpu_library import library, quant_gemm_available  # noqa: F401 (re-exported)

IS_BF16 = {torch.bfloat16: 1, torch.float32: 0}  # the element types the kernels take: their is_bf16 flag

GROUP, TILE = 32, 16


def can_pack(weight: torch.Tensor) -> bool:
    rows, cols = weight.shape
    return rows % TILE == 0 and cols % GROUP == 0


def _tiled(q: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[N, K]`` per-weight bytes -> ``[tiles, groups, blocks, 16 rows, 4]``: lane r of a block
    holds 4 consecutive k of row r."""
    rows, cols = q.shape
    return q.view(rows // TILE, TILE, cols // GROUP, blocks, 4).permute(0, 2, 3, 1, 4)


def _tile_scales(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) ``[N, G]`` d and c -> fp16 ``[tiles, groups, 2, 16]``."""
    rows, groups = d.shape
    def tiled(t):
        return t.view(rows // TILE, TILE, groups).permute(0, 2, 1)
    return torch.stack([tiled(d), tiled(c)], dim=2).to(torch.float16).contiguous()


PACK_ROWS = 2048  # rows packed at a time: the fp32 temporaries stay a few MB (a vocabulary-wide head
# whole would need several copies of 113 MB at once on a first start)


def _by_rows(pack_rows):
    """Pack ``[N, K]`` in slices of ``PACK_ROWS`` rows (whole tiles), each converted to fp32 on
    its own. Every output is tile-major, its size proportional to the rows: the first slice sizes
    the whole outputs, and each slice is written into them. (Keeping the slices to concatenate at
    the end would leave them scattered between the freed temporaries, which the heap then keeps.)"""
    @functools.wraps(pack_rows)
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, first_rows = weight.shape[0], min(weight.shape[0], PACK_ROWS)
        outputs, per_slice = None, None
        for start in range(0, rows, PACK_ROWS):
            part = pack_rows(weight[start:start + PACK_ROWS].float())
            if outputs is None:  # leading-dimension entries per slice of ``first_rows`` rows
                per_slice = [p.shape[0] for p in part]
                outputs = [p.new_empty(n * rows // first_rows, *p.shape[1:]) for p, n in zip(part, per_slice)]
            for whole, piece, n in zip(outputs, part, per_slice):
                at = start // first_rows * n
                whole[at:at + piece.shape[0]] = piece
        return tuple(outputs)
    return pack


GRID_TOLERANCE = 1e-3  # of a step: a dequantized 4-bit value is off its grid by fp32 rounding alone


def grid_levels(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group of ``groups`` ``[..., GROUP]``: the most levels (at most 16) of an evenly spaced grid
    from ``low`` to ``high`` that every value lies on, or 16 where none fits (values not from a
    4-bit grid). A Q4_1 group spans all 16 levels; a Q4_K sub-block may span fewer (its 6-bit scale
    and minimum are fitted, not its minimum and maximum): min/max's 16 levels would then
    requantize it, the grid's keep it."""
    span = (high - low)[..., None]
    levels = torch.full_like(low, 16)
    found = torch.zeros_like(low, dtype=torch.bool)
    for count in range(16, 1, -1):
        t = (groups - low[..., None]) * ((count - 1) / span.clamp_min(1e-30))
        fits = ((t - t.round()).abs().amax(-1) <= GRID_TOLERANCE) & ~found
        levels[fits] = count
        found |= fits
    return levels


@_by_rows
def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (uint8 nibbles, fp16 scales, empty offsets)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    steps = grid_levels(groups, low, high) - 1
    d = ((high - low) / steps).clamp_min(1e-8).half().float()  # quantize against the stored fp16 values
    c = low.half().float()
    q = torch.round((groups - c[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    # [tiles, 16 rows, groups, 16 pairs, 2] -> [tiles, groups, pair i, row]: byte = q[2i] | q[2i+1] << 4
    pairs = q.view(rows // TILE, TILE, cols // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(-1)
    return nibbles, _tile_scales(d.view(rows, -1), c.view(rows, -1)), torch.empty(0, dtype=torch.int32)


@_by_rows
def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 bytes, fp16 scales, int32 ``128·Σq`` per (row, group))."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    d = (groups.abs().amax(-1) / 127).clamp_min(1e-8).half().float()
    q = torch.round(groups / d[..., None]).clamp(-127, 127).to(torch.int8)
    offsets = (128 * q.int().sum(-1)).to(torch.int32).view(rows // TILE, TILE, -1).permute(0, 2, 1).contiguous()
    packed = _tiled(q.view(rows, cols), 8).contiguous().view(-1)
    return packed, _tile_scales(d, torch.zeros_like(d)), offsets


def unpack(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight a packed one stands for (tests; the kernel never materializes it)."""
    tiles, groups = scales.shape[0], scales.shape[1]
    if bits == 4:
        nibbles = packed.view(tiles, groups, GROUP // 2, TILE)  # [tiles, groups, pair, row]
        q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [..., pair, row, 2]
        q = q.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, groups, GROUP)
    else:
        q = packed.view(torch.int8).view(tiles, groups, 8, TILE, 4).float()
        q = q.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, groups, GROUP)  # [N, G, 32]
    d, c = (scales[:, :, i].permute(0, 2, 1).reshape(tiles * TILE, groups, 1).float() for i in (0, 1))
    return (d * q + c).view(tiles * TILE, groups * GROUP)


def quant_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
               bits: int, out_features: int) -> torch.Tensor:
    """``x [M, K] (bf16 or fp32) -> [M, N]`` in x's dtype."""
    if x.dtype not in IS_BF16:
        raise ValueError(f"quant_gemm takes bf16 or fp32 activations, not {x.dtype}")
    x = x.contiguous()
    rows, cols = x.shape
    out = x.new_empty(rows, out_features)
    scratch = torch.empty(2 * rows * cols + 8 * rows * (cols // GROUP), dtype=torch.uint8)
    code = library().ricllm_quant_gemm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                                       bits, out.data_ptr(), rows, cols, out_features, IS_BF16[x.dtype],
                                       scratch.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"quant_gemm refused [{rows}, {cols}] x [{cols}, {out_features}] at {bits} bits (code {code})")
    return out


def quant_gemm_tiles(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                     bits: int, out_features: int, tiles: torch.Tensor) -> torch.Tensor:
    """``x [M, K] -> [M, 16·len(tiles)]`` in x's dtype: the columns of ``quant_gemm`` in the weight's
    16-row tiles ``tiles`` (int32), in that order, bit for bit (``ricllm_quant_gemm_tiles``)."""
    if x.dtype not in IS_BF16:
        raise ValueError(f"quant_gemm_tiles takes bf16 or fp32 activations, not {x.dtype}")
    x, tiles = x.contiguous(), tiles.to(torch.int32).contiguous()
    rows, cols = x.shape
    out = x.new_empty(rows, TILE * tiles.numel())
    scratch = torch.empty(2 * rows * cols + 8 * rows * (cols // GROUP), dtype=torch.uint8)
    code = library().ricllm_quant_gemm_tiles(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                                             bits, out.data_ptr(), rows, cols, out_features, tiles.data_ptr(),
                                             tiles.numel(), IS_BF16[x.dtype], scratch.data_ptr(),
                                             torch.get_num_threads())
    if code != 0:
        raise ValueError(f"quant_gemm_tiles refused [{rows}, {cols}] x {tiles.numel()} tiles of [{cols}, "
                         f"{out_features}] at {bits} bits (code {code})")
    return out


def quant_rows(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int, cols: int,
               out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the weight, dequantized: ``[len(ids), cols]`` in ``dtype`` (an embedding
    lookup served from a packed head)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], cols, dtype=dtype)
    code = library().ricllm_quant_rows(packed.data_ptr(), scales.data_ptr(), bits, ids.data_ptr(), ids.shape[0],
                                       cols, out_features, out.data_ptr(), IS_BF16[dtype])
    if code != 0:
        raise IndexError(f"token id out of range [0, {out_features})")
    return out
