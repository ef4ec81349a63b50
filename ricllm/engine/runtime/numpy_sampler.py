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
    return [greedy[row] if p.greedy else _draw(logits[row], p, rng)
            for row, (p, rng) in enumerate(zip(params, generators))]


def sample_allowed(ids: np.ndarray, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """One of a constraint's allowed tokens ``ids`` (ascending) from their fp32 ``logits``: the first
    maximum when greedy, else one uniform draw over them in vocabulary order, as ``sample`` draws
    over the vocabulary (the tokens outside ``ids`` have no probability to draw)."""
    return int(ids[int(logits.argmax()) if params.greedy else _draw(logits, params, rng)])


def _draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The index one uniform draw picks on the cumulative distribution of a row of logits."""
    cumulative = np.cumsum(_softmax(filter_logits(logits, params)).astype(np.float64))
    draw = rng.random() * cumulative[-1]
    return int(min(np.searchsorted(cumulative, draw, side="right"), len(cumulative) - 1))


def new_generator(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)
