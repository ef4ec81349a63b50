"""The native runtime's sampler: ``sampler.py``'s rules on numpy arrays.

Greedy rows are one argmax (the first maximum, as torch's), so both runtimes choose the same
greedy tokens from the same logits. Sampled rows draw from ``numpy.random.Generator`` streams:
a seed reproduces a request within this runtime, not across runtimes.
"""

from __future__ import annotations

import numpy as np

from ricllm.sampling_params import SamplingParams


def filter_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, then top-p (nucleus) on one row of fp32 logits."""
    logits = logits / np.float32(params.temperature)
    if 0 < params.top_k < logits.shape[-1]:
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    if params.top_p < 1.0:
        order = np.argsort(-logits, kind="stable")
        probs = _softmax(logits[order])
        drop = np.cumsum(probs) - probs >= params.top_p  # keep the first token over p
        logits = logits.copy()
        logits[order[drop]] = -np.inf
    return logits


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def sample(logits: np.ndarray, params: list[SamplingParams], generators: list) -> list[int]:
    """One token id per row of ``logits [N, vocab]`` (fp32)."""
    greedy = logits.argmax(axis=-1).tolist()
    tokens = []
    for row, (p, rng) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append(greedy[row])
            continue
        cumulative = np.cumsum(_softmax(filter_logits(logits[row], p)).astype(np.float64))
        draw = rng.random() * cumulative[-1]
        tokens.append(int(min(np.searchsorted(cumulative, draw, side="right"), len(cumulative) - 1)))
    return tokens


def allowed_logits(logits: np.ndarray, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """``logits[rows[i], token_ids[i]]`` for each i, as float64."""
    return logits[rows, token_ids].astype(np.float64)


def new_generator(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def mask(logits: np.ndarray, rows: list[int], allowed: np.ndarray) -> np.ndarray:
    """Forbid the tokens a row's constraint does not allow (``allowed [len(rows), vocab]``), in place.

    A row that allows few tokens is rebuilt from them (a grammar usually allows a handful);
    one that allows most has the rest overwritten.
    """
    for row, ok in zip(rows, allowed):
        keep = np.flatnonzero(ok)
        if 2 * keep.size < ok.size:
            kept = logits[row, keep]
            logits[row] = -np.inf
            logits[row, keep] = kept
        else:
            np.putmask(logits[row], ~ok, np.float32(-np.inf))
    return logits
