"""Constrained decoding: each constraint compiled once, each constrained request's place in its
grammar, the tokens its grammar forces, and the tokens it allows next, from whose logits alone it
samples (the runner computes only those where that is cheaper: ``runtime.narrow_head``).

A constraint is compiled once per engine and cached by its text (``StructuredSpec.key``, the hash
of its canonical JSON), so a template's requests, and a request the server checked at receipt,
find it compiled. A request without a constraint costs one ``is None`` here per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ricllm.engine.runtime.interface import Runtime
from ricllm.engine.runtime.narrow_head import StepLogits
from ricllm.errors import InvalidRequestError
from ricllm.model.tokenizer import Tokenizer
from ricllm.outputs import Rejection
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence
from ricllm.structured.fallback import Fallback
from ricllm.structured.spec import StructuredSpec

if TYPE_CHECKING:  # llguidance is imported with the first constraint, not with the engine
    from ricllm.structured.compiler import CompiledGrammar


class ConstrainedDecoding:
    """The engine's grammars: ``compile`` (cached), ``start`` a request on its grammar, ``force_start``
    and ``advance`` it (appending the tokens the grammar forces), the tokens each row is ``allowed``
    next, ``sample`` a step's tokens.

    Invariant: a constrained request's ``token_ids`` past its prompt are always a prefix of an
    answer its grammar accepts, and its ``guide`` has consumed exactly those tokens.
    """

    def __init__(self, tokenizer: Tokenizer, runtime: Runtime, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.max_model_len = max_model_len
        self._end_ids = np.fromiter(tokenizer.eos_token_ids, dtype=np.int64)  # one outcome for confidence
        self._compiler = None  # a GrammarCompiler, built with the first constraint (llguidance's bridge costs ~0.2 s)
        self._good_fallbacks: set[tuple[str, str]] = set()  # (constraint key, answer) found to satisfy it

    @property
    def num_compiled(self) -> int:
        """Constraints compiled so far (a cached one is not compiled again)."""
        return self._compiler.num_compiled if self._compiler is not None else 0

    def compile(self, spec: StructuredSpec | Mapping[str, Any]) -> CompiledGrammar:
        """The compiled constraint, from the cache when its text was compiled before;
        ``InvalidRequestError`` (a ``ValueError``) names what cannot be compiled."""
        if self._compiler is None:
            from ricllm.structured.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer)
        return self._compiler.compile(StructuredSpec.parse(spec))

    def grammar_of(self, params: SamplingParams, compiled: CompiledGrammar | None = None) -> CompiledGrammar | None:
        """The request's compiled constraint (None without one): ``compiled`` when the caller
        compiled it already, else compiled (or found in the cache) now; its ``fallback`` checked
        against it."""
        if params.structured is None:
            return None
        if compiled is None or compiled.spec != params.structured:
            compiled = self.compile(params.structured)
        if params.fallback is not None:
            self.check_fallback(compiled, params.fallback)
        return compiled

    def check_fallback(self, grammar: CompiledGrammar, fallback: Fallback) -> None:
        """``InvalidRequestError`` naming the problem unless the fallback is a whole answer the
        grammar accepts (checked once per constraint and answer)."""
        if (grammar.spec.key, fallback.answer) in self._good_fallbacks:
            return
        problem = self._compiler.answer_problem(grammar, fallback.answer)
        if problem is not None:
            raise InvalidRequestError(f"fallback {fallback.answer!r} does not satisfy the {grammar.spec.kind} "
                                      f"constraint: {problem}")
        self._good_fallbacks.add((grammar.spec.key, fallback.answer))

    def start(self, seq: Sequence, grammar: CompiledGrammar) -> Rejection | None:
        """Put ``seq`` at the start of its grammar. A ``max_tokens`` shorter than any complete answer
        is refused (it could only end as invalid output); one longer than the longest is capped."""
        from ricllm.structured.guide import Guide

        seq.guide = Guide(grammar)
        seq.confidence = 1.0  # no decision taken yet
        seq.min_output_tokens = grammar.min_tokens
        requested = seq.params.max_tokens
        if requested < grammar.min_tokens:
            return Rejection(
                "OUTPUT_TOO_SHORT", f"max_tokens {requested} is shorter than the shortest complete answer "
                f"the constraint allows ({grammar.min_tokens} tokens); it would end as invalid output",
                {"max_tokens": requested, "shortest_answer_tokens": grammar.min_tokens})
        if grammar.max_tokens is not None and grammar.max_tokens < requested:
            seq.params = replace(seq.params, max_tokens=grammar.max_tokens)  # admission plans with the bound
        return None

    def force_start(self, seq: Sequence) -> None:
        """Append the answer's forced start (prefilled with the prompt)."""
        if seq.guide is not None:
            seq.num_forced_at_arrival = len(self._append_forced(seq))

    def advance(self, seq: Sequence, token: int) -> list[int]:
        """Feed a sampled token to the grammar; append and return what it then forces."""
        seq.guide.accept([token])
        return self._append_forced(seq)

    def _append_forced(self, seq: Sequence) -> list[int]:
        """The grammar's forced tokens, appended without sampling: the next step computes them as one chunk."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        forced = seq.guide.forced_tokens()[:max(room, 0)]
        seq.guide.accept(forced)
        seq.token_ids += forced
        seq.num_forced_tokens += len(forced)
        return forced

    def allowed(self, ready: list[Sequence]) -> list[np.ndarray | None] | None:
        """Per row about to sample, the token ids its grammar allows next (ascending; None: no
        constraint), for the runner to compute only their logits; None when no row has a constraint."""
        if all(seq.guide is None for seq in ready):
            return None
        from ricllm.structured.guide import allowed_ids

        vocab_size = self.runtime.spec.vocab_size
        return [None if seq.guide is None else allowed_ids(seq.guide, vocab_size) for seq in ready]

    def sample(self, logits: Any, ready: list[Sequence]) -> list[int]:
        """One token per row; a constrained row's token is one its grammar allows, and its step
        multiplies its decision's confidence (``ricllm.structured.fallback``).

        ``logits``: the runner's ``[N, vocab]`` when no row is constrained, else its ``StepLogits``.
        Unconstrained rows sample from the model's own logits; each constrained row from its allowed
        tokens' logits alone (``Runtime.sample_allowed``: the first maximum when greedy, else one
        uniform draw over the allowed ids in vocabulary order), so the k-wide head and the whole
        head choose alike.
        """
        params, generators = [s.params for s in ready], [s.generator for s in ready]
        if not isinstance(logits, StepLogits):
            return self.runtime.sample(logits, params, generators)
        tokens = [0] * len(ready)
        rows, full = logits.unconstrained()
        if rows:
            sampled = self.runtime.sample(full, [params[r] for r in rows], [generators[r] for r in rows])
            for row, token in zip(rows, sampled):
                tokens[row] = token
        for row, allowed in logits.allowed.items():
            tokens[row] = self.runtime.sample_allowed(allowed.ids, allowed.logits, params[row], generators[row])
        self._multiply_confidence(logits, ready, tokens)
        return tokens

    def _multiply_confidence(self, logits: StepLogits, ready: list[Sequence], tokens: list[int]) -> None:
        """Each constrained row's confidence times this step's share of its chosen token."""
        rows = list(logits.allowed)
        ids = [np.asarray(logits.allowed[r].ids, dtype=np.int64) for r in rows]
        values = [_on_host(logits.allowed[r].logits) for r in rows]
        for row, share in zip(rows, decision_shares(ids, values, [tokens[r] for r in rows], self._end_ids)):
            if share is not None:  # one outcome allowed: nothing was decided
                ready[row].confidence *= share


def computed_head_rows(logits: Any, rows: int) -> float:
    """The rows the runner's head computed for ``rows`` sampled rows, each by its share of the
    vocabulary: all whole, unless its ``StepLogits`` narrowed some."""
    return logits.head_rows if isinstance(logits, StepLogits) else float(rows)


def _on_host(values: Any) -> np.ndarray:
    """A runtime's logits (numpy, or a torch tensor on any device) as float64 numpy."""
    return np.asarray(values.cpu() if hasattr(values, "cpu") else values, dtype=np.float64)


def decision_shares(allowed_ids: list[np.ndarray], allowed_logits: list[np.ndarray], chosen: list[int],
                    end_ids: np.ndarray) -> list[float | None]:
    """Each row's factor of its decision's confidence this step: the temperature-1 softmax over its
    allowed logits (``allowed_logits[i]`` at ``allowed_ids[i]``, ascending, float64) at its
    ``chosen`` token, which is one of them. The model's end tokens count as one outcome (ending the
    answer with one or another decides nothing); a row that allowed fewer than two outcomes gets
    None. One pass over the batch, whatever its rows."""
    counts = np.array([len(ids) for ids in allowed_ids])
    starts = np.cumsum(counts) - counts
    token_ids, values = np.concatenate(allowed_ids), np.concatenate(allowed_logits)
    row_of = np.repeat(np.arange(len(counts)), counts)
    weights = np.exp(values - np.maximum.reduceat(values, starts)[row_of])
    is_end = (token_ids[:, None] == end_ids).any(axis=1)
    num_ends = np.add.reduceat(is_end.astype(np.int64), starts)
    outcomes = counts - num_ends + (num_ends > 0)
    chosen = np.asarray(chosen, dtype=np.int64)
    chosen_at = starts + np.array([np.searchsorted(ids, token) for ids, token in zip(allowed_ids, chosen)])
    chosen_is_end = (chosen[:, None] == end_ids).any(axis=1)
    share = np.where(chosen_is_end, np.add.reduceat(np.where(is_end, weights, 0.0), starts),
                     weights[chosen_at]) / np.add.reduceat(weights, starts)
    return [float(s) if n >= 2 else None for s, n in zip(share, outcomes)]
