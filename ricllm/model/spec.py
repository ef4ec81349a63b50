"""The shape of a model (the Llama family, Gemma 3), read from a file's metadata."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """``linear`` divides positions by ``factor``; ``llama3`` rescales low frequencies (Llama 3.1)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """``architecture`` names the network: ``llama`` (Llama, SmolLM2, Mistral) or ``gemma3``.

    The fields after ``name`` are Gemma 3's: ``layer_windows`` holds each layer's sliding window
    (0: the layer attends to the whole sequence; empty: every layer does), ``rope_local_theta``
    the RoPE base of the windowed layers (``rope_theta`` stays the global layers'),
    ``query_pre_attn_scalar`` the attention scale's ``s`` in ``s^-1/2`` (None: ``head_dim``) and
    ``final_logit_softcapping`` the ``c`` of ``c·tanh(logits / c)`` (None: none).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    name: str = ""
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelSpec":
        """The inverse of ``dataclasses.asdict``: what the weight caches store."""
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        fields["layer_windows"] = tuple(fields.get("layer_windows", ()))
        return cls(**fields)

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens; 0: it attends to the whole sequence."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers: ``2·L·n_kv·d_h·b``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        # Gemma 3 norms each sublayer's input and output, and each query and key head
        norms = 4 * h + 2 * self.head_dim if self.architecture == "gemma3" else 2 * h
        per_layer = attention + 3 * h * i + norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embeddings + h
