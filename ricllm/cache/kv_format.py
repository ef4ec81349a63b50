"""How one row of K or V (one token, one KV head) is stored: in the activations' type, or as int8.

An int8 row is ``head_dim`` signed bytes followed by its fp32 scale, ``max|x| / 127``, in one row of
``head_dim + 4`` bytes (the cache tensors are then raw bytes, ``uint8``). The scale sits in the row
rather than in a tensor of its own so that a layer's cache stays one (K, V) pair addressed by the
same slot arithmetic: every kernel that finds a bf16 row finds an int8 row and its scale with the
row size changed. One scale per (token, head) row, not per block or per tensor: a row is written
once, when its token is computed, and never rescaled when a later token is larger.

    bytes per token = 2 · L · n_kv · (d_h · b + s)     b = element bytes, s = scale bytes per row

For SmolLM2 (d_h = 64) an int8 row is 68 bytes against bf16's 128: 1.88x the tokens per byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ricllm.errors import ConfigError
from ricllm.model.spec import ModelSpec

if TYPE_CHECKING:  # only the torch runtime quantizes in Python; the native one does it in C
    import torch

INT8_MAX = 127
SCALE_BYTES = 4  # one fp32 scale per int8 row
KV_CACHE_DTYPES = ("auto", "int8")
ACTIVATION_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class KVFormat:
    """The element type of the whole pool (one per engine), and what a row of it costs."""

    name: str           # "bfloat16", "float16", "float32" (the activations' type) or "int8"
    element_bytes: int
    scale_bytes: int = 0  # per row, after its elements

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.element_bytes + self.scale_bytes

    def bytes_per_token(self, spec: ModelSpec) -> int:
        """``2·L·n_kv·(d_h·b + s)``: K and V of one token in every layer."""
        return 2 * spec.num_layers * spec.num_kv_heads * self.row_bytes(spec.head_dim)

    def equation(self, spec: ModelSpec, num_layers: int | None = None) -> str:
        """The product written out over ``num_layers`` (a cache group's; None: every layer), for
        error messages and logs."""
        row = f"({spec.head_dim}·{self.element_bytes}+{self.scale_bytes})" if self.quantized \
            else f"{spec.head_dim}·{self.element_bytes}"
        layers = spec.num_layers if num_layers is None else num_layers
        return f"2·L·n_kv·{'(d_h·b+s)' if self.quantized else 'd_h·b'} = 2·{layers}·{spec.num_kv_heads}·{row}"


def kv_format(kv_cache_dtype: str, activation_dtype: str) -> KVFormat:
    """``kv_cache_dtype`` as the engine settings give it (``auto``: the activations' type)."""
    if kv_cache_dtype == "int8":
        return KVFormat("int8", 1, SCALE_BYTES)
    if kv_cache_dtype != "auto":
        raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    name = activation_dtype.removeprefix("torch.")
    return KVFormat(name, ACTIVATION_BYTES[name])


# ------------------------------------------------------------------ int8 rows in torch (the reference)

def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` (any float type) -> int8 rows with their scale, ``uint8 [..., d + 4]``.

    Symmetric, per row: ``q = round(x / s)`` with ``s = max|x| / 127`` in fp32 (round half to even,
    as the C kernels' ``lrintf``); an all-zero row stores scale 0."""
    import torch

    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inverse).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [..., d + 4]`` int8 rows -> ``[..., d]`` in ``dtype`` (``q · s`` in fp32, then rounded)."""
    import torch

    head_dim = rows.shape[-1] - SCALE_BYTES
    q = rows[..., :head_dim].view(torch.int8).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (q * scale).to(dtype)
