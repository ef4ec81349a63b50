"""The Llama model with ricllm's C kernels swapped in: the same values as ``llama``'s torch ops in
fewer calls, for the ``cpu`` attention backend.

The swaps are of modules, made as the model is built: every norm becomes ``FusedRMSNorm`` (the
residual add and the norm in one pass), every attention ``FusedAttention`` (RoPE and the K/V store
in one pass, then the backend's C attention), every MLP ``FusedMLP`` (SiLU·up in one pass). Each
keeps the module's own weights, so loading, packing and the weight cache see the same model. Small
decode steps spend as much time on per-op overhead as in the kernels; these cut it.

Where every projection is packed in ricllm's layout, ``enable_decoder_stack`` goes further: the
steps the C attention kernel serves (decode steps, small prefills) run all layers and the final
norm in one C call (``ricllm.kernels.cpu_decoder``: the same kernels, in the same order).
"""

from __future__ import annotations

import torch
from torch import nn

from ricllm.attention.backends import c_kernel_attends
from ricllm.attention.metadata import AttentionMetadata
from ricllm.engine.runtime.llama import MLP, Attention, LlamaModel, RMSNorm, adapted
from ricllm.engine.runtime.lora_delta import LoraBatch, LoraLayerBatch
from ricllm.kernels.cpu_decoder import CpuDecoderStack, PackedProjection, StackLayer
from ricllm.kernels.cpu_fused import CpuFusedOps
from ricllm.model.packed_linear import PackedLinear
from ricllm.model.spec import ModelSpec


class FusedRMSNorm(nn.Module):
    """``RMSNorm`` as one C pass: ``x += delta`` in place, then the norm of ``x``."""

    def __init__(self, norm: RMSNorm, ops: CpuFusedOps):
        super().__init__()
        self.weight, self.eps, self.ops = norm.weight, norm.eps, ops

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.ops.add_rms_norm(x, delta, self.weight, self.eps)


class FusedAttention(nn.Module):
    """``Attention`` with RoPE and the K/V store as one C pass; the backend attends over the cache,
    which then already holds this step's K/V."""

    def __init__(self, attention: Attention, ops: CpuFusedOps):
        super().__init__()
        self.qkv_proj, self.o_proj, self.backend = attention.qkv_proj, attention.o_proj, attention.backend
        self.num_heads, self.scale, self.ops = attention.num_heads, attention.scale, ops

    def forward(self, x, rope_cos_sin, kv_cache, meta: AttentionMetadata, lora: LoraLayerBatch | None = None):
        qkv = adapted(self.qkv_proj, x, lora, "q", "k", "v")
        q = self.ops.rope_store(qkv, *rope_cos_sin, meta.slot_mapping, *kv_cache, self.num_heads)
        out = self.backend.attend(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return adapted(self.o_proj, out.view(x.shape[0], -1), lora, "o")


class FusedMLP(nn.Module):
    """``MLP`` with SiLU·up as one C pass."""

    def __init__(self, mlp: MLP, ops: CpuFusedOps):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.ops = mlp.gate_up_proj, mlp.down_proj, ops

    def forward(self, x: torch.Tensor, lora: LoraLayerBatch | None = None) -> torch.Tensor:
        return adapted(self.down_proj, self.ops.silu_mul(adapted(self.gate_up_proj, x, lora, "gate", "up")), lora,
                       "down")


class FusedLlamaModel(LlamaModel):
    """``LlamaModel`` with the fused modules swapped in and, once ``enable_decoder_stack`` finds
    every projection packed in ricllm's layout, the steps the stack accepts run through it."""

    def __init__(self, spec: ModelSpec, backend):
        super().__init__(spec, backend)
        ops = backend.fused_ops
        for layer in self.layers:
            layer.attn_norm, layer.ffn_norm = FusedRMSNorm(layer.attn_norm, ops), FusedRMSNorm(layer.ffn_norm, ops)
            layer.attn, layer.mlp = FusedAttention(layer.attn, ops), FusedMLP(layer.mlp, ops)
        self.norm = FusedRMSNorm(self.norm, ops)
        self.decoder_stack = None

    def decode(self, x, rope_cos_sin, kv_caches, meta: AttentionMetadata,
               lora: LoraBatch | None = None) -> torch.Tensor:
        stack = self.decoder_stack
        if stack is not None and stack.accepts(x, c_kernel_attends(meta) or meta.kv_windows is not None) and (
                lora is None or lora.stack_argument is not None):
            return stack(x, *rope_cos_sin, kv_caches, meta, None if lora is None else lora.stack_argument)
        return super().decode(x, rope_cos_sin, kv_caches, meta, lora)

    def enable_decoder_stack(self) -> bool:
        """Run the steps the C attention kernel serves through one C call for all layers. It
        applies when every projection is packed in ricllm's own layout; steps above the
        projections' ``max_packed_rows`` (dense bf16 there) and steps the C attention kernel does
        not serve (large prefills) keep the per-op path. Returns whether it is on."""

        def own(m) -> bool:
            return isinstance(m, PackedLinear) and m.layout == "vnni"

        projections = [p for layer in self.layers for p in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(map(own, projections)):
            self.decoder_stack = None
            return False

        def packed(m: PackedLinear) -> PackedProjection:
            return PackedProjection(m.packed_weight, m.packed_scales, m.packed_offsets, 4 if m.fmt == "int4" else 8)

        layers = [StackLayer(layer.attn_norm.weight, packed(layer.attn.qkv_proj), packed(layer.attn.o_proj),
                             layer.ffn_norm.weight, packed(layer.mlp.gate_up_proj), packed(layer.mlp.down_proj))
                  for layer in self.layers]
        max_rows = min(p.max_packed_rows if p.weight is not None else 1 << 30 for p in projections)
        spec = self.spec
        self.decoder_stack = CpuDecoderStack(
            layers, self.norm.weight, heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            inter=spec.intermediate_size, eps=spec.rms_norm_eps, scale=self.layers[0].attn.scale,
            dtype=self.norm.weight.dtype, max_rows=max_rows)
        return True


def model_class(backend) -> type[LlamaModel]:
    """The fused model where the backend offers the C ops, else the torch reference."""
    return FusedLlamaModel if getattr(backend, "fused_ops", None) is not None else LlamaModel


def enable_decoder_stack(model: LlamaModel) -> bool:
    """``FusedLlamaModel.enable_decoder_stack``; False for the torch model, which has no stack."""
    return isinstance(model, FusedLlamaModel) and model.enable_decoder_stack()
