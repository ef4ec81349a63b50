"""The in-process replay backend: an ``LLMEngine`` in this process, owned by one ``EngineThread``.

Requests, template pins and timeline samples all go through that thread, so the engine is only
ever touched by its owner. Each template is pinned before any request runs, and every prompt is
tokenized before the first one is sent, so tokenizing never sits on a request's measured path.
The helpers below the backend run *on* the engine thread, between steps. torch is imported only
when the engine is loaded.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ricllm.errors import RicllmError
from ricllm.report.records import timeline_sample

if TYPE_CHECKING:
    from ricllm.engine.chat_prefix import ChatPrefix
    from ricllm.template import Template


class InProcessBackend:
    """An engine in this process: one thread owns it; requests, pins and samples go through it."""

    mode = "in_process"

    def __init__(self, engine_kwargs: dict[str, Any]):
        self.engine_kwargs = engine_kwargs
        self.thread = None
        self.prompts: dict[int, list[int]] = {}
        self.templates: dict[str, Template] = {}
        self.sampler = _EngineSampler()

    async def start(self, plan: list, templates: dict[str, Template],
                    adapters: dict[str, Path] | None = None) -> dict[str, dict]:
        """Load the engine on its own thread (off the event loop), load the templates' adapters
        (``adapters``: folder by the name a template gives as its ``adapter``), pin each template
        (compiling its constraint, under its adapter), and tokenize every prompt now."""
        from ricllm.engine.async_engine import EngineThread

        loop = asyncio.get_running_loop()
        self.thread = await loop.run_in_executor(None, EngineThread, self._load)
        try:
            return await self._prepare(plan, templates, adapters or {})
        except BaseException:  # the replay stops here: its engine thread goes with it
            await loop.run_in_executor(None, self.thread.stop, 60)
            raise

    async def _prepare(self, plan: list, templates: dict[str, Template], adapters: dict[str, Path]) -> dict[str, dict]:
        for name, folder in adapters.items():
            await _await(self.thread.call(lambda e, n=name, f=folder: e.loras.add(n, f)))
        self.templates = templates
        pinned, prefixes = {}, {}
        for name, template in templates.items():
            try:
                pinned[name], prefixes[name] = await _await(self.thread.call(lambda e, t=template: _pin_template(e, t)))
            except RicllmError as exc:  # a constraint the engine cannot compile, a template that does not fit
                raise type(exc)(f"template {name!r}: {exc}") from None
        tokenizer = self.thread.engine.tokenizer
        self.prompts = await asyncio.get_running_loop().run_in_executor(None, _render_all, tokenizer, plan, prefixes)
        return pinned

    def _load(self):
        from ricllm.config import EngineConfig
        from ricllm.engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(**self.engine_kwargs))

    async def generate(self, planned, spec, record, t0: float) -> None:
        """Submit and fill ``record`` from the engine's ``RequestOutput``."""
        from ricllm.sampling_params import SamplingParams

        from ricllm.lora_request import LoRARequest

        template = self.templates.get(planned.template)
        adapter = template.adapter if template is not None else None
        record.adapter = adapter
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                ignore_eos=spec.ignore_eos, deadline_ms=spec.deadline_ms,
                                priority=spec.resolved_priority(), structured=template.structured if template else None,
                                kv_window=spec.kv_window, kv_sinks=spec.kv_sinks,
                                fallback=template.fallback if template else None)
        first: dict[str, float] = {}
        sent = time.perf_counter()
        record.sent_s = sent - t0
        future = self.thread.submit(self.prompts[planned.index], params, planned.request_id,
                                    on_step=lambda seq: first.setdefault("t", time.perf_counter()),
                                    lora_request=LoRARequest(adapter) if adapter is not None else None)
        try:
            output, done = await _await(future, stamp=True)
        except RicllmError as exc:
            record.finish("error", rejection_message=str(exc), done_s=time.perf_counter() - t0)
            return
        _fill_from_output(record, output, sent, first.get("t"), done, t0)

    async def sample(self) -> dict[str, Any]:
        return await _await(self.thread.call(self.sampler))

    def fault_cpus(self) -> tuple[int, ...]:
        """Where a fault phase's noisy neighbour spins: the engine's CPUs (``engine_cpus``, else this
        process's)."""
        import os

        cpus = self.engine_kwargs.get("engine_cpus")
        if cpus is None:
            return tuple(sorted(os.sched_getaffinity(0)))
        from ricllm.affinity import check_engine_cpus

        return check_engine_cpus(cpus)  # counted within this process's CPUs, as the engine reads them

    @staticmethod
    def slowdowns(info: dict[str, Any], t0: float) -> list[dict[str, Any]] | None:
        """The slowdown detector's verdicts in replay seconds (the engine's clock is ``perf_counter``,
        the replay's too); None without admission, which runs the detector."""
        admission = info.get("admission") or {}
        if admission.get("policy", "off") == "off" or "slowdowns" not in admission:
            return None
        def rounded(event: dict, key: str) -> float | None:
            return None if event.get(key) is None else round(event[key], 4)

        return [{"t_s": round(e["time"] - t0, 4), "slow": e["slow"], "slowdown": rounded(e, "slowdown"),
                 "typical_ratio": rounded(e, "typical_ratio"), "step_multiplier": rounded(e, "step_multiplier")}
                for e in admission["slowdowns"]]

    async def finish(self, interrupted: bool) -> dict[str, Any]:
        """Engine settings and final counters, then stop the thread; after Ctrl-C what still runs is
        ended first, so the thread stops at once (one killed mid-step at exit aborts the process)."""
        info = await asyncio.wait_for(_await(self.thread.call(_engine_info)), 30)
        if interrupted:
            info["cancelled_at_interrupt"] = await _await(self.thread.call(_cancel_all))
        await asyncio.get_running_loop().run_in_executor(None, self.thread.stop, 60)
        return info


async def _await(future: Future, stamp: bool = False) -> Any:
    """Await a thread's future without ever cancelling it (the engine thread would then fail to
    set its result); with ``stamp`` also return the time it completed, taken on that thread."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def relay(done: Future) -> None:
        finished = time.perf_counter()

        def settle() -> None:
            if waiter.done():
                return
            if done.exception() is not None:
                waiter.set_exception(done.exception())
            else:
                waiter.set_result((done.result(), finished) if stamp else done.result())
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the replay's loop is gone (interrupted run): nobody waits any more
            pass

    future.add_done_callback(relay)
    return await waiter


# ------------------------------------------------------------ engine-thread helpers (in-process)

def _render_all(tokenizer, plan: list, prefixes: dict[str, ChatPrefix]) -> dict[int, list[int]]:
    return {p.index: _render_prompt(tokenizer, prefixes.get(p.template), p.user_prompt) for p in plan}


def _render_prompt(tokenizer, prefix: ChatPrefix | None, user: str) -> list[int]:
    """The template's conversation and the user turn, chat-rendered: the conversation's part is its
    pinned prefix's own tokens, so the request hits the pinned blocks token for token."""
    from ricllm.engine.chat_prefix import render_chat_request

    return render_chat_request(tokenizer, prefix, [{"role": "user", "content": user}])


def _pin_template(engine, template: Template) -> tuple[dict[str, int], ChatPrefix]:
    """Runs on the engine thread before any request: the engine pins the template (its constraint
    compiled once, so no request pays for it; a schema it cannot compile fails here) and computes
    the whole conversation's KV (system prompt and worked examples)."""
    pinned = engine.pin_template(template)
    return {"tokens": pinned.num_tokens, "pinned_tokens": pinned.num_pinned_tokens}, pinned.prefix


class _EngineSampler:
    """Runs on the engine thread between steps: what the timeline plots, including the steps run
    since the previous sample and their mean duration (found by the last record already seen)."""

    def __init__(self) -> None:
        self._seen = None

    def __call__(self, engine) -> dict[str, Any]:
        snap = engine.snapshot()
        admitting = snap.policy != "off"
        new = self._new_steps(engine.step_history)
        last = engine.step_history[-1].features if engine.step_history else None
        return {**timeline_sample(snap.kv_cache, snap.running, snap.waiting),
                **_latency_figures(snap.latency),
                "steps": len(new), "step_ms_mean": 1000 * sum(r.duration_s for r in new) / len(new) if new else None,
                "decode_seqs_mean": sum(r.features.num_decode_seqs for r in new) / len(new) if new else None,
                "last_step_prefill_tokens": last.num_prefill_tokens if last else 0,
                "admitted_total": snap.admitted if admitting else None,
                "rejected_total": sum(snap.rejected.values()) if admitting else None,
                "met_total": snap.deadlines_met, "missed_total": snap.deadlines_missed}

    def _new_steps(self, history) -> list:
        new = []
        for record in reversed(history):
            if record is self._seen:
                break
            new.append(record)
        self._seen = history[-1] if history else None
        return new[::-1]


def _latency_figures(latency) -> dict[str, float | None]:
    """What the bounds add to the fit now, per kind of step (``LatencyStats``); None without admission."""
    return {"latency_decode_multiplier": latency.decode_multiplier if latency else None,
            "latency_prefill_multiplier": latency.prefill_multiplier if latency else None,
            "latency_after_idle_multiplier": latency.after_idle_multiplier if latency else None}


def _cancel_all(engine) -> int:
    """Runs on the engine thread: end every unfinished request now (finish reason ``cancelled``)."""
    return engine.abort_all("cancelled")


def _engine_info(engine) -> dict[str, Any]:
    """Runs on the engine thread at the end: settings, final counters, model identity."""
    snap = engine.snapshot()
    return {"source": "in_process", "settings": engine.config.model_dump(mode="json"), "kv_cache": asdict(snap.kv_cache),
            "admission": snap.admission_report(), "startup_s": engine.startup_s,
            "device": str(engine.runtime.device), "dtype": str(engine.runtime.dtype).removeprefix("torch."),
            "attention_backend": engine.runtime.attention_backend, "threads": engine.runtime.threads,
            "runtime": engine.runtime.name,
            "model": engine.served_model.record()}


def _fill_from_output(record, output, sent: float, first: float | None, done: float, t0: float) -> None:
    common = dict(done_s=done - t0, client_e2e_s=done - sent)
    if output.finish_reason == "rejected":
        rejection = output.rejection
        record.finish("rejected", admitted=False, rejection_code=rejection.code,
                      rejection_message=rejection.message, rejection_numbers=dict(rejection.numbers), **common)
        return
    if first is None and output.token_ids:
        first = done  # finished in the step that produced its first token
    record.finish("completed", admitted=True, finish_reason=output.finish_reason, server_queue_s=output.queue_s,
                  server_ttft_s=output.ttft_s, server_e2e_s=output.e2e_s,
                  client_ttft_s=None if first is None else first - sent,
                  prompt_tokens=len(output.prompt_token_ids), output_tokens=len(output.token_ids),
                  cached_tokens=output.num_cached_tokens, met=output.deadline_met, text=output.text,
                  granted_max_tokens=output.degradation.granted_max_tokens if output.degradation else None,
                  num_forced_tokens=output.num_forced_tokens, predicted_e2e_s=output.predicted_e2e_s,
                  promised_e2e_s=output.promised_e2e_s, confidence=output.confidence, model_text=output.model_text,
                  **common)
