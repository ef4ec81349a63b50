"""The C decoder stack's argument block (``kernels/cpu_decoder.c``), from plain numbers and
addresses: no torch. Both runtimes' wrappers fill it (the torch model's ``CpuDecoderStack`` with
tensors' ``data_ptr()``, the native runtime with numpy arrays' ``ctypes.data``), so the layout the
C side expects is written once. ``LoraTable`` is the stack's view of the resident LoRA adapters,
and ``LoraTable.step`` a step's segments over them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ricllm.kernels.cpu_library import DECODER_DIM_NAMES, DECODER_POINTERS_PER_LAYER, library
from ricllm.kernels.cpu_lora import LoraKernelWeights

PROJECTIONS_PER_LAYER = 4  # qkv, o, gate_up, down: ``bits`` holds one per projection
# a KV cache's type code (kernels/cpu_common.h) by its element type's name (ricllm.cache.kv_format):
# the activations' is_bf16 flag, or int8 rows with their scale
CACHE_TYPE_CODES = {"float32": 0, "bfloat16": 1, "int8": 2}
INT8_ROW_EXTRA = 4  # an int8 row's fp32 scale, after its head_dim bytes


def layer_addresses(attn_norm: int, qkv: tuple[int, int, int], o_proj: tuple[int, int, int], ffn_norm: int,
                    gate_up: tuple[int, int, int], down: tuple[int, int, int], k_cache: int, v_cache: int) -> list[int]:
    """One layer's pointers in the C order; each projection is (packed weight, scales, offsets)."""
    return [attn_norm, *qkv, *o_proj, ffn_norm, *gate_up, *down, k_cache, v_cache]


LORA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's LoRA updates, in the C order


class LoraUpdate(ctypes.Structure):
    """One slot's update of one projection of one layer (``LoraUpdate`` in cpu_decoder.c); rank 0:
    none."""
    _fields_ = [("a", ctypes.c_void_p), ("b_t", ctypes.c_void_p), ("scale", ctypes.c_float),
                ("rank", ctypes.c_int32)]


class LoraStep(ctypes.Structure):
    """A step's segments over a ``LoraTable`` (``LoraStep`` in cpu_decoder.c)."""
    _fields_ = [("starts", ctypes.c_void_p), ("ends", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("segments", ctypes.c_int32), ("slot_count", ctypes.c_int32),
                ("layers", ctypes.c_int32), ("weights_bf16", ctypes.c_int32)]


def check_lora_layout() -> None:
    lib = library()
    theirs = [lib.ricllm_decoder_stack_lora_layout(which) for which in range(3)]
    if theirs != [ctypes.sizeof(LoraUpdate), ctypes.sizeof(LoraStep), len(LORA_PROJECTIONS)]:
        raise RuntimeError("the decoder stack's C and Python LoRA layouts disagree")


class LoraTable:
    """Every slot's update of every layer's projections, as the stack reads them: ``slots`` ×
    ``layers`` × 7 entries, rank 0 where a slot holds nothing. It holds addresses only: whoever
    sets an entry keeps its arrays alive while it stays set. Plain ctypes memory: the C stack that
    reads it (``DecoderStackCall``) checks the layout, so a runtime without the stack (ONNX) holds
    an empty table without loading the C library."""

    def __init__(self, slots: int, layers: int, *, bf16: bool):
        self.slots, self.layers, self.bf16 = slots, layers, bf16
        self._entries = (LoraUpdate * max(1, slots * layers * len(LORA_PROJECTIONS)))()

    def set(self, slot: int, layer: int, projection: str, weights: LoraKernelWeights | None) -> None:
        """The entry of ``projection`` (one of ``LORA_PROJECTIONS``) in ``layer`` of ``slot``; None clears it."""
        entry = self._entries[(slot * self.layers + layer) * len(LORA_PROJECTIONS) + LORA_PROJECTIONS.index(projection)]
        if weights is None:
            entry.a = entry.b_t = None
            entry.scale, entry.rank = 0.0, 0
            return
        if weights.is_bf16 != self.bf16:
            raise ValueError(f"the LoRA table holds {'bf16' if self.bf16 else 'fp32'} weights")
        entry.a, entry.b_t = weights.a.ctypes.data, weights.b_t.ctypes.data
        entry.scale, entry.rank = weights.scale, weights.rank

    def step(self, segments: Sequence[tuple[int, int, int]]) -> "LoraStepArgument":
        """The stack's argument for rows ``[start, end)`` taking slot ``slot``'s updates, per segment."""
        columns = np.ascontiguousarray(np.asarray(segments, dtype=np.int32).reshape(-1, 3).T)
        return LoraStepArgument(columns, LoraStep(
            starts=columns[0].ctypes.data, ends=columns[1].ctypes.data, slots=columns[2].ctypes.data,
            table=ctypes.addressof(self._entries), segments=len(segments), slot_count=self.slots,
            layers=self.layers, weights_bf16=int(self.bf16)), self)


class LoraStepArgument:
    """A ``LoraStep`` with the arrays it points into, kept alive as long as it is."""

    def __init__(self, columns: np.ndarray, step: LoraStep, table: LoraTable):
        self._columns, self._table, self.step = columns, table, step

    @property
    def address(self) -> int:
        return ctypes.addressof(self.step)


class DecoderStackCall:
    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, bits: list[int],
                 is_bf16: int, eps: float, scale: float):
        self._lib = library()
        if (self._lib.ricllm_decoder_stack_dims(), self._lib.ricllm_decoder_stack_layer_pointers()) != (
                len(DECODER_DIM_NAMES), DECODER_POINTERS_PER_LAYER):
            raise RuntimeError("the decoder stack's C and Python argument layouts disagree")
        check_lora_layout()
        self.eps, self.scale = eps, scale
        self._dims = (ctypes.c_int32 * len(DECODER_DIM_NAMES))()
        self._set(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter,
                  layers=len(bits) // PROJECTIONS_PER_LAYER, is_bf16=is_bf16)
        self._bits = (ctypes.c_int32 * len(bits))(*bits)
        self._pointers = None

    def _set(self, **values: int) -> None:
        for name, value in values.items():
            self._dims[DECODER_DIM_NAMES.index(name)] = value

    def bind(self, addresses: list[int], block_size: int, cache_type: int) -> None:
        """Every layer's weight and K/V addresses (``layer_addresses``, layer after layer), and the
        caches' type code (``CACHE_TYPE_CODES``)."""
        self._pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        self._set(block_size=block_size, cache_type=cache_type)

    def __call__(self, x: int, out: int, final_norm: int, cos: int, sin: int, slots: int, tables: int, starts: int,
                 lens: int, *, rows: int, batch: int, table_width: int, threads: int, sinks: int | None = None,
                 windows: int | None = None, lora: LoraStepArgument | None = None) -> None:
        """Run the stack: int64 ``slots``, int32 ``tables``/``starts``/``lens``, all contiguous;
        ``sinks``/``windows``: int32 per sequence when a sequence of the step keeps a KV window;
        ``lora``: the step's adapters (``LoraTable.step``), None when no row has one."""
        self._set(rows=rows, batch=batch, table_width=table_width, num_threads=threads)
        code = self._lib.ricllm_decoder_stack(x, out, self._pointers, self._bits, final_norm, cos, sin, slots,
                                              tables, starts, lens, sinks, windows,
                                              None if lora is None else lora.address, self._dims, self.eps,
                                              self.scale)
        if code != 0:
            raise RuntimeError(f"the CPU decoder stack failed (code {code})")
