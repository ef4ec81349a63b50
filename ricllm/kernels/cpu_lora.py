"""LoRA updates for a batch of rows grouped by adapter (``kernels/cpu_lora.c``), from numpy: no torch.

A projection's output ``y [rows, out]`` gets, on the rows of each segment, its adapter's
low-rank update ``y[r] += scale · (x[r] · Aᵀ) · Bᵀ`` (``x [rows, in]``: the projection's input);
rows outside every segment are left alone. ``kernel_weights`` lays out one adapter's A and B for
the kernel (B transposed, fp32 or bf16), once per adapter; ``apply_lora`` runs a step's product.
``lora_reference`` is the same update in float64 numpy, what the kernel is checked against.

Activations are fp32 (``float32``) or bf16 (``uint16`` bit patterns, as the native runtime holds
them); ``x`` and ``y`` may be column slices of wider rows (q, k, v inside a fused qkv output) as
long as each row's values are contiguous.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ricllm.kernels.aligned import CACHE_LINE, aligned_empty, huge_page_bytes
from ricllm.kernels.cpu_library import library

ACTIVATION_TYPES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1}  # numpy dtype -> the kernel's is_bf16


def to_bf16(values: np.ndarray) -> np.ndarray:
    """fp32 values as bf16 bit patterns (uint16), rounded to nearest even as the kernels round."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as the fp32 values they are, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class LoraKernelWeights:
    """One adapter's update of one projection as the kernel reads it: ``a [rank, in]`` and
    ``b_t [rank, out]`` (Bᵀ), both fp32 or both bf16 bit patterns, C-contiguous on a cache line."""

    a: np.ndarray
    b_t: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def in_features(self) -> int:
        return self.a.shape[1]

    @property
    def out_features(self) -> int:
        return self.b_t.shape[1]

    @property
    def is_bf16(self) -> bool:
        return self.a.dtype == np.uint16

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_t.nbytes


def kernel_weights(a: np.ndarray, b: np.ndarray, scale: float, *, bf16: bool = False) -> LoraKernelWeights:
    """The kernel's layout of ``a [rank, in]`` and ``b [out, rank]`` (PEFT's lora_A and lora_B), in
    fp32 or, with ``bf16``, rounded to bf16 (half the bytes each step reads)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
        raise ValueError(f"LoRA weights: A {list(a.shape)} and B {list(b.shape)} are not [rank, in] and [out, rank]")

    def laid_out(values: np.ndarray) -> np.ndarray:
        values = to_bf16(values) if bf16 else np.asarray(values, dtype=np.float32)
        out = aligned_empty(values.shape, values.dtype)
        out[...] = values
        return out

    return LoraKernelWeights(a=laid_out(a), b_t=laid_out(np.asarray(b).T), scale=float(scale))


def side_by_side(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Copies of ``arrays`` one after another in one buffer, each on a cache line, on huge pages
    where the system offers them (``huge_page_bytes``). An adapter's updates laid out in the order
    a step reads them make its reads one ascending walk through memory, a few KB at a time, that
    few TLB entries cover."""
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // CACHE_LINE) * CACHE_LINE
    buffer = huge_page_bytes(max(total, 1))
    copies = []
    for array, offset in zip(arrays, offsets):
        copy = buffer[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
        copy[...] = array
        copies.append(copy)
    return copies


@dataclass(frozen=True)
class LoraSegment:
    """Rows ``[start, end)`` of a step take ``weights``' update."""

    start: int
    end: int
    weights: LoraKernelWeights


def _row_stride(array: np.ndarray, name: str) -> int:
    """Elements between two rows of a 2-D array whose rows are each contiguous."""
    if array.ndim != 2 or array.dtype not in ACTIVATION_TYPES or array.strides[1] != array.itemsize \
            or array.strides[0] % array.itemsize or array.strides[0] < array.shape[1] * array.itemsize:
        raise ValueError(f"LoRA {name}: a 2-D float32 or uint16 (bf16) array with contiguous rows, "
                         f"not {array.dtype} {list(array.shape)} with strides {list(array.strides)}")
    return array.strides[0] // array.itemsize


def _check_segments(segments: Sequence[LoraSegment], rows: int, in_features: int, out_features: int) -> None:
    covered = sorted((segment.start, segment.end) for segment in segments)
    for (start, end), following in zip(covered, [*covered[1:], None]):
        if not 0 <= start <= end <= rows:
            raise ValueError(f"LoRA segment [{start}, {end}) lies outside the step's {rows} rows")
        if following is not None and following[0] < end:
            raise ValueError(f"LoRA segments [{start}, {end}) and [{following[0]}, {following[1]}) overlap")
    for segment in segments:
        weights = segment.weights
        if (weights.in_features, weights.out_features) != (in_features, out_features):
            raise ValueError(f"LoRA weights are [{weights.rank}, {weights.in_features}] and "
                             f"[{weights.rank}, {weights.out_features}]; the step's x and y have "
                             f"{in_features} and {out_features} columns")
    if len({segment.weights.is_bf16 for segment in segments}) > 1:
        raise ValueError("LoRA segments of one call hold their weights in one type (all fp32 or all bf16)")


def apply_lora(x: np.ndarray, y: np.ndarray, segments: Sequence[LoraSegment], *, threads: int = 1) -> None:
    """``y[r] += scale · (x[r] · Aᵀ) · Bᵀ`` in place for the rows of each segment, with that
    segment's weights; ``x`` and ``y`` have the same rows and element type."""
    x_stride, y_stride = _row_stride(x, "x"), _row_stride(y, "y")
    if x.shape[0] != y.shape[0] or x.dtype != y.dtype:
        raise ValueError(f"LoRA x {x.dtype} {list(x.shape)} and y {y.dtype} {list(y.shape)}: "
                         "one row of each per token, in one element type")
    _check_segments(segments, x.shape[0], x.shape[1], y.shape[1])
    if not segments:
        return
    count = len(segments)
    code = library().ricllm_lora(
        x.ctypes.data, x_stride, y.ctypes.data, y_stride, x.shape[1], y.shape[1], count,
        (ctypes.c_int32 * count)(*(segment.start for segment in segments)),
        (ctypes.c_int32 * count)(*(segment.end for segment in segments)),
        (ctypes.c_int32 * count)(*(segment.weights.rank for segment in segments)),
        (ctypes.c_void_p * count)(*(segment.weights.a.ctypes.data for segment in segments)),
        (ctypes.c_void_p * count)(*(segment.weights.b_t.ctypes.data for segment in segments)),
        (ctypes.c_float * count)(*(segment.weights.scale for segment in segments)),
        ACTIVATION_TYPES[x.dtype], int(segments[0].weights.is_bf16), threads)
    if code != 0:
        raise RuntimeError(f"the CPU LoRA kernel failed (code {code})")


def lora_reference(x: np.ndarray, y: np.ndarray, segments: Sequence[LoraSegment]) -> np.ndarray:
    """What ``apply_lora`` makes of ``y``, in float64 from the same values, returned as fp32 (the
    kernel's bf16 output is this rounded once)."""
    def values(array: np.ndarray) -> np.ndarray:
        return (from_bf16(array) if array.dtype == np.uint16 else array).astype(np.float64)

    out = values(y)
    for segment in segments:
        rows, weights = slice(segment.start, segment.end), segment.weights
        low_rank = values(x[rows]) @ values(weights.a).T
        out[rows] += weights.scale * low_rank @ values(weights.b_t)
    return out.astype(np.float32)
