"""A RAN config template: the conversation every request that uses it starts with, and what its
answers must be.

The conversation is a system prompt and, optionally, worked examples as user/assistant turns;
it is rendered and pinned as one prefix (``ricllm.engine.chat_prefix``), so its KV blocks are
computed once and shared by every request. The template's ``structured`` constraint applies to
every request that uses it and names none of its own; it is compiled once, when the template is
registered or pinned. Its ``fallback`` (``ricllm.structured.fallback``) is the answer its requests
give instead of a decision below ``min_confidence``; it must satisfy the constraint, which the
engine checks when the template is pinned. Serve, replay and the offline API all describe a template with this type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ricllm.errors import InvalidRequestError
from ricllm.structured.fallback import Fallback
from ricllm.structured.spec import StructuredSpec

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Template:
    """``adapter`` names the LoRA adapter its requests are served under (None: the base model); the
    engine must hold it when the template is pinned, and pins the conversation's K/V under it.
    ``fallback`` applies to the requests that answer under the template's own constraint."""

    messages: tuple[dict[str, str], ...]
    structured: StructuredSpec | None = None
    adapter: str | None = None
    fallback: Fallback | None = None

    @classmethod
    def build(cls, messages: str | Sequence[Mapping[str, str]],
              structured: StructuredSpec | Mapping[str, Any] | None = None, adapter: str | None = None,
              min_confidence: float | None = None, fallback: str | None = None) -> Template:
        """From a system prompt (a string) or a list of chat messages; checks both, and that
        ``min_confidence`` and ``fallback`` come together and with a constraint."""
        if isinstance(messages, str):
            messages = [{"role": "system", "content": messages}]
        checked = tuple(_check_message(i, m) for i, m in enumerate(messages))
        if not checked:
            raise InvalidRequestError("a template needs at least one message")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise InvalidRequestError(f"a template's adapter is the name of a loaded adapter, got {adapter!r}")
        confident = Fallback.build(min_confidence, fallback)
        if confident is not None and structured is None:
            raise InvalidRequestError("a template's fallback answer needs a constraint (structured) it satisfies")
        return cls(checked, StructuredSpec.parse(structured) if structured is not None else None, adapter, confident)

    @property
    def message_list(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages]

    @property
    def system_prompt(self) -> str | None:
        first = self.messages[0]
        return first["content"] if first["role"] == "system" else None

    @property
    def num_examples(self) -> int:
        """Worked examples: the assistant turns."""
        return sum(1 for m in self.messages if m["role"] == "assistant")


def _check_message(index: int, message: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        raise InvalidRequestError(f"template message {index} must have exactly the keys role and content, "
                                  f"got {message!r:.80}")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise InvalidRequestError(f"template message {index} has role {role!r}; choose one of {', '.join(ROLES)}")
    if not isinstance(content, str) or not content:
        raise InvalidRequestError(f"template message {index} ({role}) needs non-empty text content")
    return {"role": role, "content": content}
