"""GGUF block types as ``com.microsoft`` MatMulNBits and GatherBlockQuantized weights, block for block.

Every type maps onto MatMulNBits' ``scale·(code − zero point)`` at its default zero point (8 at 4 bits,
128 at 8), with one exact fp32 scale per block, where a 4-bit type's minimum, if it has one, becomes an
offset times each block's activation sum (``nbits_matmul`` adds that small product):

    Q8_0   d·q                  8-bit, block 32: codes q + 128, scale d
    Q5_0   d·(q − 16)           8-bit, block 32: codes q − 16 + 128, scale d
    Q6_K   d·sc_j·(q − 32)      8-bit, block 16 (its sub-blocks): codes q − 32 + 128, scale d·sc_j
    Q4_0   d·(q − 8)            4-bit, block 32: codes q, scale d
    Q4_1   d·q + m              4-bit, block 32: codes q, scale d, offset m + 8d
    Q4_K   d·sc_j·q − dmin·m_j  4-bit, block 32 (its sub-blocks): codes q, scale d·sc_j,
                                offset 8·d·sc_j − dmin·m_j

``d`` is fp16 and ``sc_j`` an integer of at most 8 bits, so every scale ``d·sc_j`` is exact in fp32: the
products differ from the file's dequantized weights by fp32 rounding only (the offsets' one subtraction,
the sums' order). Q5_0 and Q6_K cost a byte a weight here against 5.5 and 6.6 bits in the file: MatMulNBits
has no 5- or 6-bit layout, and 8 bits hold their codes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ricllm.engine.runtime.onnx_graph import ACCURACY_LEVEL, MS_DOMAIN, GraphBuilder, matmul_nbits_weights

OFFSET_BLOCK = 32  # the weights an offset covers: one 4-bit block
NBITS_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")


@dataclass(frozen=True)
class NBitsWeight:
    """A weight ``[N, K]`` as MatMulNBits takes it: ``codes`` uint8 ``[N, K/block_size, blob]``,
    ``scales`` fp32 ``[N, K/block_size]``, and the 4-bit types' ``offsets`` fp32 ``[N, K/32]`` (or None)."""

    codes: np.ndarray
    scales: np.ndarray
    bits: int
    block_size: int
    offsets: np.ndarray | None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def columns(self) -> int:
        return self.codes.shape[1] * self.block_size


def nbits_weight(kind: str, blocks: np.ndarray) -> NBitsWeight:
    """The MatMulNBits form of GGUF blocks ``[N, K/type block, type bytes]`` of ``kind`` (``NBITS_TYPES``)."""
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        codes, scales, bits, offsets = matmul_nbits_weights(kind, blocks)
        return NBitsWeight(codes, scales.reshape(rows, -1), bits, 32, offsets)
    d = _fp16(blocks[..., 0:2])
    if kind == "Q5_0":
        high = blocks[..., 2:6].copy().view("<u4")  # [N, kb, 1]: bit i is code i's fifth bit
        low = np.concatenate([blocks[..., 6:22] & 0x0F, blocks[..., 6:22] >> 4], axis=-1)
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return NBitsWeight(np.ascontiguousarray(low | (fifth << 4)) + np.uint8(112), d, 8, 32, None)
    if kind == "Q6_K":
        return _q6_k(blocks)
    if kind == "Q4_K":
        return _q4_k(blocks)
    raise ValueError(f"GGUF type {kind} has no MatMulNBits form")


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _q6_k(blocks: np.ndarray) -> NBitsWeight:
    """256 weights a block: 16 sub-blocks of 16, each ``d·sc·(q − 32)``; q's low 4 bits in ``ql``
    (two halves of 128, each 64 bytes of low then high nibbles), its top 2 in ``qh``."""
    rows, kb = blocks.shape[:2]
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _fp16(blocks[..., 208:210])
    low = ql.reshape(rows, kb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(rows, kb, 8, 32)
    high = qh.reshape(rows, kb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = (high & 0x03).reshape(rows, kb, 8, 32)
    codes = ((low | (high << 4)) + np.uint8(96)).reshape(rows, kb * 16, 16)
    return NBitsWeight(np.ascontiguousarray(codes), (d[..., None] * sc).reshape(rows, kb * 16), 8, 16, None)


def _q4_k(blocks: np.ndarray) -> NBitsWeight:
    """256 weights a block: 8 sub-blocks of 32, each ``d·sc·q − dmin·m`` with 6-bit ``sc``, ``m`` packed in
    12 bytes; sub-block ``2p`` is the low nibbles of bytes ``32p..32p+31``, ``2p + 1`` their high ones."""
    rows, kb = blocks.shape[:2]
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    packed = blocks[..., 4:16].reshape(rows, kb, 3, 4)
    first, second, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([first & 0x3F, (rest & 0x0F) | ((first >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([second & 0x3F, (rest >> 4) | ((second >> 2) & 0x30)], axis=-1).astype(np.float32)
    nibbles = blocks[..., 16:144].reshape(rows, kb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    codes = (nibbles & 0x0F).reshape(rows, kb * 8, 32)
    scales = (d[..., None] * sc).reshape(rows, kb * 8)
    offsets = (8 * d[..., None] * sc - dmin[..., None] * m).reshape(rows, kb * 8)
    return NBitsWeight(pack_nibbles(codes), scales, 4, 32, offsets)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """MatMulNBits' (and GatherBlockQuantized's) 4-bit blob: byte i holds code 2i (low nibble) and 2i+1 (high)."""
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def stacked(weights: list[NBitsWeight]) -> NBitsWeight | None:
    """Weights of one layout stacked by rows (one product for q, k and v), or None where their bits or
    block sizes differ. A weight without offsets gets zeros beside one with them."""
    first = weights[0]
    if any((w.bits, w.block_size) != (first.bits, first.block_size) for w in weights):
        return None
    with_offsets = any(w.offsets is not None for w in weights)
    offsets = (np.concatenate([w.offsets if w.offsets is not None
                               else np.zeros((w.rows, w.columns // OFFSET_BLOCK), np.float32) for w in weights])
               if with_offsets else None)
    return NBitsWeight(np.concatenate([w.codes for w in weights]), np.concatenate([w.scales for w in weights]),
                       first.bits, first.block_size, offsets)


def nbits_matmul(g: GraphBuilder, x: str, weight: NBitsWeight, stem: str, accuracy_level: int = ACCURACY_LEVEL,
                 codes_name: str | None = None, scales_name: str | None = None) -> str:
    """``x [T, K] @ W.T``: one MatMulNBits node, plus ``Σ_b offset[n, b]·Σ_{k in block b} x[k]`` (a small fp32
    product ``[T, K/32] @ [K/32, N]``) for a weight with offsets. ``codes_name``/``scales_name``: initializers
    already in the graph (the embedding's, for a tied head)."""
    inputs = [codes_name or g.constant(f"{stem}_weight", weight.codes),
              scales_name or g.constant(f"{stem}_scales", weight.scales.reshape(-1))]
    y = g.one("MatMulNBits", [x, *inputs], domain=MS_DOMAIN, K=weight.columns, N=weight.rows, bits=weight.bits,
              block_size=weight.block_size, accuracy_level=accuracy_level)
    if weight.offsets is None:
        return y
    block_sums = g.one("ReduceSum", [g.one("Reshape", [x, g.shape(0, weight.columns // OFFSET_BLOCK, OFFSET_BLOCK)]),
                                     g.constant("axes", np.asarray([-1], dtype=np.int64))], keepdims=0)
    return g.one("Add", [y, g.one("MatMul", [block_sums, g.constant(f"{stem}_offsets", weight.offsets.T)])])


def nbits_gather(g: GraphBuilder, ids: str, weight: NBitsWeight, stem: str) -> tuple[str, str, str]:
    """(rows ``[T, K]`` of the table ``weight`` at ``ids``, the codes' initializer, the scales' as MatMulNBits
    reads them): ``GatherBlockQuantized`` over the MatMulNBits codes (one initializer for lookup and a tied
    head), plus each row's offsets, gathered and repeated over their blocks, for a 4-bit type with them."""
    codes = g.constant(f"{stem}_codes", weight.codes)  # [rows, K/block, blob]
    scales = g.constant(f"{stem}_scales", weight.scales[..., None])  # [rows, K/block, 1]
    looked_up = g.one("GatherBlockQuantized", [codes, ids, scales], domain=MS_DOMAIN, gather_axis=0,
                      quantize_axis=2, block_size=weight.block_size, bits=weight.bits)
    rows = g.one("Reshape", [looked_up, g.shape(-1, weight.columns)])
    if weight.offsets is not None:
        offsets = g.one("Gather", [g.constant(f"{stem}_offsets", weight.offsets[..., None]), ids], axis=0)
        spread = g.one("Expand", [offsets, g.shape(1, 1, OFFSET_BLOCK)])  # [T, K/32, 32]
        rows = g.one("Add", [rows, g.one("Reshape", [spread, g.shape(-1, weight.columns)])])
    return rows, codes, g.one("Reshape", [scales, g.shape(-1)])
