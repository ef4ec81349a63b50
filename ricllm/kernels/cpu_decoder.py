"""A whole decoder stack per decode step in one C call (``kernels/cpu_decoder.c``).

The model's per-op path calls the same C kernels (packed products, fused norm, RoPE + store,
paged attention, SiLU·up) one by one from Python; at decode batch sizes that Python work costs
about as much as the kernels. ``CpuDecoderStack`` holds every layer's weight and cache pointers
once and runs a decode step's layers, and the final norm, with a single call. It computes the
same values as the per-op path: same kernels, same order, same roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ricllm.kernels.cpu_fused import CACHE_TYPES
from ricllm.kernels.decoder_stack_call import DecoderStackCall, LoraStepArgument, layer_addresses

IS_BF16 = {torch.bfloat16: 1, torch.float32: 0}  # the element types the kernels take: their is_bf16 flag


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
        self.dtype, self.max_rows = dtype, max_rows
        self._layers, self._final_norm = layers, final_norm
        bits = [p.bits for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        self._call = DecoderStackCall(hidden=final_norm.shape[0], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                      inter=inter, bits=bits, is_bf16=IS_BF16[dtype], eps=eps, scale=scale)
        self._caches = None

    def accepts(self, x: torch.Tensor, kernel_attention: bool) -> bool:
        """Steps the C attention kernel serves (the stack attends only with it) within the
        packed row range."""
        return kernel_attention and x.shape[0] <= self.max_rows and x.dtype == self.dtype

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._caches is kv_caches:
            return
        if any(k.dtype not in (self.dtype, torch.uint8) or v.dtype != k.dtype for k, v in kv_caches):
            raise ValueError(f"the decoder stack needs a {self.dtype} or int8 (uint8 rows) KV cache")

        def packed(p: PackedProjection) -> tuple[int, int, int]:
            return p.weight.data_ptr(), p.scales.data_ptr(), p.offsets.data_ptr()

        addresses = []
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            addresses += layer_addresses(layer.attn_norm.data_ptr(), packed(layer.qkv), packed(layer.o_proj),
                                         layer.ffn_norm.data_ptr(), packed(layer.gate_up), packed(layer.down),
                                         k.data_ptr(), v.data_ptr())
        k_cache = kv_caches[0][0]
        self._call.bind(addresses, block_size=k_cache.shape[1], cache_type=CACHE_TYPES[k_cache.dtype])
        self._caches = kv_caches

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta,
                 lora: LoraStepArgument | None = None) -> torch.Tensor:
        """The final norm's output ``[T, hidden]``; ``x`` (the embedded tokens) is used as the
        residual stream and overwritten. Writes this step's K/V into the cache. ``lora``: the step's
        adapters (``LoraTable.step``), None when no row has one."""
        self._bind(kv_caches)
        tables, starts, lens = meta.block_tables, meta.query_start_loc, meta.context_lens
        windowed = [] if meta.kv_windows is None else [(meta.kv_sinks, torch.int32), (meta.kv_windows, torch.int32)]
        for t, dtype in ((tables, torch.int32), (starts, torch.int32), (lens, torch.int32),
                         (meta.slot_mapping, torch.int64), *windowed):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError("the decoder stack takes the runner's contiguous int32/int64 metadata")
        x = x.contiguous()
        out = torch.empty_like(x)
        self._call(x.data_ptr(), out.data_ptr(), self._final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   meta.slot_mapping.data_ptr(), tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
                   rows=x.shape[0], batch=lens.shape[0], table_width=tables.shape[1],
                   threads=torch.get_num_threads(), sinks=windowed[0][0].data_ptr() if windowed else None,
                   windows=windowed[1][0].data_ptr() if windowed else None, lora=lora)
        return out
