"""Gemma 3 (text), as the math:

    x = embed(ids) · √hidden
    for each layer:  h = x + n_post_attn(W_o · Attn_w(RoPE_θ(n_q(W_q · n_attn(x))), RoPE_θ(n_k(W_k · n_attn(x))),
                                                   W_v · n_attn(x)))
                     x = h + n_post_ffn(W_down · (gelu_tanh(W_gate · n_ffn(h)) ⊙ W_up · n_ffn(h)))
    logits = head(n(x))   (c · tanh(logits / c) where the model caps them),   n(x) = x / rms(x) ⊙ g

Each layer has its own attention span ``w`` and RoPE base ``θ`` (``ModelSpec.layer_windows``): five
layers in six are sliding-window layers, whose query at position ``p`` sees the keys in
``(p - w, p]`` (512 tokens for Gemma 3 270M) and rotates with base 10,000; the sixth sees the
whole sequence and rotates with the file's base (1,000,000). Attention scores are scaled by
``query_pre_attn_scalar^-1/2``; queries and keys are RMS-normed per head before RoPE. ``g`` is the
norm's weight as the GGUF stores it: HF's ``1 + weight`` (llama.cpp's converter adds the one).

Attention goes through ricllm's paged cache and backends as the Llama model's does. The backends
take a sink + window per sequence (``AttentionMetadata.kv_windows``), not per layer, so this
model hands the sliding-window layers a second metadata object for the step
(``sliding_window_metadata``) in which every sequence's window is the layer's. The cache still
keeps every layer's whole sequence: a sliding-window layer only masks what it does not read.

With bf16 activations on the ``cpu`` backend the norms, QK-norm and GeGLU run in the C kernels the
native runtime's Gemma stack runs (``c_ops``): where both runtimes attend in the same kernel (decode
steps, prefill chunks up to 64 rows) they compute the same bits.

With LoRA adapters each projection ``W`` of a row served under adapter ``s`` is ``W + scale_s·B_s·A_s``,
added to the projection's output as in the Llama model (``llama.adapted``): ``W_q`` and ``W_k`` are
adapted before QK-norm, ``W_o`` and ``W_down`` before the post-sublayer norms, as PEFT adapts HF's
``q_proj``, ``k_proj``, ``o_proj`` and ``down_proj``.

Weights come in through ``gemma3_weights``; the projections pack as the Llama model's do (the
same module names: ``attn.qkv_proj``, ``attn.o_proj``, ``mlp.gate_up_proj``, ``mlp.down_proj``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_groups import kv_cache_groups, layer_groups
from ricllm.engine.runtime.llama import Embedding, Linear, adapted, apply_rope, rope_inverse_frequencies
from ricllm.engine.runtime.lora_delta import LoraBatch, LoraLayerBatch
from ricllm.errors import ConfigError
from ricllm.model.packed_linear import PackedLinear
from ricllm.model.spec import ModelSpec

# ricllm's C attention kernels take head_dim <= 256 (kernels/cpu_paged_attention.c's MAX_D): Gemma 3's
# heads are 256 wide
C_KERNEL_MAX_HEAD_DIM = 256


def attention_backend_name(requested: str, device: torch.device, head_dim: int) -> str:
    """The attention backend Gemma runs with for the ``attention_backend`` setting ``requested``:
    on the CPU the torch reference while the C kernels cannot take its head dim (``auto``), or a
    ``ConfigError`` when the C kernel was asked for by name."""
    if device.type != "cpu" or requested not in ("auto", "cpu") or head_dim <= C_KERNEL_MAX_HEAD_DIM:
        return requested
    if requested == "cpu":
        raise ConfigError(f"attention backend 'cpu' cannot serve this model: its heads are {head_dim} wide, "
                          f"ricllm's C attention kernels take at most {C_KERNEL_MAX_HEAD_DIM}; use auto or torch")
    return "torch"


def c_ops(backend):
    """The C kernels of the native runtime's Gemma stack (``CpuFusedOps``) where the ``cpu`` backend runs
    bf16 activations: the norms, QK-norm and GeGLU then round exactly as there, so the two runtimes
    compute the same bits where they attend in the same kernel. None elsewhere: torch's ops."""
    ops = getattr(backend, "fused_ops", None)
    return ops if ops is not None and ops.dtype == torch.bfloat16 else None


class RMSNorm(nn.Module):
    """``x / rms(x) ⊙ g``, normalised and scaled in fp32 and cast back after, as HF's
    Gemma3RMSNorm (Llama's casts before the scale)."""

    def __init__(self, size: int, eps: float, ops=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)  # from the file, never initialised
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2:
            return self.ops.rms_norm_scaled(x.contiguous(), self.weight, self.eps)
        return (F.rms_norm(x.float(), x.shape[-1:], eps=self.eps) * self.weight.float()).to(x.dtype)


class LayerRoPE(nn.Module):
    """Each layer's RoPE: the inverse frequencies of every base the layers use, and the cos/sin
    of a step's positions computed for each base once per step. No table of every position: at
    Gemma's 32,768 positions and head dim 256 one base's table would take 64 MiB."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        local = dataclasses.replace(spec, rope_theta=spec.rope_local_theta or spec.rope_theta, rope_scaling=None)
        # the global layers' base carries the file's RoPE scaling (HF and llama.cpp scale only those)
        bases = {0: rope_inverse_frequencies(spec), 1: rope_inverse_frequencies(local)}
        self.base_of_layer = [1 if spec.layer_window(i) else 0 for i in range(spec.num_layers)]
        self.register_buffer("inv_freq", torch.stack([bases[0], bases[1]]), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(cos, sin)``, each ``[T, 1, head_dim]``, per base (index ``base_of_layer[i]``)."""
        angles = positions.float()[None, :, None] * self.inv_freq[:, None, :]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return [(cos[b], sin[b]) for b in range(cos.shape[0])]


def sliding_window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step as a sliding-window layer attends it: the query at ``p`` sees keys ``(p - w, p]``,
    ``w`` the layer's window, or the sequence's own ``kv_window`` where that is narrower (its
    blocks outside it are gone). A sequence's sinks count on the global layers only."""
    own = meta.kv_windows
    windows = torch.full_like(meta.context_lens, window)
    if own is not None:
        windows = torch.where((own > 0) & (own < window), own.to(windows.dtype), windows)
    return dataclasses.replace(meta, kv_sinks=torch.zeros_like(windows), kv_windows=windows, scratch={})


class Attention(nn.Module):
    """Grouped-query attention with QK-norm and this layer's RoPE over the paged cache."""

    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size)
        self.o_proj = Linear(spec.q_size, spec.hidden_size)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qkv_sizes = (spec.q_size, spec.kv_size, spec.kv_size)
        self.scale = spec.attention_scale
        self.backend, self.ops = backend, c_ops(backend)

    def forward(self, x, rope_cos_sin, kv_cache, meta: AttentionMetadata, lora: LoraLayerBatch | None = None):
        tokens = x.shape[0]
        qkv = adapted(self.qkv_proj, x, lora, "q", "k", "v")
        if self.ops is not None:  # QK-norm in place, as the native stack does it
            qkv = qkv.contiguous()
            self.ops.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                             self.q_norm.eps)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q, k = q.reshape(tokens, self.num_heads, self.head_dim), k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.ops is None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope_cos_sin), apply_rope(k, *rope_cos_sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return adapted(self.o_proj, out.reshape(tokens, -1), lora, "o")


class MLP(nn.Module):
    """GeGLU: ``W_down · (gelu_tanh(W_gate · x) ⊙ W_up · x)``, gate and up in one projection."""

    def __init__(self, spec: ModelSpec, ops=None):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)
        self.ops = ops

    def forward(self, x: torch.Tensor, lora: LoraLayerBatch | None = None) -> torch.Tensor:
        gate_up = adapted(self.gate_up_proj, x, lora, "gate", "up")
        if self.ops is not None:
            return adapted(self.down_proj, self.ops.gelu_tanh_mul(gate_up.contiguous()), lora, "down")
        gate, up = gate_up.chunk(2, dim=-1)
        return adapted(self.down_proj, F.gelu(gate, approximate="tanh") * up, lora, "down")


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, backend):
        super().__init__()
        self.window = spec.layer_window(index)  # 0: the layer attends to the whole sequence
        ops = c_ops(backend)
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.attn = Attention(spec, backend)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.mlp = MLP(spec, ops)
        self.post_ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(self, x, rope_cos_sin, kv_cache, meta, lora: LoraLayerBatch | None = None):
        h = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope_cos_sin, kv_cache, meta, lora))
        return h + self.post_ffn_norm(self.mlp(self.ffn_norm(h), lora))


class Gemma3Model(nn.Module):
    """The model runner's interface as ``LlamaModel``'s: ``forward`` to the final norm's hidden
    states, ``compute_logits`` for the rows that sample."""

    decoder_stack = None  # op by op here; Gemma 3's C decoder stack is the native runtime's (native_gemma3)

    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_scale = spec.hidden_size ** 0.5
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, c_ops(backend))
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size)
        self.rope = LayerRoPE(spec)
        groups = kv_cache_groups(spec)
        self.group_windows = [group.window for group in groups]
        self.group_of_layer = layer_groups(groups, spec.num_layers) if len(groups) > 1 else [0] * spec.num_layers
        self.packed_head = None  # the head in a packed weight format (``llama_weights.pack_head``)
        # adapters laid out for the C LoRA kernel where the backend offers the C ops (on the CPU), as
        # the fused Llama model's: bf16 steps then add the native stack's updates bit for bit
        self.adapters_in_c = getattr(backend, "fused_ops", None) is not None
        self.requires_grad_(False)

    @classmethod
    def build(cls, spec: ModelSpec, backend, dtype: torch.dtype, device: torch.device,
              allocate: bool = True) -> "Gemma3Model":
        """As ``LlamaModel.build``: uninitialised weights in ``dtype`` on ``device``, or left on the
        meta device (``allocate=False``) for ``gemma3_weights.load_weights`` to fill one by one."""
        with torch.device("meta"):
            model = cls(spec, backend).to(dtype)
        if allocate:
            model = model.to_empty(device=device)
        model.rope = LayerRoPE(spec).to(device)  # fp32 frequencies, whatever the weights' dtype
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. ``lora``: the step's adapters, None when
        no row has one."""
        x = self.embed(input_ids)
        x = x * x.new_tensor(self.embed_scale)  # √hidden rounded to the activations' dtype, as HF does
        rope_by_base = self.rope(positions, x.dtype)
        metas = [self._group_metadata(meta, g, window) for g, window in enumerate(self.group_windows)]
        for index, (layer, base, kv_cache, g) in enumerate(zip(self.layers, self.rope.base_of_layer, kv_caches,
                                                               self.group_of_layer)):
            x = layer(x, rope_by_base[base], kv_cache, metas[g], None if lora is None else lora.layer(index))
        return self.norm(x)

    def _group_metadata(self, meta: AttentionMetadata, group: int, window: int) -> AttentionMetadata:
        """The step through cache group ``group``'s blocks, with its layers' window (0: none)."""
        if len(self.group_windows) == 1:  # one group: every layer attends alike, through group 0
            return meta if window == 0 else sliding_window_metadata(meta, window)
        grouped = meta.for_group(group)
        return grouped if window == 0 else sliding_window_metadata(grouped, window)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self._softcapped(self.packed_head(hidden).float())
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return self._softcapped(F.linear(hidden, weight).float())

    def head_narrows(self, rows: int) -> bool:
        """As ``LlamaModel.head_narrows``: a head packed in ricllm's layout."""
        return isinstance(self.packed_head, PackedLinear) and self.packed_head.narrows(rows)

    @torch.inference_mode()
    def compute_logits_on_tiles(self, hidden: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, 16·len(tiles)]``: the logits of the head's 16-row tiles ``tiles`` only (the
        soft cap is per logit)."""
        return self._softcapped(self.packed_head.forward_tiles(hidden, tiles).float())

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
