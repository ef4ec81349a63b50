"""Next-token choice from the last position's logits: greedy rows in one argmax, sampled rows
one by one with their own generator (so a seeded request is reproducible in any batch); a
constrained row from its allowed tokens' logits alone (``sample_allowed``)."""

from __future__ import annotations

import numpy as np
import torch

from ricllm.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of fp32 logits."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the first over p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of ``logits [N, vocab]`` (fp32)."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append(greedy[row])
            continue
        probs = torch.softmax(filter_logits(logits[row], p), dim=-1)
        tokens.append(int(torch.multinomial(probs.cpu(), 1, generator=gen)))
    return tokens


def sample_allowed(ids: np.ndarray, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> int:
    """One of a constraint's allowed tokens ``ids`` (ascending) from their fp32 ``logits``: the first
    maximum when greedy, else one uniform draw over them in vocabulary order (``numpy_sampler``'s
    definition, on the request's torch generator), so the draw depends on the allowed tokens'
    logits alone, not on which head computed them."""
    logits = logits.cpu()
    if params.greedy:
        return int(ids[int(logits.argmax())])
    cumulative = torch.softmax(filter_logits(logits, params), dim=-1).double().cumsum(0)
    draw = torch.rand((), dtype=torch.float64, generator=generator) * cumulative[-1]
    return int(ids[min(int(torch.searchsorted(cumulative, draw, right=True)), len(ids) - 1)])
