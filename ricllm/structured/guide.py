"""One request's place in its grammar, and the tokens it allows next.

A row without a constraint never reaches this module: it pays nothing. A constrained row that
samples this step gets its allowed token ids (``allowed_ids``) before the model's head runs, so
the head computes only their logits where that is cheaper, and its sampler sees only them
(``ricllm.engine.runtime.narrow_head``): a constrained answer can only ever be a prefix of a valid one.
"""

from __future__ import annotations

import numpy as np

from ricllm.structured.compiler import CompiledGrammar


class Guide:
    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.matcher = grammar.new_matcher()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows next whatever is sampled (the fixed skeleton of the answer)."""
        return self.matcher.compute_ff_tokens()

    def accept(self, token_ids: list[int]) -> None:
        if not self.matcher.consume_tokens(token_ids):  # only on a bug: the mask allowed these tokens
            raise RuntimeError(f"grammar refused tokens it allowed: {self.matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """The answer is whole: the grammar allows nothing but the end."""
        return self.matcher.is_stopped()

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)


def allowed_ids(guide: Guide, vocab_size: int) -> np.ndarray:
    """The token ids ``guide`` allows next, ascending (int64). Ids past the model's vocabulary (a
    grammar tokenizer wider than the head) are never allowed.

    Only the mask's nonzero words are unpacked: a grammar usually allows a handful of tokens, and
    Gemma 3's mask is 8,192 words. Masks are filled one after the other on the engine's thread:
    llguidance's thread pool was slower on a few cores, its threads taking CPU time from the
    model's (``benchmarks/bench_decisions.py``).
    """
    bitmask = np.zeros((1, (guide.grammar.fresh_vocab_size + 31) // 32), dtype=np.int32)
    guide.fill_mask(bitmask, 0)
    words = np.flatnonzero(bitmask[0])
    bits = np.unpackbits(bitmask[0, words].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    word, bit = np.nonzero(bits)
    ids = words[word].astype(np.int64) * 32 + bit
    return ids[ids < vocab_size]
