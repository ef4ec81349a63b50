"""A whole decoder stack per decode step in one C call (``csrc/cpu_decoder.c``).

The model's per-op path calls the same C kernels (packed products, fused norm, RoPE + store,
paged attention, SiLU·up) one by one from Python; at decode batch sizes that Python work costs
about as much as the kernels. ``CpuDecoderStack`` holds every layer's weight and cache pointers
once and runs a decode step's layers, and the final norm, with a single call. It computes the
same values as the per-op path: same kernels, same order, same roundings.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ricllm.kernels.cpu_library import DECODER_DIM_NAMES as DIM_NAMES
from ricllm.kernels.cpu_library import DECODER_POINTERS_PER_LAYER as POINTERS_PER_LAYER
from ricllm.kernels.cpu_library import library

IS_BF16 = {torch.bfloat16: 1, torch.float32: 0}  # the element types the kernels take: their is_bf16 flag

ROWS, BATCH, TABLE_WIDTH, BLOCK_SIZE, NUM_THREADS = (DIM_NAMES.index(n) for n in (
    "rows", "batch", "table_width", "block_size", "num_threads"))


@dataclass
class PackedProjection:
    """One projection in ricllm's packed layout: what ``ricllm_quant_gemm`` takes."""
    weight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int


@dataclass
class StackLayer:
    attn_norm: torch.Tensor
    qkv: PackedProjection
    o_proj: PackedProjection
    ffn_norm: torch.Tensor
    gate_up: PackedProjection
    down: PackedProjection


class CpuDecoderStack:
    """Steps of up to ``max_rows`` rows that the C attention kernel serves (decode steps, small
    prefill steps), in one call.

    The tensors passed in must outlive the stack (they are the model's buffers); the KV cache's
    pointers are taken at the first call and again whenever a different cache list comes in.
    """

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor, *, heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float, scale: float, dtype: torch.dtype, max_rows: int):
        self._lib = library()
        if (self._lib.ricllm_decoder_stack_dims(), self._lib.ricllm_decoder_stack_layer_pointers()) != (
                len(DIM_NAMES), POINTERS_PER_LAYER):
            raise RuntimeError("the decoder stack's C and Python argument layouts disagree")
        self.dtype, self.max_rows, self.eps, self.scale = dtype, max_rows, eps, scale
        self._layers, self._final_norm = layers, final_norm
        hidden = final_norm.shape[0]
        self._dims = (ctypes.c_int32 * len(DIM_NAMES))()
        for name, value in dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter,
                                layers=len(layers), is_bf16=IS_BF16[dtype]).items():
            self._dims[DIM_NAMES.index(name)] = value
        self._bits = (ctypes.c_int32 * (4 * len(layers)))(
            *[p.bits for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)])
        self._pointers = None
        self._caches = None

    def accepts(self, x: torch.Tensor, kernel_attention: bool) -> bool:
        """Steps the C attention kernel serves (the stack attends only with it) within the
        packed row range."""
        return kernel_attention and x.shape[0] <= self.max_rows and x.dtype == self.dtype

    def _layer_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        if self._caches is kv_caches:
            return self._pointers
        if any(k.dtype != self.dtype or v.dtype != self.dtype for k, v in kv_caches):
            raise ValueError(f"the decoder stack needs a {self.dtype} KV cache")
        flat = []
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            flat.append(layer.attn_norm.data_ptr())
            for p in (layer.qkv, layer.o_proj):
                flat += [p.weight.data_ptr(), p.scales.data_ptr(), p.offsets.data_ptr()]
            flat.append(layer.ffn_norm.data_ptr())
            for p in (layer.gate_up, layer.down):
                flat += [p.weight.data_ptr(), p.scales.data_ptr(), p.offsets.data_ptr()]
            flat += [k.data_ptr(), v.data_ptr()]
        self._pointers = (ctypes.c_void_p * len(flat))(*flat)
        self._caches = kv_caches
        self._dims[BLOCK_SIZE] = kv_caches[0][0].shape[1]
        return self._pointers

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """The final norm's output ``[T, hidden]``; ``x`` (the embedded tokens) is used as the
        residual stream and overwritten. Writes this step's K/V into the cache."""
        pointers = self._layer_pointers(kv_caches)
        tables, starts, lens = meta.block_tables, meta.query_start_loc, meta.context_lens
        for t, dtype in ((tables, torch.int32), (starts, torch.int32), (lens, torch.int32),
                         (meta.slot_mapping, torch.int64)):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError("the decoder stack takes the runner's contiguous int32/int64 metadata")
        dims = self._dims
        dims[ROWS], dims[BATCH], dims[TABLE_WIDTH] = x.shape[0], lens.shape[0], tables.shape[1]
        dims[NUM_THREADS] = torch.get_num_threads()
        x = x.contiguous()
        out = torch.empty_like(x)
        code = self._lib.ricllm_decoder_stack(
            x.data_ptr(), out.data_ptr(), pointers, self._bits, self._final_norm.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
            dims, self.eps, self.scale)
        if code != 0:
            raise RuntimeError(f"the CPU decoder stack failed (code {code})")
        return out
