"""Constrained decoding: each constraint compiled once, each constrained request's place in its
grammar, the tokens its grammar forces, and the masks that keep what it samples valid.

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
from ricllm.errors import InvalidRequestError
from ricllm.model.tokenizer import Tokenizer
from ricllm.outputs import Rejection
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence
from ricllm.structured.fallback import Fallback
from ricllm.structured.spec import StructuredSpec

if TYPE_CHECKING:  # llguidance is imported with the first constraint, not with the engine
    from ricllm.structured.compiler import CompiledGrammar


def _checkable_after(params: SamplingParams) -> bool:
    """Whether a constrained row may draw first and be checked after (no top-k, no top-p filter)."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)


class ConstrainedDecoding:
    """The engine's grammars: ``compile`` (cached), ``start`` a request on its grammar, ``force_start``
    and ``advance`` it (appending the tokens the grammar forces), ``sample`` a step's tokens.

    Invariant: a constrained request's ``token_ids`` past its prompt are always a prefix of an
    answer its grammar accepts, and its ``guide`` has consumed exactly those tokens.
    """

    def __init__(self, tokenizer: Tokenizer, runtime: Runtime, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.max_model_len = max_model_len
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

    def sample(self, logits, ready: list[Sequence]) -> list[int]:
        """One token per row; a constrained row's token is one its grammar allows, and its step
        multiplies its decision's confidence (``ricllm.structured.fallback``).

        Greedy and temperature-only rows draw first and are masked only when the grammar refuses
        the draw, then draw again: keeping an allowed draw from p, else drawing from p masked,
        is exactly p restricted to the allowed tokens, and checking one token costs far less than
        masking a vocabulary. Rows with top-k or top-p are masked before their one draw, since
        those filters must see the masked distribution. Every constrained row's allowed set is
        computed once per step: its confidence needs it whether or not its draw was masked.
        """
        params, generators = [s.params for s in ready], [s.generator for s in ready]
        constrained = [r for r, s in enumerate(ready) if s.guide is not None]
        if not constrained:
            return self.runtime.sample(logits, params, generators)
        allowed = self._allowed(ready, constrained, logits.shape[-1])
        position = {r: i for i, r in enumerate(constrained)}  # a ready row's row in ``allowed``
        masked_first = [r for r in constrained if not _checkable_after(ready[r].params)]
        if masked_first:
            logits = self.runtime.mask(logits, masked_first, allowed[[position[r] for r in masked_first]])
        tokens = self.runtime.sample(logits, params, generators)
        refused = [r for r in constrained if _checkable_after(ready[r].params) and not ready[r].guide.allows(tokens[r])]
        if refused:
            again = self.runtime.mask(logits[refused], list(range(len(refused))),
                                      allowed[[position[r] for r in refused]])
            for row, token in zip(refused, self.runtime.sample(again, [params[r] for r in refused],
                                                               [generators[r] for r in refused])):
                tokens[row] = token
        self._multiply_confidence(logits, [ready[r] for r in constrained], constrained, allowed,
                                  [tokens[r] for r in constrained])
        return tokens

    @staticmethod
    def _allowed(ready: list[Sequence], rows: list[int], vocab_size: int) -> np.ndarray:
        """``[len(rows), vocab_size]``: which tokens each constrained row's grammar allows now."""
        from ricllm.structured.guide import allowed_tokens

        return allowed_tokens([ready[r].guide for r in rows], vocab_size)

    def _multiply_confidence(self, logits, seqs: list[Sequence], rows: list[int], allowed: np.ndarray,
                             tokens: list[int]) -> None:
        """The allowed logits are read as the head gave them: masking leaves them as they were."""
        ids = [np.flatnonzero(ok) for ok in allowed]
        flat = self.runtime.allowed_logits(logits, np.repeat(np.asarray(rows, dtype=np.int64), [len(i) for i in ids]),
                                           np.concatenate(ids))
        values = np.split(flat, np.cumsum([len(i) for i in ids])[:-1])
        ends = np.fromiter(self.tokenizer.eos_token_ids, dtype=np.int64)
        for seq, share in zip(seqs, decision_shares(ids, values, tokens, ends)):
            if share is not None:  # one outcome allowed: nothing was decided
                seq.confidence *= share


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
