"""One request's place in its grammar, and the token masks of a batch's constrained rows.

A row without a constraint never reaches this module: it pays nothing. The mask is built only
for the rows that sample this step and have a guide; the runtime applies it to their logits
before sampling (``Runtime.mask``), so a constrained answer can only ever be a prefix of a valid one.
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


def allowed_tokens(guides: list[Guide], vocab_size: int) -> np.ndarray:
    """``[len(guides), vocab_size]`` booleans: which tokens each guide allows next.

    Ids past the grammar's tokenizer (a padded embedding) are never allowed.
    """
    words = (guides[0].grammar.fresh_vocab_size + 31) // 32
    bitmask = np.zeros((len(guides), words), dtype=np.int32)
    for row, guide in enumerate(guides):
        guide.fill_mask(bitmask, row)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    allowed = np.zeros((len(guides), vocab_size), dtype=bool)
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    return allowed
