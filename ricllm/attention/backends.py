"""Attention backends behind one interface: write this step's K/V, then attend over the cache.

``torch`` is the reference and runs anywhere; ``triton`` and ``cuda`` use the GPU decode kernels
from ``ricllm.kernels`` for decode-only steps and the reference (SDPA over the gathered cache)
for prefill.
"""

from __future__ import annotations

import torch

from ricllm.attention import reference
from ricllm.attention.metadata import AttentionMetadata
from ricllm.errors import ConfigError

BACKENDS = ("auto", "torch", "triton", "cuda")


class TorchAttention:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)


class KernelAttention:
    """GPU kernels for the bandwidth-bound decode; prefill stays on SDPA."""

    def __init__(self, name: str, store_kv, decode):
        self.name = name
        self._store_kv = store_kv
        self._decode = decode

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.is_decode_only:
            return reference.paged_attention(q, k_cache, v_cache, meta, scale)
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                            meta.max_context_len)


def select_backend(name: str, device: torch.device):
    """``auto`` picks Triton on CUDA (when importable) and the torch reference elsewhere."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttention()
    if device.type != "cuda":
        raise ConfigError(f"attention backend {name!r} needs a CUDA device, but the engine runs on {device}")
    from ricllm import kernels

    if name in ("auto", "triton"):
        ok, reason = kernels.triton_available()
        if ok:
            return KernelAttention("triton", kernels.store_kv, kernels.paged_decode_attention)
        if name == "triton":
            raise ConfigError(f"attention backend 'triton' is not available: {reason}")
        return TorchAttention()
    from ricllm.kernels import cuda_ext

    return KernelAttention("cuda", kernels.store_kv, cuda_ext.paged_decode_attention)
