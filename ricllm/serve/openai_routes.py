"""The OpenAI-compatible API's handlers (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``).

Each request is sent to the engine the way a ZeroMQ client's is, through the ROUTER socket itself:
an :class:`~ricllm.client.AsyncRicClient` on the HTTP thread's event loop, connected over inproc to
the address the ROUTER also binds. So one engine thread, one inbound queue and one admission see
every request, the socket thread's checks (``DRAINING``, ``QUEUE_FULL``, one final reply per id)
hold for these too, and nothing here touches the engine. The cost is a msgpack encode and decode
per reply, on the HTTP thread, and the socket thread relaying the HTTP clients' replies.

Refusals become HTTP errors before any response starts: a stream's headers go out only once the
request is ``accepted``. A client that disconnects cancels its request, so the engine stops
spending on an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ricllm import protocol as p
from ricllm.client import AsyncRicClient, RejectedError, ServerError
from ricllm.logging import get_logger
from ricllm.serve import openai_replies as r
from ricllm.serve.openai_models import ChatCompletionBody, CompletionBody, OpenAIError, describe, invalid

if TYPE_CHECKING:
    import zmq

log = get_logger("ricllm.serve.openai")

# A reply to wait for: admission answers between steps, a token comes each step; only a request
# queued behind long best-effort work waits longer, and the socket thread answers every request
# id before it ends, so this bounds only a server that hangs.
REPLY_TIMEOUT_S = 3600.0
OWNER = "ricllm"


class OpenAIApi:
    """The routes, and the one in-process client they share (made on the HTTP thread's loop)."""

    def __init__(self, local_endpoint: str, context: zmq.Context) -> None:
        self._client = AsyncRicClient(local_endpoint, timeout_s=REPLY_TIMEOUT_S, context=context)
        self._model: p.ModelIdentity | None = None

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- the served model

    async def _identity(self) -> p.ModelIdentity:
        """Asked of the engine once (a ``stats`` request: it waits while the model loads)."""
        if self._model is None:
            try:
                self._model = (await self._client.stats()).model
            except ServerError as exc:
                raise r.server_error(exc.code, exc.message) from None
        return self._model

    async def _served_name(self) -> str:
        return (await self._identity()).served_name

    async def _check_model(self, requested: str) -> str:
        """The model a request names must be this one: its name, or its file's name (with or without suffix)."""
        identity = await self._identity()
        name = identity.served_name
        if not identity.served_model().answers_to(requested):
            raise OpenAIError(404, f"The model {requested!r} does not exist; this server serves {name!r}",
                              code="model_not_found", param="model")
        return name

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER, "root": self._model.path,
                "parent": None}

    async def models(self, request: Request) -> Response:
        return await _answered(self._models())

    async def _models(self) -> Response:
        name = await self._served_name()
        return JSONResponse({"object": "list", "data": [self._model_card(name)]})

    async def model(self, request: Request) -> Response:
        return await _answered(self._one_model(request.path_params["model"]))

    async def _one_model(self, requested: str) -> Response:
        return JSONResponse(self._model_card(await self._check_model(requested)))

    # -- generation

    async def completions(self, request: Request) -> Response:
        return await _answered(self._generate(request, CompletionBody, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return await _answered(self._generate(request, ChatCompletionBody, chat=True))

    async def _generate(self, request: Request, model: type[CompletionBody | ChatCompletionBody],
                        chat: bool) -> Response:
        body = await _parse(request, model)
        answer = r.Answer(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", await self._check_model(body.model))
        generate = body.to_generate(answer.id)
        log.debug("openai_request", id=answer.id, route=request.url.path, stream=body.stream,
                  max_tokens=generate.max_tokens, deadline_ms=generate.deadline_ms)
        replies = self._client.submit(generate)
        try:
            accepted = await _accepted(replies)
        except BaseException:
            await _close(replies)
            raise
        if body.stream:
            events = _events(replies, r.Chunks(answer, chat), accepted, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_headers(accepted))
        try:
            result = await _until_result_or_disconnect(replies, request)
        finally:
            await _close(replies)
        if result is None:  # the client went away; its request was cancelled
            return Response(status_code=499)
        build = r.chat_completion if chat else r.completion
        return JSONResponse(build(answer, result, accepted), headers=_headers(accepted))


# ------------------------------------------------------------------------------ helpers

async def _answered(work: Any) -> Response:
    """The handler's response, or its error in OpenAI's shape."""
    try:
        return await work
    except OpenAIError as exc:
        log.info("openai_refused", status=exc.status, code=exc.code, param=exc.param, detail=exc.message)
        headers = {"x-should-retry": "false"} if exc.code == "DEADLINE_INFEASIBLE" else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _parse(request: Request, model: type[CompletionBody | ChatCompletionBody]) -> Any:
    try:
        document = json.loads(await request.body())
    except ValueError as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid("the body must be a JSON object")
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise describe(exc) from None


async def _accepted(replies: AsyncIterator[Any]) -> p.Accepted:
    """The first reply: ``accepted``, or the refusal as an HTTP error."""
    try:
        first = await anext(replies)
    except RejectedError as exc:
        raise r.refusal(exc.code, exc.message, exc.numbers) from None
    except ServerError as exc:
        raise r.server_error(exc.code, exc.message) from None
    except TimeoutError as exc:
        raise OpenAIError(500, str(exc), code="TIMEOUT") from None
    if not isinstance(first, p.Accepted):  # the engine answers every generate with accepted first
        raise OpenAIError(500, f"expected an accepted reply, got {type(first).__name__}", code="INTERNAL")
    return first


def _headers(accepted: p.Accepted) -> dict[str, str]:
    """Admission's promise (ms from receipt), for clients that read headers, not bodies."""
    return {} if accepted.bound_ms is None else {"x-ricllm-bound-ms": f"{accepted.bound_ms:g}"}


async def _result(replies: AsyncIterator[Any]) -> p.Result:
    async for reply in replies:
        if isinstance(reply, p.Result):
            return reply
    raise OpenAIError(500, "the server ended the request without a result", code="INTERNAL")


async def _until_result_or_disconnect(replies: AsyncIterator[Any], request: Request) -> p.Result | None:
    """The result, or None once the client has gone (the body is read, so the next ASGI message is
    the disconnect)."""
    result = asyncio.ensure_future(_result(replies))
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
    try:
        return result.result()
    except ServerError as exc:  # an engine fault or a drain's end after acceptance
        raise r.server_error(exc.code, exc.message) from None
    except TimeoutError as exc:
        raise OpenAIError(500, str(exc), code="TIMEOUT") from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _close(replies: Any) -> None:
    """Close the reply stream; one left unfinished cancels its request. Shielded: it runs while the
    handler is being cancelled (the client went away), and the cancel must still be sent."""
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(Exception):
            await replies.aclose()


async def _events(replies: AsyncIterator[Any], chunks: r.Chunks, accepted: p.Accepted,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token with text, the last with the finish reason (and any
    text the engine still held back), the usage if asked, then ``[DONE]``. Closed early (the client
    went away), the request is cancelled."""
    streamed: list[str] = []
    try:
        first = chunks.first()
        if first is not None:
            yield _sse(first)
        async for reply in replies:
            if isinstance(reply, p.Token) and reply.text:
                streamed.append(reply.text)
                yield _sse(chunks.text(reply.text))
            elif isinstance(reply, p.Result):
                sent = "".join(streamed)
                rest = reply.text[len(sent):] if reply.text.startswith(sent) else ""
                yield _sse(chunks.last(rest, reply, accepted))
                if include_usage:
                    yield _sse(chunks.usage(reply))
                break
    except (RejectedError, ServerError, TimeoutError) as exc:  # after the headers: an error event
        code = getattr(exc, "code", "TIMEOUT")
        yield _sse(r.server_error(code, getattr(exc, "message", str(exc))).body())
    finally:
        await _close(replies)
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
