"""LoRA updates for a batch of rows grouped by adapter, in torch: the reference for the GPU path, the
same product as the CPU kernel (``ricllm/kernels/cpu_lora.py``, ``kernels/cpu_lora.c``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_delta(x: torch.Tensor, segments: Sequence[tuple[int, int, int]],
               adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]], out_features: int) -> torch.Tensor:
    """What one projection's adapters add to its output ``[rows, out_features]``, fp32.

    ``x [rows, in]`` is the projection's input. Segment ``(start, end, i)`` gives rows
    ``[start, end)`` adapter ``i``'s update ``scale · (x · Aᵀ) · Bᵀ``, where ``adapters[i]`` is
    ``(A [rank, in], B [out, rank], scale)`` on ``x``'s device; rows no segment covers get zeros.
    Products are taken in fp32 whatever ``x``'s type, as the CPU kernel takes them."""
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for start, end, index in segments:
        a, b, scale = adapters[index]
        low_rank = x[start:end].float() @ a.float().T
        delta[start:end] = (low_rank * scale) @ b.float().T
    return delta
