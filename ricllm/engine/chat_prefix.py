"""A conversation's fixed start (a RAN template's system prompt), rendered once, and the requests
that begin with it.

Pinning a template and serving a request that uses it must agree token for token, or the
request's prompt would not hit the pinned blocks. So the prefix is rendered here, one way, for
``LLM.pin_prefix``, the server's registered templates and the replay's pinned templates; and a
chat request that starts with it reuses the prefix's own token ids, encoding only what follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ricllm.cache.kv_cache_manager import PinHandle
from ricllm.lora_request import AdapterSlot
from ricllm.model.tokenizer import Tokenizer
from ricllm.sequence import Sequence


@dataclass(frozen=True)
class ChatPrefix:
    """``text`` is the chat-template rendering (None for a model without a chat template, whose
    prefix is the messages' contents, one per line)."""

    messages: list[dict[str, str]]
    text: str | None
    token_ids: list[int]


def render_chat_prefix(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> ChatPrefix:
    """The messages as a chat request starts with them: no generation prompt after them."""
    if not tokenizer.has_chat_template:
        return ChatPrefix(messages, None, tokenizer.encode(plain_text(messages)))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return ChatPrefix(messages, text, tokenizer.encode(text, add_special_tokens=False))


def plain_text(messages: list[dict[str, str]]) -> str:
    """A base model's few-shot form of messages (its file has no chat template): their contents,
    one per line, so worked examples read as question and answer lines after the instructions."""
    return "\n".join(m["content"] for m in messages)


def render_chat_request(tokenizer: Tokenizer, prefix: ChatPrefix | None, messages: list[dict[str, str]]) -> list[int]:
    """``prefix.messages + messages`` with a generation prompt; the prefix's tokens come first, token
    for token, where the rendering starts with the prefix's text. A model without a chat template
    gets the plain form: the conversation before the last message as it was pinned, a blank line,
    and the last message's content, where the answer follows. Raises ``ValueError`` for a template
    that refuses the conversation."""
    conversation = (prefix.messages if prefix is not None else []) + messages
    if not tokenizer.has_chat_template:
        context, last = plain_text(conversation[:-1]), conversation[-1]["content"]
        return tokenizer.encode(f"{context}\n\n{last}" if context else last)
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    if prefix is not None and prefix.text is not None and text.startswith(prefix.text):
        return prefix.token_ids + tokenizer.encode(text[len(prefix.text):], add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class PinnedTemplate:
    """A template's conversation pinned (``LLMEngine.pin_template``): ``prefix`` is what its chat
    requests start with, ``handle`` its pin, and ``seq`` the request computing its K/V; its
    blocks are held once ``seq`` has finished (``computed``)."""

    prefix: ChatPrefix
    handle: PinHandle
    seq: Sequence
    block_size: int

    @property
    def computed(self) -> bool:
        return self.seq.is_finished

    @property
    def adapter(self) -> AdapterSlot | None:
        """The adapter its K/V was computed under (None: the base model)."""
        return self.seq.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.prefix.token_ids)

    @property
    def num_pinned_tokens(self) -> int:
        """Tokens its pinned blocks hold: its full blocks (0 until ``computed``)."""
        return len(self.handle.block_ids) * self.block_size
