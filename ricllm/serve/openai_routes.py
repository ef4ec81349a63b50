"""The OpenAI-compatible API's handlers (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``).

A request is checked once, at this edge: its body by its pydantic model, turned into the wire
protocol's ``GenerateRequest``. It is then offered to the server's intake (:mod:`ricllm.serve.intake`),
the same one ZeroMQ requests meet (``DUPLICATE_ID``, ``DRAINING``, ``QUEUE_FULL``, one final reply
per id), which puts it on the engine thread's inbox as it is: no ZeroMQ socket, no encoding. The
engine thread answers it along a :class:`~ricllm.serve.handoff.LocalRoute`, straight onto this
thread's event loop. Its arrival is stamped on the engine's clock as the handler starts, before the
body is read: its deadline, its ``timings`` and admission's ``bound_ms`` count from then.

Refusals become HTTP errors before any response starts: a stream's headers go out only once the
request is ``accepted``. A client that disconnects cancels its request, so the engine stops
spending on an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ricllm import protocol as p
from ricllm.engine.stats import AdapterStats
from ricllm.logging import get_logger
from ricllm.serve import openai_replies as r
from ricllm.serve.handoff import Command, LocalRoute, clock
from ricllm.serve.openai_models import ChatCompletionBody, CompletionBody, OpenAIError, describe, invalid

if TYPE_CHECKING:
    from ricllm.serve.intake import Intake

log = get_logger("ricllm.serve.openai")

# A reply to wait for: admission answers between steps, a token comes each step; only a request
# queued behind long best-effort work waits longer, and the intake answers every request id once
# the engine thread has ended, so this bounds only a server that hangs.
REPLY_TIMEOUT_S = 3600.0
OWNER = "ricllm"


class EngineExchange:
    """One request handed from the HTTP thread to the engine thread, and its replies (made and used
    on the HTTP thread's event loop)."""

    def __init__(self, intake: Intake, request: BaseModel, received: float) -> None:
        self.request, self.received = request, received
        self._intake = intake
        self._replies: asyncio.Queue[BaseModel] = asyncio.Queue()
        self._route = LocalRoute(asyncio.get_running_loop(), self._replies.put_nowait, intake.release)
        self.finished = False

    def offer(self) -> None:
        """Hand it to the intake; a refusal there raises here, as its HTTP error."""
        answer = self._intake.offer(Command(self._route, self.request, self.received))
        if answer is not None:
            self.finished = True
            raise _http_error(answer)

    async def next(self) -> BaseModel:
        """The next reply (``TimeoutError`` after ``REPLY_TIMEOUT_S``)."""
        reply = await asyncio.wait_for(self._replies.get(), REPLY_TIMEOUT_S)
        self.finished = p.is_final(reply)
        return reply

    def cancel(self) -> None:
        """Cancel it unless its final reply came (best effort: a full inbound queue drops the cancel).
        No ``await``: it runs while the handler is being cancelled (the client went away)."""
        if self.finished:
            return
        self.finished = True
        cancel = p.CancelRequest(id=uuid.uuid4().hex, target_id=self.request.id)
        self._intake.offer(Command(self._route, cancel, clock()))


class OpenAIApi:
    """The routes, and the intake they hand their requests to.

    A request's ``model`` is the base model (its served name, or its file's name) or one of the LoRA
    adapters the engine holds, by name (as vLLM serves ``--lora-modules``): the request is then served
    under that adapter. ``/v1/models`` lists the base, then each adapter with the base as its
    ``parent`` and its folder as its ``root``."""

    def __init__(self, intake: Intake, max_message_bytes: int,
                 adapters: Callable[[], Sequence[AdapterStats]] = tuple) -> None:
        """``max_message_bytes``: the largest body read, the bound a ZeroMQ frame meets too;
        ``adapters``: the adapters the engine thread last published (``ServerState.adapters``)."""
        self._intake = intake
        self._max_bytes = max_message_bytes
        self._adapters = adapters
        self._model: p.ModelIdentity | None = None

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    # -- the served model

    async def _identity(self) -> p.ModelIdentity:
        """Asked of the engine once (a ``stats`` request: it waits while the model loads)."""
        if self._model is None:
            exchange = EngineExchange(self._intake, p.StatsRequest(id=uuid.uuid4().hex), clock())
            exchange.offer()
            reply = await _reply(exchange)
            if not isinstance(reply, p.StatsReply):
                raise _http_error(reply)
            self._model = reply.stats.model
        return self._model

    async def _served_name(self) -> str:
        return (await self._identity()).served_name

    async def _check_model(self, requested: str) -> tuple[str, AdapterStats | None]:
        """The model a request names: this one (its name, or its file's name with or without suffix),
        or an adapter the engine holds; with the adapter it names, if any."""
        identity = await self._identity()
        name = identity.served_name
        if identity.served_model().answers_to(requested):
            return name, None
        adapter = next((a for a in self._adapters() if a.name == requested), None)
        if adapter is None:
            raise _model_not_found(requested, [name, *(a.name for a in self._adapters())])
        return adapter.name, adapter

    def _model_card(self, name: str, adapter: AdapterStats | None = None) -> dict[str, Any]:
        if adapter is not None:  # vLLM's card of a LoRA module
            return {"id": adapter.name, "object": "model", "created": 0, "owned_by": OWNER, "root": adapter.path,
                    "parent": name}
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER, "root": self._model.path,
                "parent": None}

    async def models(self, request: Request) -> Response:
        return await _answered(self._models())

    async def _models(self) -> Response:
        name = await self._served_name()
        cards = [self._model_card(name), *(self._model_card(name, a) for a in self._adapters())]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        return await _answered(self._one_model(request.path_params["model"]))

    async def _one_model(self, requested: str) -> Response:
        name, adapter = await self._check_model(requested)
        return JSONResponse(self._model_card(await self._served_name(), adapter) if adapter else self._model_card(name))

    # -- generation

    async def completions(self, request: Request) -> Response:
        return await _answered(self._generate(request, CompletionBody, chat=False, received=clock()))

    async def chat_completions(self, request: Request) -> Response:
        return await _answered(self._generate(request, ChatCompletionBody, chat=True, received=clock()))

    async def _generate(self, request: Request, model: type[CompletionBody | ChatCompletionBody],
                        chat: bool, received: float) -> Response:
        """``received``: the request's arrival on the engine's clock, stamped before its body is read."""
        body = await _parse(request, model, self._max_bytes)
        name, adapter = await self._check_model(body.model)
        answer = r.Answer(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", name)
        generate = body.to_generate(answer.id, adapter.name if adapter is not None else None)
        log.debug("openai_request", id=answer.id, route=request.url.path, stream=body.stream,
                  max_tokens=generate.max_tokens, deadline_ms=generate.deadline_ms)
        exchange = EngineExchange(self._intake, generate, received)
        exchange.offer()
        try:
            accepted = await _accepted(exchange)
        except OpenAIError as exc:
            exchange.cancel()
            if exc.code == "UNKNOWN_ADAPTER":  # removed since it was listed: as an unknown model
                raise _model_not_found(body.model, [await self._served_name(), *(a.name for a in self._adapters())]) \
                    from None
            raise
        except BaseException:
            exchange.cancel()
            raise
        if body.stream:
            events = _events(exchange, r.Chunks(answer, chat), accepted, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_headers(accepted))
        try:
            result = await _until_result_or_disconnect(exchange, request)
        finally:
            exchange.cancel()
        if result is None:  # the client went away; its request was cancelled
            return Response(status_code=499)
        build = r.chat_completion if chat else r.completion
        return JSONResponse(build(answer, result, accepted), headers=_headers(accepted))


# ------------------------------------------------------------------------------ helpers

def _model_not_found(requested: str, served: list[str]) -> OpenAIError:
    listed = ", ".join(repr(name) for name in served)
    return OpenAIError(404, f"The model {requested!r} does not exist; this server serves {listed} (the base model, "
                       "then its LoRA adapters)", code="model_not_found", param="model")


async def _answered(work: Any) -> Response:
    """The handler's response, or its error in OpenAI's shape."""
    try:
        return await work
    except OpenAIError as exc:
        log.info("openai_refused", status=exc.status, code=exc.code, param=exc.param, detail=exc.message)
        headers = {"x-should-retry": "false"} if exc.code in r.STALE_ON_RETRY else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _parse(request: Request, model: type[CompletionBody | ChatCompletionBody], max_bytes: int) -> Any:
    """The body, checked by its model; one over ``max_bytes`` is 413 ``TOO_LARGE``."""
    raw = await request.body()
    if len(raw) > max_bytes:
        raise r.server_error("TOO_LARGE", f"the body is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid("the body must be a JSON object")
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise describe(exc) from None


def _http_error(reply: BaseModel) -> OpenAIError:
    """A refusal (``rejected``) or an ``error`` reply as the HTTP error it is answered with."""
    if isinstance(reply, p.Rejected):
        return r.refusal(reply.code, reply.message, reply.numbers)
    if isinstance(reply, p.ErrorReply):
        return r.server_error(reply.code, reply.message)
    return OpenAIError(500, f"unexpected {type(reply).__name__} reply", code="INTERNAL")


async def _reply(exchange: EngineExchange) -> BaseModel:
    """The next reply; waiting past ``REPLY_TIMEOUT_S`` is a 500."""
    try:
        return await exchange.next()
    except TimeoutError:
        raise OpenAIError(500, f"no reply from the engine within {REPLY_TIMEOUT_S:g} s", code="TIMEOUT") from None


async def _accepted(exchange: EngineExchange) -> p.Accepted:
    """The first reply: ``accepted``, or the refusal as an HTTP error."""
    first = await _reply(exchange)
    if not isinstance(first, p.Accepted):  # the engine answers every generate with accepted first
        raise _http_error(first)
    return first


def _headers(accepted: p.Accepted) -> dict[str, str]:
    """Admission's promise (ms from arrival), for clients that read headers, not bodies."""
    return {} if accepted.bound_ms is None else {"x-ricllm-bound-ms": f"{accepted.bound_ms:g}"}


async def _result(exchange: EngineExchange) -> p.Result:
    while True:
        reply = await _reply(exchange)
        if isinstance(reply, p.Result):
            return reply
        if exchange.finished:  # an engine fault or a drain's end after acceptance
            raise _http_error(reply)


async def _until_result_or_disconnect(exchange: EngineExchange, request: Request) -> p.Result | None:
    """The result, or None once the client has gone (the body is read, so the next ASGI message is
    the disconnect)."""
    result = asyncio.ensure_future(_result(exchange))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
        await asyncio.gather(result, gone, return_exceptions=True)
    if result.cancelled():
        log.info("openai_client_gone", route=request.url.path)
        return None
    return result.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(exchange: EngineExchange, chunks: r.Chunks, accepted: p.Accepted,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token with text, the last with the finish reason (and any
    text the engine still held back), the usage if asked, then ``[DONE]``. Closed early (the client
    went away), the request is cancelled."""
    streamed: list[str] = []
    try:
        first = chunks.first()
        if first is not None:
            yield _sse(first)
        while not exchange.finished:
            reply = await _reply(exchange)
            if isinstance(reply, p.Token) and reply.text:
                streamed.append(reply.text)
                yield _sse(chunks.text(reply.text))
            elif isinstance(reply, p.Result):
                sent = "".join(streamed)
                rest = reply.text[len(sent):] if reply.text.startswith(sent) else ""
                yield _sse(chunks.last(rest, reply, accepted))
                if include_usage:
                    yield _sse(chunks.usage(reply))
            elif exchange.finished:  # after the headers: an error event
                yield _sse(_http_error(reply).body())
    except OpenAIError as exc:
        yield _sse(exc.body())
    finally:
        exchange.cancel()
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
