"""Fused elementwise layer steps for the CPU (``kernels/cpu_fused_ops.c``), one C call each.

``CpuFusedOps`` is what the fused layers (``ricllm.engine.runtime.llama_fused``; Gemma 3's in bf16) call instead
of the torch ops when the engine runs the ``cpu`` attention backend: add + RMSNorm, RoPE + K/V store, SiLU·up;
Gemma 3's RMSNorm, QK-norm and GeGLU (those the native runtime's Gemma stack runs). Each rounds where
eager torch rounds, so a model computes the same thing either way up to the order of the fp32
sums in the norm; the torch layers remain the reference (tests compare the two).
Activations must be contiguous bf16 or fp32 tensors on the CPU.
"""

from __future__ import annotations

import torch
from ricllm.kernels.cpu_library import library
from ricllm.kernels.decoder_stack_call import CACHE_TYPE_CODES, INT8_ROW_EXTRA

IS_BF16 = {torch.bfloat16: 1, torch.float32: 0}  # the element types the kernels take: their is_bf16 flag
# the cache tensors' dtypes and their type codes (an int8 cache is raw bytes: rows and their scales)
CACHE_TYPES = {torch.float32: CACHE_TYPE_CODES["float32"], torch.bfloat16: CACHE_TYPE_CODES["bfloat16"],
               torch.uint8: CACHE_TYPE_CODES["int8"]}


def _reject(what: str) -> None:
    raise ValueError(f"CPU fused op: {what}")


class CpuFusedOps:
    """Calls into the C library; threads follow ``torch.get_num_threads()`` at each call."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in IS_BF16:
            _reject(f"activations must be bf16 or fp32, not {dtype}")
        self.dtype, self._is_bf16 = dtype, IS_BF16[dtype]
        self._lib = library()

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place (the residual stream), then return ``weight * x / rms(x)``."""
        # checks are plain comparisons: these calls run ~120 times per decode step
        rows, dim = x.shape
        if x.dtype != self.dtype or weight.dtype != self.dtype or not x.is_contiguous():
            _reject(f"add_rms_norm takes contiguous {self.dtype} tensors")
        if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous()):
            _reject("delta must be contiguous and match x")
        out = torch.empty_like(x)
        self._lib.ricllm_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                      weight.data_ptr(), out.data_ptr(), rows, dim, eps, self._is_bf16,
                                      torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Rotate q and k of ``qkv [T, (H + 2·KVH)·D]`` by ``cos``/``sin [T, D]``; write k and v
        to the cache at ``slot_mapping`` (``-1``: skipped); return q ``[T, H, D]``."""
        rows, width = qkv.shape
        _, _, kv_heads, row = k_cache.shape
        head_dim = row - INT8_ROW_EXTRA if k_cache.dtype == torch.uint8 else row
        if not qkv.is_contiguous() or qkv.dtype != self.dtype or width != (num_heads + 2 * kv_heads) * head_dim:
            _reject(f"rope_store takes a contiguous {self.dtype} qkv of width (heads + 2 kv_heads) head_dim")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == self.dtype
                and cos.numel() == sin.numel() == rows * head_dim):
            _reject("cos and sin must be contiguous [T, head_dim] in the activation dtype")
        if k_cache.dtype not in CACHE_TYPES or v_cache.dtype != k_cache.dtype:
            _reject("the cache must be bf16, fp32, or int8 rows (uint8)")
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape[0] != rows:
            _reject("slot_mapping must be contiguous int64 [T]")
        q = qkv.new_empty(rows, num_heads, head_dim)
        self._lib.ricllm_rope_store(qkv.data_ptr(), q.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows,
                                    num_heads, kv_heads, head_dim, self._is_bf16, CACHE_TYPES[k_cache.dtype],
                                    torch.get_num_threads())
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2·I]`` (gate first) -> ``[T, I]``."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous() or gate_up.dtype != self.dtype:
            _reject(f"silu_mul takes a contiguous {self.dtype} tensor")
        out = gate_up.new_empty(rows, width // 2)
        self._lib.ricllm_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, self._is_bf16,
                                  torch.get_num_threads())
        return out

    def rms_norm_scaled(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma 3's RMSNorm of ``x [rows, dim]``: ``round(x / rms(x) · weight)``, scaled in fp32."""
        rows, dim = x.shape
        if x.dtype != self.dtype or weight.dtype != self.dtype or not x.is_contiguous():
            _reject(f"rms_norm_scaled takes contiguous {self.dtype} tensors")
        out = torch.empty_like(x)
        self._lib.ricllm_add_rms_norm_scaled(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                                             self._is_bf16, torch.get_num_threads())
        return out

    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int,
                eps: float) -> None:
        """Gemma 3's QK-norm in place on ``qkv [T, (H + 2·KVH)·D]``: each query and key head normed."""
        rows, width = qkv.shape
        head_dim = q_weight.shape[0]
        if not qkv.is_contiguous() or qkv.dtype != self.dtype or width != (heads + 2 * kv_heads) * head_dim:
            _reject(f"qk_norm takes a contiguous {self.dtype} qkv of width (heads + 2 kv_heads) head_dim")
        self._lib.ricllm_qk_norm(qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), rows, heads, kv_heads,
                                 head_dim, eps, self._is_bf16, torch.get_num_threads())

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` for ``gate_up [T, 2·I]`` (gate first) -> ``[T, I]``: GeGLU."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous() or gate_up.dtype != self.dtype:
            _reject(f"gelu_tanh_mul takes a contiguous {self.dtype} tensor")
        out = gate_up.new_empty(rows, width // 2)
        self._lib.ricllm_gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, self._is_bf16,
                                       torch.get_num_threads())
        return out
