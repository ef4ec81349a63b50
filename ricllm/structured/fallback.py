"""A constrained decision's confidence, and the answer given instead of an unsure one.

A decision's confidence is the product, over the decode steps whose constraint allowed at least
two tokens, of the temperature-1 softmax over the allowed logits at the token chosen: how much of
the model's probability, restricted to what the grammar allowed, its answer took. The model's
end tokens count as one token (ending with one or another decides nothing). Steps the grammar
forces, and steps where it allowed one token only, choose nothing and count 1. The engine computes
it (``ricllm.engine.constrained.chosen_share``) from the allowed logits as the model's head gave
them, whatever the request's temperature, top-k or top-p. An unconstrained answer has none (its
"allowed set" is the vocabulary, which says nothing of a decision).

A template (or a request) may set a ``Fallback``: when its decision's confidence is below
``min_confidence``, the request answers ``answer`` instead, with finish reason ``fallback``.
``answer`` must itself satisfy the constraint; the engine checks it with the compiled grammar
(``GrammarCompiler.answer_problem``) when the template is pinned or the request arrives.
``min_confidence`` is chosen before the answers it will judge are scored (on other rows, or from
the cost of a wrong action), never by looking at the scored rows' confidences.
"""

from __future__ import annotations

from dataclasses import dataclass

from ricllm.errors import InvalidRequestError


@dataclass(frozen=True)
class Fallback:
    min_confidence: float  # in (0, 1]: a decision below it is replaced
    answer: str

    @classmethod
    def build(cls, min_confidence: float | None, answer: str | None) -> Fallback | None:
        """From the two settings as a template or request gives them (both, or neither: None)."""
        if min_confidence is None and answer is None:
            return None
        if min_confidence is None or answer is None:
            missing = "fallback" if answer is None else "min_confidence"
            raise InvalidRequestError(f"min_confidence and fallback go together: {missing} is missing")
        if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) \
                or not 0 < min_confidence <= 1:
            raise InvalidRequestError(f"min_confidence must be a number in (0, 1], got {min_confidence!r}")
        if not isinstance(answer, str) or not answer:
            raise InvalidRequestError(f"fallback must be a non-empty answer text, got {answer!r}")
        return cls(float(min_confidence), answer)

    def replaces(self, confidence: float | None) -> bool:
        """Whether a decision of this confidence is answered with the fallback."""
        return confidence is not None and confidence < self.min_confidence
