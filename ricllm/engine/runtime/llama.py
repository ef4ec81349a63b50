"""The Llama-family transformer (Llama 2/3, SmolLM2, Mistral without sliding window), as the math:

    x = embed(ids)
    for each layer:  h = x + W_o · Attn(RoPE(W_q · n1(x)), RoPE(W_k · n1(x)), W_v · n1(x))
                     x = h + W_down · (silu(W_gate · n2(h)) ⊙ W_up · n2(h))
    logits = head(n(x)),   n(x) = x / rms(x) ⊙ g

One call runs a flat batch of ``T`` tokens from many sequences: prefill chunks and decode
tokens side by side. Each layer writes its new K/V into the paged cache (slots from
``meta.slot_mapping``) and attends through the block tables (grouped-query: ``num_kv_heads``
K/V heads serve ``num_heads`` query heads), so the model holds no per-sequence state of its own.
Each residual add is done by the norm that follows it (``RMSNorm(x, delta)``), so that a fused
norm can do both in one pass.

With LoRA adapters each projection ``W`` of a row served under adapter ``s`` is ``W + scale_s·B_s·A_s``:
the step's adapters (``lora``, next to ``meta``; None when no row has one) add
``scale_s · (x · A_sᵀ) · B_sᵀ`` to the rows of their segments (``adapted``), on the columns each
projection has in a fused output.

These torch ops are the reference. Weights come in through ``llama_weights`` (loading, fusing
q/k/v and gate/up, packing); with ricllm's C kernels, ``llama_fused`` swaps in modules that
compute the same values in fewer calls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ricllm.attention.metadata import AttentionMetadata
from ricllm.engine.runtime.lora_delta import LoraBatch, LoraLayerBatch
from ricllm.model.packed_linear import PackedLinear
from ricllm.model.spec import ModelSpec, RopeScaling


def _uninitialised(*shape: int) -> nn.Parameter:
    # Weights always come from a file (or the weight cache): random init would be wasted work,
    # and on the meta device it imports torch's reference decompositions (seconds at start).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x Wᵀ`` without bias or initialisation (``nn.Linear`` initialises at construction)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _uninitialised(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _uninitialised(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Pre-norm on the residual stream: ``(x + delta, n(x + delta))``, where ``delta`` is the
    previous sublayer's output (None before the first)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _uninitialised(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x = x + delta
        # Normalise in fp32 and scale after casting back, as HF does: torch's fused bf16 rms_norm
        # loses enough precision to change SmolLM2's greedy answers.
        return x, self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inverse_frequencies(spec: ModelSpec, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """``θ^(-2i/d)`` for ``i < d/2``, rescaled as the model's RoPE scaling asks."""
    dim = spec.head_dim
    # explicit CPU: the model may be built under a meta-device context
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = spec.rope_scaling
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.double()
    elif scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq.float()


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    ramped = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, ramped, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table built once for every position the model allows."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int):
        super().__init__()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [T, 1, head_dim]`` for the step's positions, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def adapted(projection: nn.Module, x: torch.Tensor, lora: LoraLayerBatch | None, *names: str) -> torch.Tensor:
    """``projection(x)``, plus the step's adapter updates of the projections ``names`` it fuses."""
    y = projection(x)
    return y if lora is None else lora.add(names, x, y)


class Attention(nn.Module):
    """Grouped-query attention with RoPE over the paged cache: the backend stores this step's K/V
    and attends through the block tables."""

    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size)
        self.o_proj = Linear(spec.q_size, spec.hidden_size)
        self.qk_v_sizes = (spec.q_size + spec.kv_size, spec.kv_size)
        self.scale = spec.head_dim ** -0.5
        self.backend = backend

    def forward(self, x, rope_cos_sin, kv_cache, meta: AttentionMetadata, lora: LoraLayerBatch | None = None):
        tokens = x.shape[0]
        qk, v = adapted(self.qkv_proj, x, lora, "q", "k", "v").split(self.qk_v_sizes, dim=-1)
        # q and k heads sit side by side in the fused projection: rotate them in one pass
        qk = apply_rope(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope_cos_sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return adapted(self.o_proj, out.reshape(tokens, -1), lora, "o")


class MLP(nn.Module):
    """SwiGLU: ``W_down · (silu(W_gate · x) ⊙ W_up · x)``, gate and up in one projection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, lora: LoraLayerBatch | None = None) -> torch.Tensor:
        gate, up = adapted(self.gate_up_proj, x, lora, "gate", "up").chunk(2, dim=-1)
        return adapted(self.down_proj, F.silu(gate) * up, lora, "down")


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, backend)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, delta, rope_cos_sin, kv_cache, meta, lora: LoraLayerBatch | None = None):
        """Residual stream ``x`` plus the last sublayer's output ``delta`` in; the same pair out."""
        x, h = self.attn_norm(x, delta)
        x, h = self.ffn_norm(x, self.attn(h, rope_cos_sin, kv_cache, meta, lora))
        return x, self.mlp(h, lora)


class LlamaModel(nn.Module):
    decoder_stack = None  # the steps run whole in one kernel call: only a fused model has one (``llama_fused``)

    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size)
        self.rope = RotaryEmbedding(rope_inverse_frequencies(spec), spec.max_position_embeddings)
        self.packed_head = None  # the head in a packed weight format (``llama_weights.pack_head``)
        self.requires_grad_(False)

    @classmethod
    def build(cls, spec: ModelSpec, backend, dtype: torch.dtype, device: torch.device,
              allocate: bool = True) -> "LlamaModel":
        """Uninitialised weights in ``dtype`` on ``device`` (no random init). ``allocate=False``
        leaves them on the meta device: ``llama_weights.load_weights`` then gives each its memory
        as it arrives, so that a converting start never holds the whole dense model at once."""
        with torch.device("meta"):
            model = cls(spec, backend).to(dtype)
        if allocate:
            model = model.to_empty(device=device)
        model.rope = RotaryEmbedding(rope_inverse_frequencies(spec), spec.max_position_embeddings).to(device)
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        x = self.embed(input_ids)
        return self.decode(x, self.rope(positions, x.dtype), kv_caches, meta, lora)

    def decode(self, x: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
               lora: LoraBatch | None = None) -> torch.Tensor:
        """The layers, then the final norm, over the embedded tokens ``x``."""
        delta = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, delta = layer(x, delta, rope_cos_sin, kv_cache, meta, None if lora is None else lora.layer(index))
        return self.norm(x, delta)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def head_narrows(self, rows: int) -> bool:
        """Whether ``compute_logits_on_tiles`` gives each logit as ``compute_logits`` does for up to
        ``rows`` rows: a head packed in ricllm's layout (``PackedLinear.narrows``)."""
        return isinstance(self.packed_head, PackedLinear) and self.packed_head.narrows(rows)

    @torch.inference_mode()
    def compute_logits_on_tiles(self, hidden: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, 16·len(tiles)]``: the logits of the head's 16-row tiles ``tiles`` only."""
        return self.packed_head.forward_tiles(hidden, tiles).float()
