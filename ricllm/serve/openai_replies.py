"""What the OpenAI API answers: completions, chat completions, their stream chunks, usage and errors,
built from the wire protocol's replies (docs/serve.md, OpenAI-compatible API).

``finish_reason``: ricllm's ``stop`` and ``length`` are OpenAI's; ``deadline`` (the answer ended at
its deadline, ``on_late`` abort or end_early) is ``length``, since the output was cut by a budget,
time instead of tokens; ``cancelled`` (a drain timeout) is vLLM's ``abort``; ``fallback`` (a whole
answer, a template's) is ``stop``. The engine's own reason, timings, admission's promise and a
constrained answer's decision ``confidence`` ride along in a ``ricllm`` object that OpenAI clients
keep as an extra field (``logprobs`` means per-token log probabilities there, not this). A refusal never becomes a choice: it is an HTTP error (:func:`refusal`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel

from ricllm import protocol as p
from ricllm.serve.openai_models import OpenAIError

FINISH_REASONS = {"stop": "stop", "length": "length", "deadline": "length", "cancelled": "abort", "fallback": "stop"}
# Can never fit, whatever the load: the request must change (400). Refused for the present load: retry (429).
NEVER_FITS = ("CONTEXT_TOO_LONG", "KV_BUDGET", "OUTPUT_TOO_SHORT")
BUSY = ("QUEUE_FULL", "KV_RESERVED", "DEADLINE_INFEASIBLE")
# Refusals of a promise for the present load: its deadline is stale by the time a client's backoff resends it.
STALE_ON_RETRY = ("KV_RESERVED", "DEADLINE_INFEASIBLE")
ERROR_STATUS = {"VALIDATION": 400, "UNKNOWN_TEMPLATE": 400, "UNKNOWN_ADAPTER": 404, "ADAPTER_MISMATCH": 400,
                "TOO_LARGE": 413}


def refusal(code: str, message: str, numbers: dict[str, int | float] | None = None) -> OpenAIError:
    """A ``rejected`` reply: 400 when it can never fit, 429 when refused for the load, 503 draining."""
    status = 400 if code in NEVER_FITS else 429 if code in BUSY else 503
    return OpenAIError(status, message, code=code, numbers=numbers)


def server_error(code: str, message: str) -> OpenAIError:
    """An ``error`` reply: the request's fault (400, 413) or the server's (500)."""
    return OpenAIError(ERROR_STATUS.get(code, 500), message, code=code)


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, result: p.Result) -> Usage:
        completion = len(result.token_ids)
        return cls(prompt_tokens=result.num_prompt_tokens, completion_tokens=completion,
                   total_tokens=result.num_prompt_tokens + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=result.num_cached_tokens))


class RicllmDetails(BaseModel):
    """ricllm's own view of the answer: an extra field OpenAI clients keep (``model_extra``)."""

    finish_reason: p.FinishReason
    timings: p.Timings
    deadline_met: bool | None = None
    bound_ms: float | None = None
    degraded: p.Degraded | None = None
    num_forced_tokens: int = 0
    confidence: float | None = None  # a constrained answer's decision confidence; None for free text
    model_text: str | None = None  # the model's own answer, when a fallback replaced it

    @classmethod
    def of(cls, result: p.Result, accepted: p.Accepted | None) -> RicllmDetails:
        return cls(finish_reason=result.finish_reason, timings=result.timings, deadline_met=result.deadline_met,
                   bound_ms=accepted.bound_ms if accepted is not None else None, degraded=result.degraded,
                   num_forced_tokens=result.num_forced_tokens, confidence=result.confidence,
                   model_text=result.model_text)


class Answer:
    """One request's identity in every object it is answered with: id, ``created``, model."""

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


def completion(answer: Answer, result: p.Result, accepted: p.Accepted | None) -> dict[str, Any]:
    choice = CompletionChoice(text=result.text, finish_reason=FINISH_REASONS[result.finish_reason])
    return {**answer.head("text_completion"), "choices": [choice.model_dump()],
            "usage": Usage.of(result).model_dump(), "ricllm": RicllmDetails.of(result, accepted).model_dump()}


def chat_completion(answer: Answer, result: p.Result, accepted: p.Accepted | None) -> dict[str, Any]:
    choice = ChatChoice(message=ChatMessageOut(content=result.text), finish_reason=FINISH_REASONS[result.finish_reason])
    return {**answer.head("chat.completion"), "choices": [choice.model_dump()],
            "usage": Usage.of(result).model_dump(), "ricllm": RicllmDetails.of(result, accepted).model_dump()}


class Chunks:
    """The stream chunks of one request, completion or chat; each is a JSON-ready dict."""

    def __init__(self, answer: Answer, chat: bool) -> None:
        self.answer, self.chat = answer, chat
        self.kind = "chat.completion.chunk" if chat else "text_completion"

    def first(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do; completions have no such chunk."""
        return self._chunk(ChatDelta(role="assistant", content=""), None) if self.chat else None

    def text(self, text: str) -> dict[str, Any]:
        return self._chunk(ChatDelta(content=text), None) if self.chat else self._completion(text, None)

    def last(self, text: str, result: p.Result, accepted: p.Accepted | None) -> dict[str, Any]:
        """The finish reason (with whatever text was still held back) and ricllm's details."""
        reason = FINISH_REASONS[result.finish_reason]
        chunk = self._chunk(ChatDelta(content=text), reason) if self.chat else self._completion(text, reason)
        return {**chunk, "ricllm": RicllmDetails.of(result, accepted).model_dump()}

    def usage(self, result: p.Result) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return {**self.answer.head(self.kind), "choices": [], "usage": Usage.of(result).model_dump()}

    def _chunk(self, delta: ChatDelta, reason: str | None) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
        return {**self.answer.head(self.kind), "choices": [choice.model_dump(exclude_none=False)]}

    def _completion(self, text: str, reason: str | None) -> dict[str, Any]:
        return {**self.answer.head(self.kind), "choices": [CompletionChoice(text=text, finish_reason=reason).model_dump()]}
