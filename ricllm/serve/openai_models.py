"""The OpenAI API's request bodies (``POST /v1/completions``, ``POST /v1/chat/completions``) as pydantic
models, and how each maps onto the wire protocol's :class:`~ricllm.protocol.GenerateRequest`
(docs/serve.md, OpenAI-compatible API).

Unlike the ZeroMQ protocol these bodies are lenient where OpenAI clients are: numbers may come as
JSON integers or floats, and fields this server does not know are ignored (SDKs send fields with
their defaults). A known field this server cannot honour, given a value other than its default
(``logprobs``, ``n`` > 1, penalties, tools, ...), is an error naming it rather than being dropped
silently. The extra body fields ``deadline_ms``, ``priority``, ``kv_window``, ``kv_sinks``,
``ignore_eos``, ``top_k``, ``stop_token_ids`` and vLLM's ``structured_outputs`` (and its older
``guided_*`` fields) carry ricllm's own request fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ricllm import protocol as p

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's chat default is "the rest of the context"; admission reserves KV for max_tokens, so an
# unbounded default would reserve a whole context per request. A bounded one keeps admission honest.
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # OpenAI's (the ZeroMQ protocol's is 0: greedy)

# Known fields this server does not implement, and the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"), "min_tokens": (None, 0),
    "prompt_logprobs": (None, 0), "audio": (None,), "modalities": (None, ["text"]),
}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {message, type, code, param, numbers}}``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 numbers: dict[str, int | float] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.numbers = numbers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                 "code": self.code, "param": self.param}
        if self.numbers:
            error["numbers"] = self.numbers
        return {"error": error}


def invalid(message: str, param: str | None = None, code: str = "VALIDATION") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def describe(exc: ValidationError) -> OpenAIError:
    """The first problem of a body that does not validate, naming its field as ``param``."""
    error = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in error["loc"]) or None
    message = error["msg"].removeprefix("Value error, ")
    more = exc.error_count() - 1
    text = f"field {field!r}: {message}" if field else message
    return invalid(text + (f" (and {more} more)" if more > 0 else ""), param=field)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None  # "schema" shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json": {"type": "object"}}  # any JSON object: what json_object promises
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        return {"json": self.json_schema.schema_}


class _Body(BaseModel):
    """What both endpoints share: sampling, stopping, streaming, constraints and ricllm's extras."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1 or 0 turn it off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    ignore_eos: bool = False
    deadline_ms: float | None = None
    priority: p.Priority | None = None
    kv_window: int | None = None
    kv_sinks: int | None = None

    def check_supported(self) -> None:
        """Refuse what this server would otherwise silently not do."""
        if self.n != 1:
            raise invalid(f"n={self.n}: this server generates one choice per request", "n")
        extra = self.model_extra or {}
        for name, unused in UNSUPPORTED.items():
            if name in extra and not any(extra[name] == value for value in unused):
                raise invalid(f"field {name!r} is not supported by this server (got {extra[name]!r})", name,
                              code="UNSUPPORTED")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured(self) -> dict[str, Any] | None:
        """The one constraint, from ``response_format``, ``structured_outputs`` or a ``guided_*`` field."""
        extra = self.model_extra or {}
        sources = {}
        if self.response_format is not None and self.response_format.type != "text":
            sources["response_format"] = self.response_format.structured()
        if self.structured_outputs is not None:
            sources["structured_outputs"] = _from_structured_outputs(self.structured_outputs)
        for name, kind in GUIDED_FIELDS.items():
            if extra.get(name) is not None:
                sources[name] = {kind: extra[name]}
        if len(sources) > 1:
            raise invalid(f"give one constraint, not {len(sources)} ({', '.join(sources)})", next(iter(sources)))
        return next(iter(sources.values()), None)

    def generate_fields(self, default_max_tokens: int, adapter: str | None = None) -> dict[str, Any]:
        """The ``GenerateRequest`` fields besides the prompt, the id and ``stream``."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        fields = {"max_tokens": self.max_tokens or default_max_tokens,
                  "temperature": float(DEFAULT_TEMPERATURE if self.temperature is None else self.temperature),
                  "top_k": max(self.top_k or 0, 0), "top_p": None if self.top_p is None else float(self.top_p),
                  "seed": self.seed, "stop": stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                  "deadline_ms": None if self.deadline_ms is None else float(self.deadline_ms),
                  "priority": self.priority, "kv_window": self.kv_window, "kv_sinks": self.kv_sinks,
                  "structured": self.structured(), "adapter": adapter}
        return {name: value for name, value in fields.items() if value is not None}


def _from_structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object;
    its tuning flags (backend, whitespace, fallback) are its own engine's and are ignored here."""
    given = {kind: value[kind] for kind in STRUCTURED_KINDS if value.get(kind) is not None}
    if value.get("json_object"):
        given["json_object"] = {"type": "object"}
    if value.get("structural_tag") is not None:
        raise invalid("structured_outputs.structural_tag is not supported", "structured_outputs.structural_tag",
                      code="UNSUPPORTED")
    if len(given) != 1:
        raise invalid(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, json_object; got "
                      f"{', '.join(given) or 'none'}", "structured_outputs")
    (kind, constraint), = given.items()
    return {"json" if kind == "json_object" else kind: constraint}


class CompletionBody(_Body):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_fields(self) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid(f"a batch of {len(prompt)} prompts: send one prompt per request", "prompt")
            prompt = prompt[0]
        return {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}

    def to_generate(self, request_id: str, adapter: str | None = None) -> p.GenerateRequest:
        """``adapter``: the LoRA adapter its ``model`` names, if any."""
        self.check_supported()
        return build_generate(request_id, self.prompt_fields(), self.stream,
                              self.generate_fields(DEFAULT_COMPLETION_MAX_TOKENS, adapter), "prompt")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None

    def plain(self, index: int) -> dict[str, str]:
        """As the chat template takes it: ``developer`` is OpenAI's newer name for ``system``; text
        parts are joined (other parts, images and audio, this model cannot read)."""
        content = self.content
        if content is None:
            raise invalid(f"messages[{index}] has no content (tool calls are not supported)",
                          f"messages.{index}.content")
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise invalid(f"messages[{index}]: content parts of type {', '.join(sorted(kinds))} are not "
                              "supported (text only)", f"messages.{index}.content")
            content = "".join(part.text or "" for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionBody(_Body):
    """``POST /v1/chat/completions``: rendered with the model's chat template on the engine thread,
    as the ZeroMQ ``messages`` field is."""

    messages: Annotated[list[ChatMessageBody], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def to_generate(self, request_id: str, adapter: str | None = None) -> p.GenerateRequest:
        """``adapter``: the LoRA adapter its ``model`` names, if any."""
        self.check_supported()
        fields = self.generate_fields(DEFAULT_CHAT_MAX_TOKENS, adapter)
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        messages = [message.plain(i) for i, message in enumerate(self.messages)]
        return build_generate(request_id, {"messages": messages}, self.stream, fields, "messages")


def build_generate(request_id: str, prompt: dict[str, Any], stream: bool, fields: dict[str, Any],
                   prompt_param: str) -> p.GenerateRequest:
    """The wire request, checked by the protocol's own strict model; its error names the OpenAI field."""
    try:
        return p.GenerateRequest(id=request_id, stream=stream, **prompt, **fields)
    except ValidationError as exc:
        error = describe(exc)
        if error.param in ("prompt", "token_ids", "messages") or (error.param or "").startswith(("token_ids.",
                                                                                                 "messages.")):
            error.param = prompt_param
        if error.param == "structured":
            error.param = "response_format"
        raise error from None
