"""Weight-only quantized linear layers for the CPU: fewer bytes per decode step.

A decode step at small batch reads every weight once and does little arithmetic with it, so
its time is the weight bytes over the memory bandwidth: 4-bit weights are read 4× faster than
bf16. torch's weight-only kernels pay for that at larger batches (they dequantize per product),
so ``PackedLinear`` keeps the dense bf16 weight too and picks per call by the number of rows.

Two layouts:
- ``vnni`` (ricllm's own kernels, ``ricllm.kernels.cpu_quant``, where the C kernels build and
  the CPU has the instructions): 4-bit keeps Q4_1's ``w = d·q + m`` per group of 32 and
  multiplies bf16 activations on the bf16 dot-product unit (AVX-512 BF16); 8-bit keeps Q8_0's
  ``w = d·q`` per group of 32 and quantizes activations to int8 per group of 32 for the
  integer unit (AVX-512 VNNI), as llama.cpp does. Both keep fp16 scales, so a Q4_1 or Q8_0
  file is reproduced exactly, and both are 1.3-2x faster than torch's at decode batch sizes.
- ``torch`` (elsewhere): torch's weight-only kernels. 4-bit: groups of 32,
  ``w ≈ (q − 8)·scale + zero``; Q4_1's ``d·q + m`` maps to ``scale = d``, ``zero = m + 8d``
  exactly up to the bf16 rounding of the scales (a Q4_K sub-block likewise: the step of its grid,
  ``cpu_quant.grid_levels``). 8-bit: one symmetric scale per output row
  (``torch.ops.aten._weight_int8pack_mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ricllm.kernels import cpu_library, cpu_quant
from ricllm.model import formats

INT4_GROUP = 32
WEIGHT_FORMATS, FOUR_BIT_TYPES, EIGHT_BIT_TYPES = formats.WEIGHT_FORMATS, formats.FOUR_BIT_TYPES, formats.EIGHT_BIT_TYPES


def resolve_formats(requested: str, tensor_types: dict[str, str], dtype: torch.dtype,
                    device: torch.device) -> tuple[str, str]:
    """``formats.resolve_formats`` for a torch dtype and device."""
    where = f"{str(dtype).removeprefix('torch.')} on {device}"
    return formats.resolve_formats(requested, tensor_types, device.type == "cpu" and dtype == torch.bfloat16, where)


def pack_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, K]`` -> (packed int4 weight, bf16 scales-and-zeros ``[K/group, N, 2]``)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / (cpu_quant.grid_levels(groups, low, high) - 1)).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(rows, cols), 1)
    scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, K]`` -> (int8 ``[N, K]``, bf16 per-row scales ``[N]``)."""
    scale = (weight.float().abs().amax(1) / 127).clamp_min(1e-12)
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16)


def can_pack(weight: torch.Tensor, fmt: str) -> bool:
    """Whether some layout takes this shape: 4-bit needs whole groups of 32 inputs and tiles of
    16 outputs (both layouts); 8-bit packs any shape (torch's layout)."""
    rows, cols = weight.shape
    return fmt == "int8" or (fmt == "int4" and cols % INT4_GROUP == 0 and rows % 16 == 0)


def vnni_layout_available(fmt: str) -> bool:
    """Whether packing ``fmt`` uses ricllm's own kernel here (part of the weight cache's key)."""
    return cpu_quant.quant_gemm_available(4 if fmt == "int4" else 8)


def head_max_packed_rows(max_packed_rows: int | None) -> int | None:
    """Rows up to which the LM head stays packed. torch's kernels are compute-heavy per row on
    the vocabulary-wide head, so bf16 wins there from a few rows on; the VNNI kernel keeps up."""
    if max_packed_rows is None or vnni_layout_available("int8"):
        return max_packed_rows
    return max(1, max_packed_rows // 4)


class PackedLinear(nn.Module):
    """``y = x Wᵀ`` with a packed weight for up to ``max_packed_rows`` rows, dense bf16 above.

    Build it with :meth:`pack`; the constructor adopts tensors already packed (the weight cache).
    ``packed_offsets`` (the VNNI layout's int32 corrections; empty for its 4-bit) marks that layout.
    """

    def __init__(self, packed_weight: torch.Tensor, packed_scales: torch.Tensor,
                 dense_weight: torch.Tensor | None, fmt: str, max_packed_rows: int,
                 packed_offsets: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.max_packed_rows = fmt, max_packed_rows
        self.layout = "torch" if packed_offsets is None else "vnni"
        if self.layout == "vnni":
            self.out_features = packed_scales.shape[0] * packed_scales.shape[-1]  # [tiles, groups, 2, 16]
            self.register_buffer("packed_offsets", packed_offsets)
        else:
            self.out_features = packed_scales.shape[-2] if fmt == "int4" else packed_scales.shape[0]
        self.register_buffer("packed_weight", packed_weight)
        self.register_buffer("packed_scales", packed_scales)
        self.weight = None if dense_weight is None else nn.Parameter(dense_weight, requires_grad=False)

    @classmethod
    def pack(cls, dense_weight: torch.Tensor, fmt: str, max_packed_rows: int | None,
             shared_dense: torch.Tensor | None = None, layout: str | None = None) -> "PackedLinear":
        """``max_packed_rows=None`` keeps no bf16 copy (least memory, packed at every batch size);
        ``shared_dense`` is a bf16 tensor holding the same weight already (a tied embedding);
        ``layout`` forces ``"torch"`` or ``"vnni"``; by default ``vnni`` where it runs and the shape
        fits (16 output rows a tile)."""
        offsets = None
        if layout is None:
            usable = vnni_layout_available(fmt) and cpu_quant.can_pack(dense_weight)
            layout = "vnni" if usable else "torch"
        if layout == "vnni":
            *packed, offsets = (cpu_quant.pack_int4 if fmt == "int4" else cpu_quant.pack_int8)(dense_weight)
        else:
            packed = pack_int4(dense_weight) if fmt == "int4" else pack_int8(dense_weight)
        if max_packed_rows is None:
            return cls(*packed, None, fmt, 0, offsets)
        dense = shared_dense if shared_dense is not None else dense_weight.to(torch.bfloat16)
        return cls(*packed, dense, fmt, max_packed_rows, offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.weight is not None and rows > self.max_packed_rows:
            return F.linear(x, self.weight)
        if self.layout == "vnni":
            return cpu_quant.quant_gemm(x, self.packed_weight, self.packed_scales, self.packed_offsets,
                              4 if self.fmt == "int4" else 8, self.out_features)
        if self.fmt == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed_weight, INT4_GROUP, self.packed_scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.packed_weight, self.packed_scales)


    def narrows(self, rows: int) -> bool:
        """Whether ``forward_tiles`` gives each output as ``forward`` does for up to ``rows`` rows:
        ricllm's layout, no dense copy to switch to, and (4-bit) one path for every row count up to
        ``rows`` (not past AMX's threshold)."""
        if self.layout != "vnni" or self.weight is not None:
            return False
        return self.fmt == "int8" or cpu_library.int4_path(rows) == cpu_library.int4_path(1)

    def forward_tiles(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` on the weight's 16-row tiles ``tiles`` only: ``[rows, 16·len(tiles)]`` (``narrows``)."""
        return cpu_quant.quant_gemm_tiles(x, self.packed_weight, self.packed_scales, self.packed_offsets,
                                          4 if self.fmt == "int4" else 8, self.out_features, tiles)


class PackedEmbedding(nn.Module):
    """A tied embedding looked up in its packed LM head (ricllm's layout): each row dequantized
    as ``d·q`` (+ ``c``) in fp32, then rounded to the activation type, which is what the dense
    embedding holds when the packing reproduced the file's weights exactly (a Q8_0 embedding:
    checked by :meth:`serves`). The vocabulary then stays in memory once, 4-bit or 8-bit."""

    def __init__(self, head: PackedLinear, dtype: torch.dtype):
        super().__init__()
        # plain tensor attributes, not buffers: they are the head's, saved once under its name
        self.packed_weight, self.packed_scales = head.packed_weight, head.packed_scales
        self.bits, self.num_embeddings, self.dtype = 4 if head.fmt == "int4" else 8, head.out_features, dtype
        self.embedding_dim = head.packed_scales.shape[1] * cpu_quant.GROUP

    @staticmethod
    def serves(head: PackedLinear, dense: torch.Tensor) -> bool:
        """Whether lookups in ``head`` give exactly the rows of ``dense``."""
        if head.layout != "vnni" or dense.dtype not in (torch.bfloat16, torch.float32):
            return False
        bits, tiles = 4 if head.fmt == "int4" else 8, head.packed_scales.shape[0]
        weight_per_tile = head.packed_weight.numel() // tiles
        step = cpu_quant.PACK_ROWS // cpu_quant.TILE  # a slice at a time: the whole head in fp32 is 113 MB
        for first in range(0, tiles, step):
            last = min(tiles, first + step)
            offsets = head.packed_offsets[first:last] if head.packed_offsets.numel() else head.packed_offsets
            restored = cpu_quant.unpack(head.packed_weight[first * weight_per_tile:last * weight_per_tile],
                                        head.packed_scales[first:last], offsets, bits)
            if not torch.equal(restored.to(dense.dtype), dense[first * cpu_quant.TILE:last * cpu_quant.TILE]):
                return False
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_quant.quant_rows(ids, self.packed_weight, self.packed_scales, self.bits, self.embedding_dim,
                                    self.num_embeddings, self.dtype)
