"""The ricllm wire protocol: versioned pydantic models, one msgpack map per ZeroMQ frame.

Frame layout: a client's DEALER socket sends exactly one frame, ``msgpack({"v": 1, "type": ...,
"id": ..., ...})``; the server's ROUTER sees ``[identity, frame]`` and answers
``[identity, frame]``, so the client receives one frame per reply. There is no empty delimiter
frame (REQ sockets are not supported: a request may get several replies).

Every request id gets exactly one *final* reply (see :func:`is_final`); ``accepted`` and
``token`` replies are progress notes that may precede it. The models are strict (no type
coercion, unknown fields are errors) because a RAN controller that sends ``"max_tokens": "64"``
has a bug we should name, not paper over. This module imports only pydantic and msgpack, so a
client needs neither torch nor the engine (a constraint's shape and size are checked with
``ricllm.structured.spec``, which needs neither; compiling it is the engine's). ``docs/protocol.md``
is the prose version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from ricllm.config import DEFAULT_ZMQ_PORT, MAX_MESSAGE_BYTES
from ricllm.engine.stats import AdapterStats, KVCacheStats, LatencyStats
from ricllm.model.identity import ServedModel
from ricllm.sampling_params import Priority
from ricllm.structured.fallback import Fallback
from ricllm.structured.spec import StructuredSpec
from ricllm.template import Template

PROTOCOL_VERSION = 1
DEFAULT_ENDPOINT = f"tcp://127.0.0.1:{DEFAULT_ZMQ_PORT}"

RejectCode = Literal["KV_BUDGET", "KV_RESERVED", "CONTEXT_TOO_LONG", "DEADLINE_INFEASIBLE", "QUEUE_FULL",
                     "DRAINING", "OUTPUT_TOO_SHORT"]
ErrorCode = Literal["MALFORMED", "UNKNOWN_TYPE", "VALIDATION", "DUPLICATE_ID", "UNKNOWN_TEMPLATE",
                    "UNKNOWN_ADAPTER", "ADAPTER_MISMATCH", "UNKNOWN_REQUEST", "TOO_LARGE", "INTERNAL"]
# deadline: aborted once it passed; fallback: a decision below its template's min_confidence, answered with its fallback
FinishReason = Literal["stop", "length", "cancelled", "deadline", "fallback"]
REJECT_CODES: tuple[str, ...] = get_args(RejectCode)
ERROR_CODES: tuple[str, ...] = get_args(ErrorCode)

RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
TemplateId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
AdapterName = Annotated[str, StringConstraints(min_length=1, max_length=128)]  # a name in lora_modules
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]
ConstraintKind = Literal["json", "choice", "regex", "grammar"]


def _checked_structured(value: dict[str, Any]) -> dict[str, Any]:
    """Shape and size checked at receipt, by the engine's own rules (``StructuredSpec``), so a
    malformed constraint never reaches the engine thread; whether it compiles is the engine's call."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ValueError("must be JSON: maps with string keys, arrays, strings, finite numbers, booleans "
                         "and nil") from None
    StructuredSpec.parse(value)  # InvalidRequestError is a ValueError: pydantic names the field
    return value


# vLLM's structured_outputs keys: {"json": schema} (or "json_schema"), {"choice": [...]}, {"regex": ...}, {"grammar": ...}
Structured = Annotated[dict[str, Any], AfterValidator(_checked_structured)]


class _Strict(BaseModel):
    """No coercion, no unknown fields, no NaN/inf: wire input is checked, not guessed at."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Message(_Strict):
    v: Literal[1] = PROTOCOL_VERSION


class ChatMessage(_Strict):
    """One chat turn, as the model's chat template expects it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class TemplateMessage(_Strict):
    """One turn of a template's conversation: its system prompt or a worked example's turn."""

    role: Literal["system", "user", "assistant"]
    content: NonEmptyStr


# ----------------------------------------------------------------------------------- requests

class GenerateRequest(_Message):
    """Generate from exactly one of ``prompt`` (text), ``messages`` (chat) or ``token_ids``.

    ``template_id`` names a registered template whose pinned KV blocks come first.
    ``adapter`` names the LoRA adapter (``lora_modules``) it is served under; without it, its
    template's adapter, else the base model. Naming another adapter than the template's is
    ``ADAPTER_MISMATCH``; one the server does not hold, ``UNKNOWN_ADAPTER``.
    ``deadline_ms`` counts from the server's receipt; admission rejects what cannot meet it.
    ``structured`` constrains the answer; without it, the template's constraint (if any) applies.
    """

    type: Literal["generate"] = "generate"
    id: RequestId
    prompt: NonEmptyStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    template_id: TemplateId | None = None
    adapter: AdapterName | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_k: int = 0
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[NonEmptyStr] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    deadline_ms: float | None = Field(None, gt=0)
    priority: Priority | None = None  # None: derived from deadline_ms (ricllm.sampling_params.default_priority)
    kv_window: int | None = Field(None, ge=0)  # keep only the last kv_window tokens' K/V; None: the engine's; 0: exact
    kv_sinks: int | None = Field(None, ge=0)  # first tokens kept with a window; None: the engine's
    stream: bool = False
    structured: Structured | None = None

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerateRequest:
        given = [name for name in ("prompt", "messages", "token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt, messages, token_ids must be given, got "
                             f"{', '.join(given) or 'none'}")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields that map one-to-one onto ``ricllm.SamplingParams``."""
        names = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "kv_window", "kv_sinks")
        return {name: getattr(self, name) for name in names}


class RegisterTemplateRequest(_Message):
    """Pin a template's KV blocks; the server picks ``template_id`` when it is absent.

    The conversation is exactly one of ``system_prompt`` (a lone system message) or ``messages``
    (a system prompt and worked-example turns); ``structured`` is the constraint every request
    that uses the template inherits unless it names its own. ``adapter`` names the LoRA adapter
    its K/V is pinned under and its requests are served under (``UNKNOWN_ADAPTER`` when the server
    does not hold it).
    """

    type: Literal["register_template"] = "register_template"
    id: RequestId
    template_id: TemplateId | None = None
    system_prompt: NonEmptyStr | None = None
    messages: Annotated[list[TemplateMessage], Field(min_length=1)] | None = None
    structured: Structured | None = None
    adapter: AdapterName | None = None
    min_confidence: float | None = Field(None, gt=0, le=1)
    fallback: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _exactly_one_conversation(self) -> RegisterTemplateRequest:
        given = [name for name in ("system_prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of system_prompt, messages must be given, got {', '.join(given) or 'none'}")
        if Fallback.build(self.min_confidence, self.fallback) is not None and self.structured is None:
            raise ValueError("fallback needs structured: the constraint its answer satisfies")
        return self

    @property
    def conversation_field(self) -> str:
        """The field an error about the conversation names."""
        return "system_prompt" if self.system_prompt is not None else "messages"

    def template(self) -> Template:
        """The template it describes (both fields were checked when the request was)."""
        conversation = self.system_prompt or [m.model_dump() for m in self.messages]
        return Template.build(conversation, self.structured, self.adapter, self.min_confidence, self.fallback)


class UnregisterTemplateRequest(_Message):
    type: Literal["unregister_template"] = "unregister_template"
    id: RequestId
    template_id: TemplateId


class CancelRequest(_Message):
    """Cancel ``target_id`` (a generate request of the same client); its result says ``cancelled``."""

    type: Literal["cancel"] = "cancel"
    id: RequestId
    target_id: RequestId


class StatsRequest(_Message):
    type: Literal["stats"] = "stats"
    id: RequestId


class PingRequest(_Message):
    type: Literal["ping"] = "ping"
    id: RequestId


# ------------------------------------------------------------------------------------ replies

class Degraded(_Strict):
    """Admission's ``degrade`` policy admitted the request with fewer tokens than it asked for:
    ``code`` is the refusal this avoided, ``numbers`` that refusal's numbers at the asked length."""

    code: RejectCode
    requested_max_tokens: Annotated[int, Field(ge=1)]
    granted_max_tokens: Annotated[int, Field(ge=1)]
    message: str
    numbers: dict[str, int | float] = Field(default_factory=dict)


class Accepted(_Message):
    """Non-final: the request passed admission. ``bound_ms`` is admission's bound on its end-to-end
    time from receipt (safety margin included): what was promised, not an estimate;
    ``degraded`` is set when it was admitted with a smaller ``max_tokens`` (degrade policy)."""

    type: Literal["accepted"] = "accepted"
    id: RequestId
    bound_ms: Seconds | None = None
    queue_position: Count | None = None
    degraded: Degraded | None = None


class Rejected(_Message):
    """Final: refused by admission; ``numbers`` holds what the message says (tokens, ms, bytes)."""

    type: Literal["rejected"] = "rejected"
    id: RequestId
    code: RejectCode
    message: str
    numbers: dict[str, int | float] = Field(default_factory=dict)


class Token(_Message):
    """Non-final (``stream`` requests only): output token ``index`` and the text it adds."""

    type: Literal["token"] = "token"
    id: RequestId
    index: Count
    token_id: TokenId
    text: str


class Timings(_Strict):
    """Seconds from the server's receipt; ``ttft_s`` is None when no token was produced."""

    queue_s: Seconds
    ttft_s: Seconds | None = None
    e2e_s: Seconds
    tpot_s: Seconds | None = None
    predicted_e2e_s: Seconds | None = None  # admission's finish bound for a promised request, at its arrival
    promised_e2e_s: Seconds | None = None  # the same, as of the last admission that counted it


class Result(_Message):
    """Final: the whole output. ``deadline_met`` is None when the request had no deadline.
    ``confidence`` is a constrained answer's decision confidence (None for unconstrained text);
    with finish reason ``fallback``, ``text`` is the template's fallback and ``model_text`` (and
    ``token_ids``, and a stream's ``token`` replies) the model's own answer."""

    type: Literal["result"] = "result"
    id: RequestId
    text: str
    token_ids: list[TokenId]
    num_prompt_tokens: Count
    num_cached_tokens: Count
    finish_reason: FinishReason
    timings: Timings
    deadline_met: bool | None = None
    degraded: Degraded | None = None  # as in ``accepted``: admitted with a smaller max_tokens
    num_forced_tokens: Count = 0  # output tokens the constraint forced (appended without sampling)
    confidence: Annotated[float, Field(ge=0, le=1)] | None = None
    model_text: str | None = None  # the model's own answer, when the fallback replaced it


class ErrorReply(_Message):
    """Final: the request was not understood or failed; ``id`` is None when it was unreadable."""

    type: Literal["error"] = "error"
    id: RequestId | None
    code: ErrorCode
    message: str


class TemplateRegistered(_Message):
    type: Literal["template_registered"] = "template_registered"
    id: RequestId
    template_id: TemplateId
    num_tokens: Count
    num_pinned_tokens: Count
    num_examples: Count = 0  # worked examples: the template's assistant turns
    adapter: AdapterName | None = None  # the adapter its K/V is pinned under


class TemplateUnregistered(_Message):
    type: Literal["template_unregistered"] = "template_unregistered"
    id: RequestId
    template_id: TemplateId


class Cancelled(_Message):
    """Final reply to a ``cancel`` (the cancelled request still gets its own ``result``)."""

    type: Literal["cancelled"] = "cancelled"
    id: RequestId
    target_id: RequestId


class _Report(BaseModel):
    """What the server reports about itself: checked, but a newer server's extra keys are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class WeightFormats(_Report):
    layers: str
    head: str


class ModelIdentity(_Report):
    """Which model and build answer: a RIC-side caller can check it serves what it expects."""

    name: str
    path: str
    dtype: str
    weights: WeightFormats
    attention_backend: str
    device: str
    threads: int
    runtime: str
    ricllm: str
    served_name: str  # the name clients use for it (/v1/models, the metrics' model_name): ServedModel's
    served_model_name: str | None = None  # the operator's name for it (the engine setting), if any

    def served_model(self) -> ServedModel:
        """The served model these names describe (``ricllm.model.identity``)."""
        return ServedModel(Path(self.path), self.name, self.served_name)


class QueueStats(_Report):
    inbound: int
    inbound_capacity: int
    running: int
    waiting: int
    in_flight: int


class AdmissionSummary(_Report):
    policy: str
    counts: dict[str, int]  # admitted, degraded and each reject code, since start
    reserved_blocks: int


class TemplateStats(_Report):
    num_tokens: int
    pinned: bool
    num_pinned_tokens: int
    num_examples: int = 0
    constraint: ConstraintKind | None = None  # the kind of the constraint its requests inherit
    adapter: str | None = None  # the adapter its K/V is pinned under and its requests inherit


class ServerStats(_Report):
    """The ``stats`` reply's body: the engine's snapshot (``ricllm.engine.stats``) and the server's own."""

    model: ModelIdentity
    kv_cache: KVCacheStats
    queues: QueueStats
    admission: AdmissionSummary
    deadlines: dict[str, int]  # met, missed
    latency_model: LatencyStats | None
    templates: dict[str, TemplateStats]
    draining: bool
    adapters: tuple[AdapterStats, ...] = ()  # the LoRA adapters held, by name (the engine snapshot's)
    max_loras: int = 0  # the adapters the engine can hold at once


class StatsReply(_Message):
    type: Literal["stats_reply"] = "stats_reply"
    id: RequestId
    stats: Annotated[ServerStats, Field(strict=False)]


class Pong(_Message):
    """``server_time`` is Unix seconds; ``version`` the ricllm version (protocol version is ``v``)."""

    type: Literal["pong"] = "pong"
    id: RequestId
    server_time: float
    version: str


Request = Annotated[Union[GenerateRequest, RegisterTemplateRequest, UnregisterTemplateRequest,
                          CancelRequest, StatsRequest, PingRequest], Field(discriminator="type")]
Reply = Annotated[Union[Accepted, Rejected, Token, Result, ErrorReply, TemplateRegistered,
                        TemplateUnregistered, Cancelled, StatsReply, Pong], Field(discriminator="type")]

REQUEST_TYPES: dict[str, type[BaseModel]] = {
    model.model_fields["type"].default: model for model in get_args(get_args(Request)[0])}
REPLY_TYPES: dict[str, type[BaseModel]] = {
    model.model_fields["type"].default: model for model in get_args(get_args(Reply)[0])}
NON_FINAL_REPLIES = (Accepted, Token)


class ProtocolError(Exception):
    """A frame that is not a valid message; the server answers it with :meth:`to_reply`."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    def to_reply(self) -> ErrorReply:
        return ErrorReply(id=self.request_id, code=self.code, message=self.message)


def is_final(reply: BaseModel) -> bool:
    """True for the one reply that ends a request id; ``accepted`` and ``token`` are not final."""
    return not isinstance(reply, NON_FINAL_REPLIES)


def encode(message: BaseModel) -> bytes:
    """One frame: the message's fields (``v`` and ``type`` included) as a msgpack map."""
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def decode_request(frame: bytes, max_bytes: int | None = None) -> Request:
    """Parse a client frame; anything wrong raises :class:`ProtocolError` and nothing else."""
    return _decode(frame, REQUEST_TYPES, MAX_MESSAGE_BYTES if max_bytes is None else max_bytes)


def decode_reply(frame: bytes, max_bytes: int | None = None) -> Reply:
    """Parse a server frame (the client side); errors raise :class:`ProtocolError`."""
    return _decode(frame, REPLY_TYPES, MAX_MESSAGE_BYTES if max_bytes is None else max_bytes)


def _decode(frame: bytes, kinds: dict[str, type[BaseModel]], max_bytes: int) -> Any:
    obj = _unpack(frame, max_bytes)
    request_id = _request_id(obj)
    model = kinds[_message_type(obj, kinds, request_id)]
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ProtocolError("VALIDATION", _describe(exc, obj["type"]), request_id) from None


def _unpack(frame: bytes, max_bytes: int) -> dict[str, Any]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("MALFORMED", f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError("TOO_LARGE", f"message is {len(frame)} bytes; the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # untrusted bytes: every unpacker failure means "not msgpack"
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ProtocolError("MALFORMED", f"not a msgpack message ({detail})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("MALFORMED", f"a message must be a msgpack map, got {type(obj).__name__}")
    if not all(isinstance(key, str) for key in obj):
        raise ProtocolError("MALFORMED", "map keys must be strings")
    return obj


def _request_id(obj: dict[str, Any]) -> str | None:
    """The id to answer an invalid message with, when it is a usable one."""
    value = obj.get("id")
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None


def _message_type(obj: dict[str, Any], kinds: dict[str, type[BaseModel]], request_id: str | None) -> str:
    version = obj.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        shown = "missing" if "v" not in obj else f"{version!r} is not supported"
        raise ProtocolError("VALIDATION", f"field 'v' (protocol version): {shown}; this end speaks "
                            f"version {PROTOCOL_VERSION}", request_id)
    kind = obj.get("type")
    if not isinstance(kind, str):
        shown = "missing" if "type" not in obj else f"must be a string, got {type(kind).__name__}"
        raise ProtocolError("VALIDATION", f"field 'type': {shown}", request_id)
    if kind not in kinds:
        raise ProtocolError("UNKNOWN_TYPE", f"field 'type': unknown message type {kind[:64]!r}; "
                            f"expected one of {', '.join(kinds)}", request_id)
    return kind


def _describe(exc: ValidationError, kind: str) -> str:
    """'field 'max_tokens': Input should be ...' for the first problems, so the client can fix them."""
    parts = []
    for error in exc.errors(include_url=False)[:3]:
        field = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if not field:  # a rule across fields; its message names them
            parts.append(message)
        elif error["type"] == "extra_forbidden":
            parts.append(f"field {field!r}: unknown field for {kind!r} (protocol v{PROTOCOL_VERSION})")
        else:
            shown = "" if error["type"] == "missing" else repr(error.get("input"))[:60]
            parts.append(f"field {field!r}: {message}" + (f" (got {shown})" if shown else ""))
    extra = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {extra} more" if extra > 0 else "")
