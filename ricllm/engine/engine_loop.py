"""The one engine-owning thread: builds an ``LLMEngine`` on its own thread and runs it, taking
commands from an inbox between steps. What a command means and where outputs go is the plugged-in
``EngineDriver``'s: the futures of ``EngineThread`` (:mod:`ricllm.engine.async_engine`) or the
socket replies of ``ricllm serve`` (:mod:`ricllm.serve.worker`).

Invariant: only this thread touches the engine, and every driver hook runs on it. Commands wait in
the inbox until the thread takes them all between two steps, so admission decides within one step
of a command's arrival.

The engine is built on this thread (given an ``EngineConfig`` or a factory): libgomp, the OpenMP
runtime of torch and of ricllm's C kernels, keeps one worker pool per thread that starts parallel
regions. Once a second pool exists (the building thread's, still alive) and the pools' threads
outnumber the cores, libgomp stops spinning between regions, and every region puts its workers to
sleep and wakes them again: on 2 cores an 8 ms decode step took 22 ms. Building here also moves
this thread onto ``engine_cpus`` (``LLMEngine`` pins the thread that builds it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Union

from ricllm.config import EngineConfig
from ricllm.engine.collector import FullCollections

if TYPE_CHECKING:
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.outputs import RequestOutput

EngineSource = Union["LLMEngine", EngineConfig, Callable[[], "LLMEngine"]]

INBOX_WAIT_S = 0.05  # how long an idle loop waits for a command before it looks at stopping again


def build_engine(source: EngineSource) -> LLMEngine:
    """An engine built elsewhere as it is; a config or a factory built here, on the calling thread."""
    from ricllm.engine.llm_engine import LLMEngine  # here: the server imports this module before it needs torch

    if isinstance(source, LLMEngine):
        return source
    return LLMEngine(source) if isinstance(source, EngineConfig) else source()


class EngineDriver:
    """What an owner plugs into ``EngineLoop``; every hook runs on the engine thread, in this order:

    ``on_ready(engine)`` once built (``on_load_failed(exc)`` instead if the build raised), then
    rounds of ``on_commands(commands)`` (all that the inbox held; maybe none), one step whose
    outputs go to ``on_outputs``, and ``after_round(idle)``. With no work left, ``stop_requested()``
    and an empty inbox the loop calls ``on_stopped()`` and ends; an exception ends it through
    ``on_fault(exc)`` (called inside the ``except``, so it may log the traceback). ``on_exit()``
    comes last, always. The defaults do nothing.
    """

    def on_ready(self, engine: LLMEngine) -> None:
        pass

    def on_load_failed(self, exc: BaseException) -> None:
        pass

    def on_commands(self, commands: list[Any]) -> None:
        pass

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        pass

    def after_round(self, idle: bool) -> None:
        """``idle``: the engine had no work and no command came during the whole wait."""

    def stop_requested(self) -> bool:
        return False

    def on_stopped(self) -> None:
        pass

    def on_fault(self, exc: Exception) -> None:
        pass

    def on_exit(self) -> None:
        pass


class EngineLoop:
    """Owns one engine on one thread: ``start()``, then ``wait_built()`` if the caller needs it.

    ``inbox`` is whatever queue the commands arrive on (the server's is bounded); each item goes
    to ``driver.on_commands`` unchanged.
    """

    def __init__(self, source: EngineSource, driver: EngineDriver, inbox: queue.Queue | None = None,
                 name: str = "ricllm-engine") -> None:
        self.engine: LLMEngine | None = None  # set on the engine thread, before its loop starts
        self.driver = driver
        self.inbox: queue.Queue = queue.Queue() if inbox is None else inbox
        self._source = source
        self._built: Future = Future()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait_built(self) -> None:
        """Wait until the engine is built; re-raises its build error here."""
        self._built.result()

    def _run(self) -> None:
        try:
            engine = build_engine(self._source)
        except BaseException as exc:  # the build error belongs to whoever waits for it
            self._built.set_exception(exc)
            self.driver.on_load_failed(exc)
            self.driver.on_exit()
            return
        self.engine = engine
        self._built.set_result(None)
        try:
            self.driver.on_ready(engine)
            self._loop(engine)
        except Exception as exc:
            self.driver.on_fault(exc)
        finally:
            self.driver.on_exit()

    def _loop(self, engine: LLMEngine) -> None:
        """Commands, then one step, until stopped: no work, nothing queued, and a stop requested.
        Full garbage collections run at idle rounds only (``collector``)."""
        driver, collections = self.driver, FullCollections()
        collections.hold()
        try:
            while True:
                was_idle = not engine.has_unfinished()
                commands = self._take(block=was_idle)
                driver.on_commands(commands)
                if engine.has_unfinished():
                    driver.on_outputs(engine.step())
                elif driver.stop_requested() and self.inbox.empty():
                    driver.on_stopped()
                    return
                driver.after_round(was_idle and not commands)
                collections.after_round(was_idle and not commands)
        finally:
            collections.release()

    def _take(self, block: bool) -> list[Any]:
        """Everything queued; with ``block`` (nothing to step) wait a little for the first one."""
        commands = []
        try:
            commands.append(self.inbox.get(timeout=INBOX_WAIT_S) if block else self.inbox.get_nowait())
            while True:
                commands.append(self.inbox.get_nowait())
        except queue.Empty:
            return commands
