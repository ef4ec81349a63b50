"""The online API: ``EngineThread`` (requests from other threads, answered through futures) and
``AsyncLLMEngine`` (the same from asyncio), both an ``EngineLoop`` with ``RequestFutures`` plugged in.

The futures and the per-step callbacks are touched on the engine thread only (they arrive through
the inbox); callers on other threads only queue commands and wait on futures. A request's deadline
counts from its submission, on the engine's clock: the wait for the engine thread to take it
(up to a step) is part of it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from ricllm.engine.engine_loop import EngineDriver, EngineLoop, EngineSource
from ricllm.engine.llm_engine import LLMEngine
from ricllm.logging import get_logger
from ricllm.lora_request import LoRARequest
from ricllm.outputs import RequestOutput
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence

__all__ = ["AsyncLLMEngine", "EngineSource", "EngineThread", "RequestFutures"]

TokenCallback = Callable[[Sequence], None]

log = get_logger("ricllm.engine")


class RequestFutures(EngineDriver):
    """The futures plug-in: inbox items are ``(kind, payload, future)``; ``request`` adds a request
    whose future gets its ``RequestOutput``, ``call`` runs a function on the engine, ``wake`` only
    wakes the thread (to see ``stopping``)."""

    def __init__(self) -> None:
        self.engine: LLMEngine | None = None
        self.stopping = threading.Event()
        self._pending: dict[str, tuple[Future, TokenCallback | None]] = {}

    def on_ready(self, engine: LLMEngine) -> None:
        self.engine = engine

    def on_commands(self, commands: list[tuple[str, Any, Future | None]]) -> None:
        for kind, payload, future in commands:
            if kind == "call":
                self._run_call(payload, future)
            elif kind == "request":
                self._add(payload, future)

    def _add(self, payload: tuple, future: Future) -> None:
        prompt, params, request_id, on_step, submitted, lora_request = payload
        try:
            seq = self.engine.add_request(prompt, params, request_id, arrival_time=submitted, lora_request=lora_request)
        except Exception as exc:  # malformed input: the caller gets the error, the loop goes on
            future.set_exception(exc)
            return
        self._pending[seq.request_id] = (future, on_step)

    def _run_call(self, fn: Callable[[LLMEngine], object], future: Future) -> None:
        try:
            future.set_result(fn(self.engine))
        except Exception as exc:  # the caller sees it; the engine thread goes on
            future.set_exception(exc)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for seq in self.engine.scheduler.running:
            listener = self._pending.get(seq.request_id, (None, None))[1]
            if listener is not None and seq.num_output_tokens:
                listener(seq)
        for output in outputs:
            future, _ = self._pending.pop(output.request_id, (None, None))
            if future is not None:
                future.set_result(output)

    def stop_requested(self) -> bool:
        return self.stopping.is_set()

    def on_fault(self, exc: Exception) -> None:
        """The engine broke: every caller still waiting gets the error instead of waiting forever."""
        log.exception("engine_fault")
        for future, _ in self._pending.values():
            future.set_exception(exc)
        self._pending.clear()


class EngineThread(EngineLoop):
    """Owns an engine on one thread. ``source``: an ``EngineConfig`` or a factory, built on that
    thread (returns once it is built; a build error is raised here), or an engine built elsewhere."""

    def __init__(self, source: EngineSource) -> None:
        self.requests = RequestFutures()
        super().__init__(source, self.requests)
        self.start()
        self.wait_built()

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
               on_step: TokenCallback | None = None, lora_request: LoRARequest | None = None) -> Future:
        """Queue a request; the future resolves to its ``RequestOutput`` (rejected ones too).

        ``on_step(seq)`` runs on the engine thread after every step that gave the request a token.
        Malformed input (an unknown adapter included) sets the future's exception.
        """
        future: Future = Future()
        self.inbox.put(("request", (prompt, params, request_id, on_step, self.engine.clock(), lora_request), future))
        return future

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps (pins, stats, cancels)."""
        future: Future = Future()
        self.inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued and running request, then stop the thread."""
        self.requests.stopping.set()
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout)


class AsyncLLMEngine:
    """asyncio face of ``EngineThread``: ``await generate(...)`` and ``async for`` text deltas."""

    def __init__(self, source: EngineSource):
        """``source`` as for ``EngineThread``: an ``EngineConfig`` builds the engine on its thread."""
        self.worker = EngineThread(source)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, lora_request: LoRARequest | None = None) -> RequestOutput:
        return await asyncio.wrap_future(self.worker.submit(prompt, params, request_id, lora_request=lora_request))

    async def stream(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[str | RequestOutput]:
        """Text deltas as tokens arrive, then the final ``RequestOutput``."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        sent = {"length": 0}

        def on_step(seq: Sequence) -> None:
            text = seq.output_text
            if len(text) > sent["length"]:
                loop.call_soon_threadsafe(deltas.put_nowait, text[sent["length"]:])
                sent["length"] = len(text)

        future = asyncio.wrap_future(self.worker.submit(prompt, params, request_id, on_step, lora_request))
        while not future.done() or not deltas.empty():
            getter = asyncio.ensure_future(deltas.get())
            done, _ = await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
            else:
                getter.cancel()
        output = future.result()
        if len(output.text) > sent["length"]:
            yield output.text[sent["length"]:]
        yield output

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
