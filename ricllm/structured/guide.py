"""One request's place in its grammar, and the token masks of a batch's constrained rows.

A row without a constraint never reaches this module: it pays nothing. A mask is built only for
a constrained row that samples this step and needs one (``ConstrainedDecoding.sample``); the runtime
applies it to the row's logits (``Runtime.mask``), so a constrained answer can only ever be a
prefix of a valid one.
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

    def allows(self, token_id: int) -> bool:
        return self.matcher.validate_tokens([token_id]) == 1

    @property
    def is_complete(self) -> bool:
        """The answer is whole: the grammar allows nothing but the end."""
        return self.matcher.is_stopped()

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)


def allowed_tokens(guides: list[Guide], vocab_size: int) -> np.ndarray:
    """``[len(guides), vocab_size]`` booleans: which tokens each guide allows next.

    Ids past the grammar's tokenizer (a padded embedding) are never allowed. The masks are filled
    one after the other on the engine's thread: llguidance's thread pool was slower on a few cores,
    its threads taking CPU time from the model's (``benchmarks/bench_decisions.py``).
    """
    width = guides[0].grammar.fresh_vocab_size
    bitmask = np.zeros((len(guides), (width + 31) // 32), dtype=np.int32)
    for row, guide in enumerate(guides):
        guide.fill_mask(bitmask, row)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=min(width, vocab_size), bitorder="little")
    if bits.shape[1] == vocab_size:
        return bits.view(bool)
    allowed = np.zeros((len(guides), vocab_size), dtype=bool)
    allowed[:, :bits.shape[1]] = bits
    return allowed
