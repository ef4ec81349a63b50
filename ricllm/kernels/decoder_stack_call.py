"""The C decoder stack's argument block (``kernels/cpu_decoder.c``), from plain numbers and
addresses: no torch. Both runtimes' wrappers fill it (the torch model's ``CpuDecoderStack`` with
tensors' ``data_ptr()``, the native runtime with numpy arrays' ``ctypes.data``), so the layout the
C side expects is written once.
"""

from __future__ import annotations

import ctypes

from ricllm.kernels.cpu_library import DECODER_DIM_NAMES, DECODER_POINTERS_PER_LAYER, library

PROJECTIONS_PER_LAYER = 4  # qkv, o, gate_up, down: ``bits`` holds one per projection
# a KV cache's type code (kernels/cpu_common.h) by its element type's name (ricllm.cache.kv_format):
# the activations' is_bf16 flag, or int8 rows with their scale
CACHE_TYPE_CODES = {"float32": 0, "bfloat16": 1, "int8": 2}
INT8_ROW_EXTRA = 4  # an int8 row's fp32 scale, after its head_dim bytes


def layer_addresses(attn_norm: int, qkv: tuple[int, int, int], o_proj: tuple[int, int, int], ffn_norm: int,
                    gate_up: tuple[int, int, int], down: tuple[int, int, int], k_cache: int, v_cache: int) -> list[int]:
    """One layer's pointers in the C order; each projection is (packed weight, scales, offsets)."""
    return [attn_norm, *qkv, *o_proj, ffn_norm, *gate_up, *down, k_cache, v_cache]


class DecoderStackCall:
    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, bits: list[int],
                 is_bf16: int, eps: float, scale: float):
        self._lib = library()
        if (self._lib.ricllm_decoder_stack_dims(), self._lib.ricllm_decoder_stack_layer_pointers()) != (
                len(DECODER_DIM_NAMES), DECODER_POINTERS_PER_LAYER):
            raise RuntimeError("the decoder stack's C and Python argument layouts disagree")
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
                 windows: int | None = None) -> None:
        """Run the stack: int64 ``slots``, int32 ``tables``/``starts``/``lens``, all contiguous;
        ``sinks``/``windows``: int32 per sequence when a sequence of the step keeps a KV window."""
        self._set(rows=rows, batch=batch, table_width=table_width, num_threads=threads)
        code = self._lib.ricllm_decoder_stack(x, out, self._pointers, self._bits, final_norm, cos, sin, slots,
                                              tables, starts, lens, sinks, windows, self._dims, self.eps,
                                              self.scale)
        if code != 0:
            raise RuntimeError(f"the CPU decoder stack failed (code {code})")
