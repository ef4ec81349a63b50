"""Constraints compiled for one tokenizer with llguidance, cached by their key.

llguidance was chosen over xgrammar (``benchmarks/bench_grammar_engines.py``): it needs neither
torch nor transformers, so the native runtime keeps its torch-free process, and it fills numpy
bitmasks and reports the tokens the grammar forces. Its tokenizer bridge costs ~0.2 s, so it is
built on the first constraint, not at engine start: engines that never constrain pay nothing.
A compiled grammar keeps a fresh matcher that each request deep-copies (no per-request compile).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np

from ricllm.errors import InvalidRequestError
from ricllm.logging import get_logger
from ricllm.model.tokenizer import Tokenizer
from ricllm.structured import bounds
from ricllm.structured.spec import StructuredSpec

log = get_logger("ricllm.structured")
CACHE_SIZE = 256  # compiled grammars kept; a deployment has a handful of templates, each compiled once


@dataclass(frozen=True)
class CompiledGrammar:
    """``min_tokens``: the fewest tokens of a complete answer; ``max_tokens``: the most, its end
    token included, or None when the constraint does not bound it: the most any answer has the
    engine's way (``walk_answers``) where the walk ends, else the bound of its longest text in bytes;
    ``max_decisions``: the most tokens any complete answer samples (the rest the grammar forces),
    or None when not known; ``max_forced_computed``: the most forced tokens past the answer's forced
    start that any complete answer has a step compute (those a later decision follows: a forced
    tail that completes the answer is appended, never computed), or None when not known."""

    spec: StructuredSpec
    grammar: str
    min_tokens: int
    max_tokens: int | None
    fresh: llguidance.LLMatcher
    fresh_vocab_size: int  # the grammar's tokenizer's vocabulary: the width of its masks
    max_decisions: int | None = None
    max_forced_computed: int | None = None

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.fresh.deep_copy()


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._token_texts: tuple[frozenset[str], int] | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.num_compiled = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend.to_str(), eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled constraint; ``InvalidRequestError`` names what the grammar engine refused."""
        if spec.key in self._cache:
            self._cache.move_to_end(spec.key)
            return self._cache[spec.key]
        compiled = self._compile(spec)
        self._cache[spec.key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        try:
            grammar = _grammar_text(spec)
        except ValueError as exc:  # e.g. a boolean schema, which the JSON compiler takes no options for
            raise InvalidRequestError(f"structured {spec.kind} cannot be compiled: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise InvalidRequestError(f"structured {spec.kind} cannot be compiled: {error.strip()}")
        fresh = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if fresh.is_error():
            raise InvalidRequestError(f"structured {spec.kind} cannot be compiled: {fresh.get_error()}")
        longest = bounds.longest_bytes(spec)
        walked = walk_answers(fresh, self.ll_tokenizer) if longest is not None else None
        most_tokens = None if longest is None else min(longest + 1, walked[1] if walked else longest + 1)
        compiled = CompiledGrammar(spec, grammar, self._fewest_tokens(bounds.shortest_answers(spec)), most_tokens,
                                   fresh, self.ll_tokenizer.vocab_size, walked[0] if walked else None,
                                   walked[2] if walked else None)
        self.num_compiled += 1
        log.info("grammar_compiled", kind=spec.kind, key=spec.key, min_tokens=compiled.min_tokens,
                 max_tokens=compiled.max_tokens, max_decisions=compiled.max_decisions,
                 max_forced_computed=compiled.max_forced_computed)
        return compiled

    def answer_problem(self, compiled: CompiledGrammar, text: str) -> str | None:
        """Why ``text`` is not a whole answer the grammar accepts (None when it is), judged by the
        grammar itself on the text's tokens: what the engine would let the model write."""
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        matcher = compiled.new_matcher()
        accepted = matcher.validate_tokens(tokens)
        if accepted < len(tokens):
            refused = self.tokenizer.decode(tokens[accepted:], skip_special_tokens=False)
            return f"it is refused from {refused!r} on"
        matcher.consume_tokens(tokens)
        if not matcher.is_accepting():
            return "it stops before a whole answer (the constraint expects more)"
        return None

    def _fewest_tokens(self, answers: list[str] | None) -> int:
        """The fewest tokens that spell one of the answers (1 when they are not known)."""
        if not answers:
            return 1
        return max(1, min(self._segment(text) for text in answers))

    def _segment(self, text: str) -> int:
        """Fewest vocabulary tokens whose texts concatenate to ``text`` (shortest path, by DP)."""
        vocabulary, longest = self._vocabulary()
        fewest = [0] + [len(text) + 1] * len(text)
        for end in range(1, len(text) + 1):
            for start in range(max(0, end - longest), end):
                if fewest[start] + 1 < fewest[end] and text[start:end] in vocabulary:
                    fewest[end] = fewest[start] + 1
        return fewest[-1] if fewest[-1] <= len(text) else len(text.encode())

    def _vocabulary(self) -> tuple[frozenset[str], int]:
        if self._token_texts is None:
            size = self.tokenizer.backend.get_vocab_size()
            texts = self.tokenizer.backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
            kept = frozenset(t for t in texts if t and "\ufffd" not in t)
            self._token_texts = (kept, max(len(t) for t in kept))
        return self._token_texts


MAX_DECISION_STATES = 64  # answer prefixes walked for max_decisions (~0.3 ms each, on the request path for a new schema)
MAX_BRANCHES = 512  # tokens allowed at one point beyond which the answer is free text: not explored


def walk_answers(fresh: llguidance.LLMatcher,
                 ll_tokenizer: llguidance.LLTokenizer) -> tuple[int, int, int] | None:
    """(the most tokens any complete answer samples, the most tokens any complete answer has, the
    most forced tokens past its forced start that any complete answer computes), the engine's way:
    after each sampled token the grammar's forced tokens are appended without sampling, the next
    step computes them with that token when a decision follows, and the answer ends once the
    grammar stops (a sampled end token counts as one of each; the forced tokens that end it are
    never computed). A depth-first walk over every token the grammar allows, memoized on the answer's bytes
    so far (the grammar's state is a function of them); None when the answers are too many to walk
    (free text, wide ranges): admission then plans every answer token as a step."""
    width = ll_tokenizer.vocab_size
    words = np.zeros((width + 31) // 32, dtype=np.int32)
    ends, memo = set(ll_tokenizer.eos_tokens), {}

    def most_after(matcher: llguidance.LLMatcher, answer: bytes) -> tuple[int, int, int]:
        forced = matcher.compute_ff_tokens()
        if forced:
            matcher.consume_tokens(forced)
            answer += ll_tokenizer.decode_bytes(forced)
        if matcher.is_stopped():
            return 0, len(forced), 0
        if answer not in memo:
            children = list(_each_allowed(matcher, answer))
            memo[answer] = tuple(1 + max(child[i] for child in children) for i in range(2)) + (
                max(computed for _, _, computed in children),)
        decisions, tokens, computed = memo[answer]
        return decisions, len(forced) + tokens, len(forced) + computed

    def _each_allowed(matcher: llguidance.LLMatcher, answer: bytes):
        if len(memo) >= MAX_DECISION_STATES:
            raise OverflowError
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:width])
        if len(allowed) > MAX_BRANCHES:
            raise OverflowError
        for token in allowed.tolist():
            if token in ends:
                yield 0, 0, 0  # ending the answer is itself the last decision, and its last token
                continue
            child = matcher.deep_copy()
            child.consume_tokens([token])
            yield most_after(child, answer + ll_tokenizer.decode_bytes([token]))

    try:
        start = fresh.deep_copy()
        start_forced = len(start.compute_ff_tokens())  # the forced start, prefilled with the prompt
        decisions, tokens, computed = most_after(start, b"")
    except OverflowError:
        return None
    if decisions == 0:  # its arrival forced the whole answer: it still samples once, the end token
        return 1, tokens + 1, 0
    return decisions, tokens, computed - start_forced


def _grammar_text(spec: StructuredSpec) -> str:
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults={"whitespace_flexible": False})
    if spec.kind == "choice":
        return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.value)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    return llguidance.LLMatcher.grammar_from_lark(spec.value)
