"""The online engine: one thread owns the ``LLMEngine`` and steps it back to back, while callers
on other threads (a socket loop, a replay) or on an asyncio loop submit requests.

Invariant: only the engine thread touches the engine. Requests and calls wait in an inbox that
the thread drains between steps, so admission decides within one step of arrival, and the
deadline counts from that moment, on the engine's clock.

The engine is best built on that thread too (pass an ``EngineConfig`` or a factory): libgomp,
the OpenMP runtime of torch and of ricllm's C kernels, keeps one worker pool per thread that
starts parallel regions. Once a second pool exists (the building thread's, still alive) and the
pools' threads outnumber the cores, libgomp stops spinning between regions, and every region
puts its workers to sleep and wakes them again: on 2 cores an 8 ms decode step took 22 ms.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Union

from ricllm.config import EngineConfig
from ricllm.engine.llm_engine import LLMEngine
from ricllm.engine.sequence import Sequence
from ricllm.outputs import RequestOutput
from ricllm.sampling_params import SamplingParams

TokenCallback = Callable[[Sequence], None]


EngineSource = Union[LLMEngine, EngineConfig, Callable[[], LLMEngine]]


class EngineThread:
    """Owns an engine on one thread. ``source``: an ``EngineConfig`` or a factory, built on that
    thread (returns once it is built; a build error is raised here), or an engine built elsewhere."""

    def __init__(self, source: EngineSource):
        self.engine: LLMEngine | None = None  # set on the engine thread, before its loop starts
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, tuple[Future, TokenCallback | None]] = {}
        self._stopping = threading.Event()
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(source, built), name="ricllm-engine", daemon=True)
        self._thread.start()
        built.result()  # waits for the build; re-raises its error here

    def _run(self, source: EngineSource, built: Future) -> None:
        try:
            engine = source if isinstance(source, LLMEngine) else (
                LLMEngine(source) if isinstance(source, EngineConfig) else source())
        except BaseException as exc:  # the constructor re-raises it on the caller's thread
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(None)
        self._loop()

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
               on_step: TokenCallback | None = None) -> Future:
        """Queue a request; the future resolves to its ``RequestOutput`` (rejected ones too).

        ``on_step(seq)`` runs on the engine thread after every step that gave the request a token.
        Malformed input sets the future's exception.
        """
        future: Future = Future()
        self._inbox.put(("request", (prompt, params, request_id, on_step), future))
        return future

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps (pins, stats, cancels)."""
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued and running request, then stop the thread."""
        self._stopping.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            if idle and self._stopping.is_set() and self._inbox.empty():
                return
            self._drain_inbox(block=idle)
            if self.engine.has_unfinished():
                self._deliver(self.engine.step())

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _handle(self, kind: str, payload, future: Future | None) -> None:
        if kind == "call":
            self._run_call(payload, future)
        elif kind == "request":
            prompt, params, request_id, on_step = payload
            try:
                seq = self.engine.add_request(prompt, params, request_id)
            except Exception as exc:  # malformed input: the caller gets the error, the loop goes on
                future.set_exception(exc)
                return
            self._pending[seq.request_id] = (future, on_step)

    def _run_call(self, fn: Callable[[LLMEngine], object], future: Future) -> None:
        try:
            future.set_result(fn(self.engine))
        except Exception as exc:  # the caller sees it; the engine thread goes on
            future.set_exception(exc)

    def _deliver(self, finished: list[RequestOutput]) -> None:
        for seq in self.engine.scheduler.running:
            listener = self._pending.get(seq.request_id, (None, None))[1]
            if listener is not None and seq.num_output_tokens:
                listener(seq)
        for output in finished:
            future, _ = self._pending.pop(output.request_id, (None, None))
            if future is not None:
                future.set_result(output)


class AsyncLLMEngine:
    """asyncio face of ``EngineThread``: ``await generate(...)`` and ``async for`` text deltas."""

    def __init__(self, source: EngineSource):
        """``source`` as for ``EngineThread``: an ``EngineConfig`` builds the engine on its thread."""
        self.worker = EngineThread(source)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> RequestOutput:
        return await asyncio.wrap_future(self.worker.submit(prompt, params, request_id))

    async def stream(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[str | RequestOutput]:
        """Text deltas as tokens arrive, then the final ``RequestOutput``."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        sent = {"length": 0}

        def on_step(seq: Sequence) -> None:
            text = seq.output_text
            if len(text) > sent["length"]:
                loop.call_soon_threadsafe(deltas.put_nowait, text[sent["length"]:])
                sent["length"] = len(text)

        future = asyncio.wrap_future(self.worker.submit(prompt, params, request_id, on_step))
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
