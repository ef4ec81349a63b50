"""The Llama-family transformer (Llama 2/3, SmolLM2, Mistral without sliding window).

One call runs a flat batch of ``T`` tokens from many sequences: prefill chunks and decode
tokens side by side. Each layer writes its new K/V into the paged cache (slots from
``meta.slot_mapping``) and attends through the block tables, so the model holds no per-sequence
state of its own.

The layers are written in torch ops, which are the reference. With the ``cpu`` attention backend
the elementwise steps (add + norm, RoPE + K/V store, SiLU·up) run as fused C calls instead
(``fused``: ``ricllm.kernels.cpu_fused.CpuFusedOps``), which compute the same values with a
fraction of the per-op overhead that dominates small decode steps; and where every projection
is packed in ricllm's layout, decode and small prefill steps run all layers in one C call
(``decoder_stack``: ``ricllm.kernels.cpu_decoder``), the same kernels in the same order.

    h = x + W_o · Attn(RoPE(W_q · n1(x)), RoPE(W_k · n1(x)), W_v · n1(x))
    y = h + W_down · (silu(W_gate · n2(h)) ⊙ W_up · n2(h)),   n(x) = x / rms(x) ⊙ g
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ricllm.attention.backends import c_kernel_attends
from ricllm.attention.metadata import AttentionMetadata
from ricllm.errors import ModelLoadError
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
    previous sublayer's output, added here so the fused path does both in one pass."""

    def __init__(self, size: int, eps: float, fused=None):
        super().__init__()
        self.weight = _uninitialised(size)
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            return x, self.fused.add_rms_norm(x, delta, self.weight, self.eps)  # x += delta in place
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


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend, fused=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size)
        self.o_proj = Linear(spec.q_size, spec.hidden_size)
        self.qk_v_sizes = (spec.q_size + spec.kv_size, spec.kv_size)
        self.scale = spec.head_dim ** -0.5
        self.backend = backend
        self.fused = fused

    def forward(self, x, rope_cos_sin, kv_cache, meta: AttentionMetadata):
        tokens = x.shape[0]
        if self.fused is not None:
            q = self.fused.rope_store(self.qkv_proj(x), *rope_cos_sin, meta.slot_mapping, *kv_cache, self.num_heads)
            out = self.backend.attend(q, kv_cache[0], kv_cache[1], meta, self.scale)
            return self.o_proj(out.view(tokens, -1))
        qk, v = self.qkv_proj(x).split(self.qk_v_sizes, dim=-1)
        # q and k heads sit side by side in the fused projection: rotate them in one pass
        qk = apply_rope(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope_cos_sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, fused=None):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend, fused=None):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fused)
        self.attn = Attention(spec, backend, fused)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fused)
        self.mlp = MLP(spec, fused)

    def forward(self, x, delta, rope_cos_sin, kv_cache, meta):
        """Residual stream ``x`` plus the last sublayer's output ``delta`` in; the same pair out."""
        x, h = self.attn_norm(x, delta)
        x, h = self.ffn_norm(x, self.attn(h, rope_cos_sin, kv_cache, meta))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend):
        super().__init__()
        self.spec = spec
        fused = getattr(backend, "fused_ops", None)
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, fused) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, fused)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size)
        self.rope = RotaryEmbedding(rope_inverse_frequencies(spec), spec.max_position_embeddings)
        self.packed_head = None
        self.decoder_stack = None  # set by enable_decoder_stack()
        self.weight_device: torch.device | None = None  # where load_weights places weights (build sets it)
        self.requires_grad_(False)

    @classmethod
    def build(cls, spec: ModelSpec, backend, dtype: torch.dtype, device: torch.device,
              allocate: bool = True) -> "LlamaModel":
        """Uninitialised weights in ``dtype`` on ``device`` (no random init). ``allocate=False``
        leaves them on the meta device: :meth:`load_weights` then gives each its memory as it
        arrives, so that a converting start never holds the whole dense model at once."""
        with torch.device("meta"):
            model = cls(spec, backend).to(dtype)
        if allocate:
            model = model.to_empty(device=device)
        model.weight_device = device
        model.rope = RotaryEmbedding(rope_inverse_frequencies(spec), spec.max_position_embeddings).to(device)
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm."""
        x, delta = self.embed(input_ids), None
        rope_cos_sin = self.rope(positions, x.dtype)
        if self.decoder_stack is not None and self.decoder_stack.accepts(x, c_kernel_attends(meta)
                                                                         or meta.kv_windows is not None):
            return self.decoder_stack(x, *rope_cos_sin, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta = layer(x, delta, rope_cos_sin, kv_cache, meta)
        return self.norm(x, delta)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def pack_weights(self, layer_format: str, head_format: str, max_packed_rows: int | None) -> None:
        """Swap the projections for weight-only quantized ones (``"dense"`` leaves them)."""
        for index in range(len(self.layers)):
            self.pack_layer(index, layer_format, max_packed_rows)
        self.pack_head(head_format, max_packed_rows)

    def pack_layer(self, index: int, fmt: str, max_packed_rows: int | None) -> None:
        """Pack one layer's four projections; their dense weights go unless kept for large batches."""
        layer = self.layers[index]
        layer.attn.qkv_proj = _packed(layer.attn.qkv_proj, fmt, max_packed_rows)
        layer.attn.o_proj = _packed(layer.attn.o_proj, fmt, max_packed_rows)
        layer.mlp.gate_up_proj = _packed(layer.mlp.gate_up_proj, fmt, max_packed_rows)
        layer.mlp.down_proj = _packed(layer.mlp.down_proj, fmt, max_packed_rows)

    def pack_head(self, fmt: str, max_packed_rows: int | None) -> None:
        from ricllm.model.packed_linear import head_max_packed_rows

        if fmt == "dense":
            return
        head = self.embed if self.lm_head is None else self.lm_head
        head_rows = head_max_packed_rows(max_packed_rows)
        # a tied head's bf16 copy is the embedding itself: no second copy in memory
        shared = self.embed.weight if head is self.embed and self.embed.weight.dtype == torch.bfloat16 else None
        self.packed_head = _packed(head, fmt, head_rows, shared)
        if self.lm_head is not None:
            self.lm_head = None  # the packed head keeps its own dense copy
        elif head_rows is None:
            self.serve_embedding_from_head()

    def serve_embedding_from_head(self) -> bool:
        """Drop a tied embedding's dense copy when the packed head (kept packed at every size)
        gives exactly its rows: lookups dequantize them (``PackedEmbedding``)."""
        from ricllm.model.packed_linear import PackedEmbedding, PackedLinear

        head, dense = self.packed_head, getattr(self.embed, "weight", None)
        if not isinstance(head, PackedLinear) or head.weight is not None or dense is None:
            return False
        if not PackedEmbedding.serves(head, dense):
            return False
        self.embed = PackedEmbedding(head, dense.dtype)
        return True

    def enable_decoder_stack(self) -> bool:
        """Run decode steps through one C call for all layers (``ricllm.kernels.cpu_decoder``),
        the same kernels as the per-op path without its Python work. It applies when the layers
        use the fused C ops and every projection is packed in ricllm's own layout. Steps above
        the projections' ``max_packed_rows`` (dense bf16 there) and steps the C attention kernel
        does not serve (large prefills: SDPA) keep the per-op path. Returns whether it is on."""
        from ricllm.kernels.cpu_decoder import CpuDecoderStack, PackedProjection, StackLayer
        from ricllm.model.packed_linear import PackedLinear

        def own(m) -> bool:
            return isinstance(m, PackedLinear) and m.layout == "vnni"

        projections = [p for layer in self.layers for p in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if self.layers[0].attn.fused is None or not all(map(own, projections)):
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

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]],
                     on_layer_loaded: Callable[[int], None] | None = None) -> None:
        """Copy ricllm-named tensors in, fusing q/k/v and gate/up as they arrive.
        ``on_layer_loaded(i)`` runs as soon as layer ``i`` has all its weights (to pack it then)."""
        pending: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        parts_left = [len(LAYER_PARTS)] * len(self.layers)
        for name, tensor in tensors:
            if name == "rope_freqs":
                self._set_rope(rope_inverse_frequencies(self.spec, tensor))
                continue
            for target in self._assign(name, tensor, pending):
                loaded.add(target)
                if target.startswith("layers."):
                    index = int(target.split(".")[1])
                    parts_left[index] -= 1
                    if parts_left[index] == 0 and on_layer_loaded is not None:
                        on_layer_loaded(index)
        self._check_complete(loaded)

    def _set_rope(self, inv_freq: torch.Tensor) -> None:
        device = self.rope.cos.device
        self.rope = RotaryEmbedding(inv_freq, self.spec.max_position_embeddings).to(device)

    def _assign(self, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]) -> list[str]:
        if not name.startswith("layers."):
            return self._assign_global(name, tensor)
        _, index, part = name.split(".")
        layer = self.layers[int(index)]
        fused = {"q": ("qkv", ("q", "k", "v")), "k": ("qkv", ("q", "k", "v")), "v": ("qkv", ("q", "k", "v")),
                 "gate": ("gate_up", ("gate", "up")), "up": ("gate_up", ("gate", "up"))}
        if part in fused:
            group, members = fused[part]
            pending[f"{index}.{part}"] = tensor
            if not all(f"{index}.{m}" in pending for m in members):
                return []
            tensor = torch.cat([pending.pop(f"{index}.{m}") for m in members], dim=0)
            self._place(layer.attn.qkv_proj if group == "qkv" else layer.mlp.gate_up_proj, tensor, name)
            return [f"layers.{index}.{group}"]
        owners = {"attn_norm": layer.attn_norm, "ffn_norm": layer.ffn_norm, "o": layer.attn.o_proj,
                  "down": layer.mlp.down_proj}
        self._place(owners[part], tensor, name)
        return [f"layers.{index}.{part}"]

    def _assign_global(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name == "lm_head" and self.lm_head is None:
            return []  # a checkpoint may ship an explicit copy of a tied head
        self._place({"embed": self.embed, "norm": self.norm, "lm_head": self.lm_head}[name], tensor, name)
        return [name]

    def _place(self, owner: nn.Module, tensor: torch.Tensor, name: str) -> None:
        """``owner.weight = tensor`` in the weight's dtype: copied into allocated memory, or given
        new memory when the model was built without (``build(allocate=False)``)."""
        target = owner.weight
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} from the metadata")
        with torch.no_grad():
            if target.is_meta:  # copy=True: a float32 file tensor may be a read-only view of the file
                owner.weight = nn.Parameter(tensor.to(self.weight_device, target.dtype, copy=True),
                                            requires_grad=False)
            else:
                target.copy_(tensor)

    def _check_complete(self, loaded: set[str]) -> None:
        expected = {"embed", "norm"} | ({"lm_head"} if self.lm_head is not None else set())
        for i in range(self.spec.num_layers):
            expected |= {f"layers.{i}.{p}" for p in LAYER_PARTS}
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"model file lacks weight(s): {', '.join(missing[:5])}")


LAYER_PARTS = ("qkv", "gate_up", "attn_norm", "ffn_norm", "o", "down")


def _packed(linear: nn.Module, fmt: str, max_rows: int | None, shared: torch.Tensor | None = None) -> nn.Module:
    """``linear`` as a ``PackedLinear`` in ``fmt``, or itself where ``fmt`` is dense or the shape
    does not pack. The packers read the weight a slice at a time in fp32."""
    from ricllm.model.packed_linear import PackedLinear, can_pack

    if fmt == "dense" or not can_pack(linear.weight, fmt):
        return linear
    return PackedLinear.pack(linear.weight, fmt, max_rows, shared)
