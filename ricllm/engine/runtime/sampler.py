"""Next-token choice from the last position's logits: greedy rows in one argmax, sampled rows
one by one with their own generator (so a seeded request is reproducible in any batch)."""

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


@torch.inference_mode()
def mask(logits: torch.Tensor, rows: list[int], allowed) -> torch.Tensor:
    """Forbid the tokens a row's constraint does not allow (``allowed``: numpy booleans ``[len(rows), vocab]``)."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    forbidden = ~torch.from_numpy(allowed).to(logits.device)
    logits[index] = logits.index_select(0, index).masked_fill(forbidden, float("-inf"))
    return logits


@torch.inference_mode()
def allowed_logits(logits: torch.Tensor, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """``logits[rows[i], token_ids[i]]`` for each i, as float64 on the host: one index and one copy
    from the device, whatever the number of rows."""
    flat = torch.from_numpy(rows * logits.shape[-1] + token_ids).to(logits.device)
    return logits.reshape(-1).index_select(0, flat).double().cpu().numpy()
