"""``ricllm replay SCENARIO``: send a scenario's requests on the trace's schedule and report.

The replay is open loop: every request leaves at its planned time whether or not earlier ones
were answered, as KPI reports arrive over E2 regardless of how busy the xApp is. It runs either
in-process (an ``LLMEngine`` on an ``EngineThread``, templates pinned through the thread) or
against a running ``ricllm serve`` over ZeroMQ (``--endpoint``); the ZeroMQ path never imports
torch, so it can run on a machine without it. A timeline sampler reads the engine's KV usage and
batch four times a second. Ctrl-C stops sending, marks what is still outstanding as
``interrupted`` and still writes the report of what ran; a second Ctrl-C aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ricllm.errors import RicllmError

SAMPLE_PERIOD_S = 0.25
QUIET_STATUS_PERIOD_S = 10.0
TRACE_SERIES_POINTS = 600
EXIT_TARGETS_MISSED = 1
EXIT_INTERRUPTED = 130


# ------------------------------------------------------------------------------------ backends

class InProcessBackend:
    """An engine in this process: one thread owns it; requests, pins and samples go through it."""

    mode = "in_process"

    def __init__(self, engine_kwargs: dict[str, Any]):
        self.engine_kwargs = engine_kwargs
        self.thread = None
        self.prompts: dict[int, list[int]] = {}
        self.sampler = _EngineSampler()

    async def start(self, plan: list, templates: dict[str, str]) -> dict[str, dict]:
        """Load the engine on its own thread (off the event loop), pin each template, and tokenize
        every prompt now."""
        from ricllm.engine.async_engine import EngineThread

        loop = asyncio.get_running_loop()
        self.thread = await loop.run_in_executor(None, EngineThread, self._load)
        engine = self.thread.engine
        pinned = {}
        for name, text in templates.items():
            pinned[name] = await _await(self.thread.call(lambda e, t=text: _pin_template(e, t)))
        self.prompts = await loop.run_in_executor(None, self._render_all, engine.tokenizer, plan, templates)
        return pinned

    def _load(self):
        from ricllm.config import EngineConfig
        from ricllm.engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(**self.engine_kwargs))

    @staticmethod
    def _render_all(tokenizer, plan: list, templates: dict[str, str]) -> dict[int, list[int]]:
        return {p.index: _render_prompt(tokenizer, templates.get(p.template), p.user_prompt) for p in plan}

    async def generate(self, planned, spec, record, t0: float) -> None:
        """Submit and fill ``record`` from the engine's ``RequestOutput``."""
        from ricllm.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                ignore_eos=spec.ignore_eos, deadline_ms=spec.deadline_ms,
                                priority=spec.resolved_priority())
        first: dict[str, float] = {}
        sent = time.perf_counter()
        record.sent_s = sent - t0
        future = self.thread.submit(self.prompts[planned.index], params, planned.request_id,
                                    on_step=lambda seq: first.setdefault("t", time.perf_counter()))
        try:
            output, done = await _await(future, stamp=True)
        except RicllmError as exc:
            record.finish("error", rejection_message=str(exc), done_s=time.perf_counter() - t0)
            return
        _fill_from_output(record, output, sent, first.get("t"), done, t0)

    async def sample(self) -> dict[str, Any]:
        return await _await(self.thread.call(self.sampler))

    async def finish(self, interrupted: bool) -> dict[str, Any]:
        """Engine settings and final counters, then stop the thread; after Ctrl-C what still runs is
        ended first, so the thread stops at once (one killed mid-step at exit aborts the process)."""
        info = await asyncio.wait_for(_await(self.thread.call(_engine_info)), 30)
        if interrupted:
            info["cancelled_at_interrupt"] = await _await(self.thread.call(_cancel_all))
        await asyncio.get_running_loop().run_in_executor(None, self.thread.stop, 60)
        return info


class ZmqBackend:
    """A running ``ricllm serve``: templates registered, requests streamed for the client's TTFT."""

    mode = "zmq"

    def __init__(self, endpoint: str, timeout_s: float):
        from ricllm.client import AsyncRicClient

        self.endpoint = endpoint
        self.client = AsyncRicClient(endpoint, timeout_s=timeout_s)
        self.template_ids: dict[str, str] = {}
        self.version: str | None = None

    async def start(self, plan: list, templates: dict[str, str]) -> dict[str, dict]:
        import hashlib

        try:
            self.version = (await self.client.ping(timeout_s=10)).version
        except TimeoutError:
            raise RicllmError(f"no ricllm server answers at {self.endpoint} (ping timed out after 10 s)") from None
        pinned = {}
        for name, text in templates.items():
            wanted = f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
            reply = await self.client.register_template(text, template_id=wanted)
            self.template_ids[name] = reply.template_id
            pinned[name] = {"template_id": reply.template_id, "tokens": reply.num_tokens,
                            "pinned_tokens": reply.num_pinned_tokens}
        return pinned

    async def generate(self, planned, spec, record, t0: float) -> None:
        from ricllm.client import RejectedError, ServerError

        options = dict(max_tokens=spec.max_tokens, temperature=spec.temperature, ignore_eos=spec.ignore_eos,
                       deadline_ms=spec.deadline_ms, priority=spec.resolved_priority())
        if planned.template is not None:
            options["template_id"] = self.template_ids[planned.template]
        messages = [{"role": "user", "content": planned.user_prompt}]
        first, sent = None, time.perf_counter()
        record.sent_s = sent - t0
        try:
            async for reply in self.client.stream(messages=messages, request_id=f"{planned.request_id}-{id(self):x}",
                                                  **options):
                if reply.type == "token":
                    first = first or time.perf_counter()
                else:
                    _fill_from_result(record, reply, sent, first, time.perf_counter(), t0)
        except RejectedError as exc:
            record.finish("rejected", admitted=False, rejection_code=exc.code, rejection_message=exc.message,
                          done_s=time.perf_counter() - t0, client_e2e_s=time.perf_counter() - sent)
        except ServerError as exc:
            record.finish("error", rejection_code=exc.code, rejection_message=exc.message,
                          done_s=time.perf_counter() - t0)
        except TimeoutError as exc:
            record.finish("timeout", rejection_message=str(exc), done_s=time.perf_counter() - t0)

    async def sample(self) -> dict[str, Any]:
        return normalize_server_stats(await self.client.stats(timeout_s=2))

    async def finish(self, interrupted: bool) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        try:
            stats = await self.client.stats(timeout_s=5)
            for template_id in self.template_ids.values():
                await self.client.unregister_template(template_id, timeout_s=5)
        except (TimeoutError, RicllmError) as exc:
            stats.setdefault("error", str(exc))
        finally:
            await self.client.aclose()
        return {"source": "server", "endpoint": self.endpoint, "server_version": self.version,
                "kv_cache": stats.get("kv_cache"), "server_stats": stats, "model": _server_model(stats)}


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

def _render_prompt(tokenizer, system: str | None, user: str) -> list[int]:
    """Chat-rendered token ids; the system part renders exactly as its pinned prefix does."""
    if tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(f"{system}\n\n{user}" if system else user)


def _pin_template(engine, system: str) -> dict[str, int]:
    """Runs on the engine thread before any request: compute the system prompt's KV and pin it."""
    from ricllm.cache.kv_cache_manager import PinHandle
    from ricllm.errors import CapacityError
    from ricllm.sampling_params import SamplingParams

    tokenizer = engine.tokenizer
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        token_ids = tokenizer.encode(system)
    cache = engine.cache
    room = engine.kv_cache.geometry.num_blocks - cache.num_pinned_blocks - 1
    if len(token_ids) // cache.block_size > room:
        raise CapacityError(f"pinning a template of {len(token_ids)} tokens needs "
                            f"{len(token_ids) // cache.block_size} KV blocks; only {room} can be pinned")
    handle = PinHandle(handle_id=next(engine._pin_ids), token_ids=list(token_ids))
    engine.add_request(token_ids, SamplingParams(max_tokens=1, ignore_eos=True), pin_on_finish=handle)
    while engine.has_unfinished():  # nothing else is queued yet: this runs only the pinning request
        engine.step()
    return {"tokens": len(token_ids), "pinned_tokens": len(handle.block_ids) * cache.block_size}


class _EngineSampler:
    """Runs on the engine thread between steps: what the timeline plots, including the steps run
    since the previous sample and their mean duration (found by the last record already seen)."""

    def __init__(self) -> None:
        self._seen = None

    def __call__(self, engine) -> dict[str, Any]:
        stats = engine.kv_cache_stats()
        admission = engine.admission.stats() if engine.admission is not None else None
        new = self._new_steps(engine.step_history)
        last = engine.step_history[-1].features if engine.step_history else None
        return {"kv_used_blocks": stats["used_blocks"], "kv_num_blocks": stats["num_blocks"],
                "kv_pinned_blocks": stats["pinned_blocks"], "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting), "preemptions": stats["preemptions"],
                "steps": len(new), "step_ms_mean": 1000 * sum(r.duration_s for r in new) / len(new) if new else None,
                "decode_seqs_mean": sum(r.features.num_decode_seqs for r in new) / len(new) if new else None,
                "last_step_prefill_tokens": last.num_prefill_tokens if last else 0,
                "admitted_total": admission["admitted"] if admission else None,
                "rejected_total": sum(admission["rejected"].values()) if admission else None,
                "met_total": engine.deadline_counts["met"], "missed_total": engine.deadline_counts["missed"]}

    def _new_steps(self, history) -> list:
        new = []
        for record in reversed(history):
            if record is self._seen:
                break
            new.append(record)
        self._seen = history[-1] if history else None
        return new[::-1]


def _cancel_all(engine) -> int:
    """Runs on the engine thread: end every unfinished request now (finish reason ``cancelled``)."""
    unfinished = [*engine.scheduler.running, *engine.scheduler.waiting]
    for seq in unfinished:
        engine.abort(seq, "cancelled")
    return len(unfinished)


def _engine_info(engine) -> dict[str, Any]:
    """Runs on the engine thread at the end: settings, final counters, model identity."""
    from dataclasses import asdict

    from ricllm.paths import file_digest

    kv = engine.kv_cache_stats()
    return {"source": "in_process", "settings": asdict(engine.config), "kv_cache": kv,
            "admission": engine.admission_stats(), "startup_s": engine.startup_s,
            "device": str(engine.runtime.device), "dtype": str(engine.runtime.dtype).removeprefix("torch."),
            "attention_backend": engine.runtime.attention_backend, "threads": engine.runtime.threads,
            "runtime": engine.runtime.name,
            "model": {"path": str(engine.model_path), "name": engine.spec.name,
                      "sha256": file_digest(Path(engine.model_path))}}


def _fill_from_output(record, output, sent: float, first: float | None, done: float, t0: float) -> None:
    common = dict(done_s=done - t0, client_e2e_s=done - sent)
    if output.finish_reason == "rejected":
        rejection = output.rejection
        record.finish("rejected", admitted=False, rejection_code=rejection.code,
                      rejection_message=rejection.message, **common)
        return
    if first is None and output.token_ids:
        first = done  # finished in the step that produced its first token
    record.finish("completed", admitted=True, finish_reason=output.finish_reason, server_queue_s=output.queue_s,
                  server_ttft_s=output.ttft_s, server_e2e_s=output.e2e_s,
                  client_ttft_s=None if first is None else first - sent,
                  prompt_tokens=len(output.prompt_token_ids), output_tokens=len(output.token_ids),
                  cached_tokens=output.num_cached_tokens, met=output.deadline_met, text=output.text,
                  granted_max_tokens=output.degradation.granted_max_tokens if output.degradation else None,
                  **common)


def _fill_from_result(record, result, sent: float, first: float | None, done: float, t0: float) -> None:
    timings = result.timings
    if first is None and result.token_ids:
        first = done
    record.finish("completed", admitted=True, finish_reason=result.finish_reason, server_queue_s=timings.queue_s,
                  server_ttft_s=timings.ttft_s, server_e2e_s=timings.e2e_s, done_s=done - t0,
                  client_ttft_s=None if first is None else first - sent, client_e2e_s=done - sent,
                  prompt_tokens=result.num_prompt_tokens, output_tokens=len(result.token_ids),
                  cached_tokens=result.num_cached_tokens, met=result.deadline_met, text=result.text,
                  granted_max_tokens=result.degraded.granted_max_tokens if result.degraded else None)


def _flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _pick(flat: dict[str, Any], *names: str) -> Any:
    """The first number whose key (or its last dotted part) is one of ``names``."""
    for name in names:
        for key, value in flat.items():
            if (key == name or key.rsplit(".", 1)[-1] == name) and isinstance(value, (int, float)):
                return value
    return None


def normalize_server_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A server ``stats`` reply -> the timeline's fields (None where the server does not say)."""
    flat = _flatten(stats)
    return {"kv_used_blocks": _pick(flat, "used_blocks", "kv_used_blocks"),
            "kv_num_blocks": _pick(flat, "num_blocks", "kv_num_blocks"),
            "kv_pinned_blocks": _pick(flat, "pinned_blocks"),
            "running": _pick(flat, "running", "num_running", "running_seqs"),
            "waiting": _pick(flat, "waiting", "num_waiting", "queue_length", "waiting_seqs"),
            "preemptions": _pick(flat, "preemptions")}


def _server_model(stats: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(stats)
    found = {k.rsplit(".", 1)[-1]: v for k, v in flat.items()
             if k.rsplit(".", 1)[-1] in ("model", "model_path", "model_name", "model_sha256", "sha256")}
    return {"path": found.get("model_path") or found.get("model"), "name": found.get("model_name"),
            "sha256": found.get("model_sha256") or found.get("sha256")}


# ------------------------------------------------------------------------------------- replay

@dataclass
class ReplayResult:
    records: list
    timeline: list[dict[str, Any]]
    templates: dict[str, dict]
    engine: dict[str, Any]
    wall_s: float
    interrupted: bool
    max_send_lag_s: float
    started_at: str
    sent_all: bool = True
    drain_timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Replayer:
    """Sends the plan on schedule, samples the engine, collects the records."""

    def __init__(self, scenario, plan: list, backend, progress: bool | None = None):
        self.scenario, self.plan, self.backend = scenario, plan, backend
        self.records: list = []
        self.timeline: list[dict[str, Any]] = []
        self.stop = asyncio.Event()
        self.interrupted = False
        self.max_lag = 0.0
        self.t0 = 0.0
        self.progress = _Progress(len(plan), scenario.name, progress)

    async def run(self) -> ReplayResult:
        loop = asyncio.get_running_loop()
        self._install_sigint(loop)
        try:
            templates = await self.backend.start(self.plan, self.scenario.template_texts())
            started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            print(f"replaying {len(self.plan)} requests over {self.plan[-1].send_offset_s:.1f} s "
                  f"({self.backend.mode}); Ctrl-C stops and still writes the report", file=sys.stderr, flush=True)
            self.t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample_loop())
            tasks = await self._send_all()
            timed_out = await self._drain(tasks)
            wall = time.perf_counter() - self.t0
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            self._mark_outstanding(tasks)
            engine = await self.backend.finish(self.interrupted)
        finally:
            self.progress.close()
            self._remove_sigint(loop)
        return ReplayResult(self.records, self.timeline, templates, engine, wall, self.interrupted, self.max_lag,
                            started_at, sent_all=len(self.records) == len(self.plan), drain_timed_out=timed_out)

    def _install_sigint(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.add_signal_handler(signal.SIGINT, self._on_sigint, loop)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass

    def _remove_sigint(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def _on_sigint(self, loop: asyncio.AbstractEventLoop) -> None:
        """First Ctrl-C: stop and report; the handler is removed so a second one aborts at once."""
        self.interrupted = True
        self.stop.set()
        self._remove_sigint(loop)
        print("\ninterrupted: writing the report of what ran (Ctrl-C again aborts)", file=sys.stderr, flush=True)

    async def _send_all(self) -> list[asyncio.Task]:
        from ricllm.replay.records import RequestRecord

        tasks = []
        for planned in self.plan:
            delay = self.t0 + planned.send_offset_s - time.perf_counter()
            if delay > 0:
                await self._sleep(delay)
            if self.stop.is_set():
                break
            spec = self.scenario.classes[planned.deadline_class]
            record = RequestRecord(planned.request_id, planned.entity, planned.trace_time_s, planned.trace_line,
                                   planned.trigger, planned.deadline_class, planned.template, spec.deadline_ms,
                                   spec.max_tokens, planned.send_offset_s)
            self.records.append(record)
            self.max_lag = max(self.max_lag, time.perf_counter() - self.t0 - planned.send_offset_s)
            tasks.append(asyncio.create_task(self._one(planned, spec, record)))
            self.progress.sent()
        return tasks

    async def _one(self, planned, spec, record) -> None:
        await self.backend.generate(planned, spec, record, self.t0)
        self.progress.done(record)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on Ctrl-C."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _drain(self, tasks: list[asyncio.Task]) -> bool:
        """Wait for the outstanding answers, up to the drain timeout or a Ctrl-C; True on timeout."""
        if not tasks or self.stop.is_set():
            return False
        everything = asyncio.gather(*tasks, return_exceptions=True)
        stopper = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait({everything, stopper}, timeout=self.scenario.pacing.drain_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        return not done

    def _mark_outstanding(self, tasks: list[asyncio.Task]) -> None:
        now = time.perf_counter() - self.t0
        for record in self.records:
            if record.status == "pending":
                record.finish("interrupted" if self.interrupted else "timeout", done_s=now)
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _sample_loop(self) -> None:
        while True:
            try:
                sample = await asyncio.wait_for(self.backend.sample(), 2.0)
                self.timeline.append({"t_s": round(time.perf_counter() - self.t0, 4), **sample})
            except (asyncio.TimeoutError, TimeoutError, RicllmError):
                pass
            self.progress.tick()
            await asyncio.sleep(SAMPLE_PERIOD_S)


class _Progress:
    """tqdm bar (on a terminal) with a live summary; a status line every 10 s otherwise."""

    def __init__(self, total: int, name: str, enabled: bool | None):
        from tqdm import tqdm

        self.counts = {"sent": 0, "done": 0, "admitted": 0, "met": 0, "rejected": 0}
        self.bar = tqdm(total=total, desc=f"replay {name}", unit="req", file=sys.stderr,
                        disable=None if enabled is None else not enabled, dynamic_ncols=True)
        self.quiet = self.bar.disable and enabled is None
        self.last_status = time.monotonic()

    def summary(self) -> str:
        c = self.counts
        met = f"{100 * c['met'] / c['admitted']:.1f}%" if c["admitted"] else "n/a"
        return f"sent {c['sent']}, admitted {c['admitted']}, met {met} of admitted, rejected {c['rejected']}"

    def sent(self) -> None:
        self.counts["sent"] += 1

    def done(self, record) -> None:
        self.counts["done"] += 1
        self.counts["admitted"] += bool(record.admitted)
        self.counts["met"] += bool(record.met)
        self.counts["rejected"] += record.status == "rejected"
        self.bar.update(1)

    def tick(self) -> None:
        self.bar.set_postfix_str(self.summary())
        if self.quiet and time.monotonic() - self.last_status >= QUIET_STATUS_PERIOD_S:
            self.last_status = time.monotonic()
            print(f"replay: {self.counts['done']}/{self.bar.total} answered; {self.summary()}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.set_postfix_str(self.summary())
        self.bar.close()


# ------------------------------------------------------------------------------------- report

def build_report(scenario, overrides: list[str], trace, plan: list, result: ReplayResult, mode: str,
                 endpoint: str | None, speed: float) -> dict[str, Any]:
    """Everything ``report.json`` holds (``docs/replay.md`` lists the fields)."""
    import ricllm
    from ricllm.replay.records import SCHEMA_VERSION, machine_info, records_to_json
    from ricllm.report.aggregate import aggregate, evaluate_targets

    kv = _kv_peak(result)
    aggregates = aggregate(result.records, result.wall_s, list(scenario.classes), kv)
    targets = evaluate_targets(scenario.targets, aggregates)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "ricllm-replay", "ricllm_version": ricllm.__version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "scenario": {"name": scenario.name, "path": str(scenario.path), "overrides": overrides,
                     "spec": scenario.model_dump(mode="json"), "templates": result.templates},
        "run": {"mode": mode, "endpoint": endpoint, "speed": speed, "started_at": result.started_at,
                "planned": len(plan), "sent": len(result.records), "wall_s": result.wall_s,
                "arrival_span_s": plan[-1].send_offset_s if plan else 0.0, "interrupted": result.interrupted,
                "drain_timed_out": result.drain_timed_out, "max_send_lag_s": result.max_send_lag_s},
        "engine": {k: v for k, v in result.engine.items() if k != "model"},
        "model": result.engine.get("model"),
        "machine": machine_info(),
        "trace": _trace_section(scenario, trace),
        "aggregates": aggregates, "targets": targets, "compliant": all(t["passed"] for t in targets),
        "timeline": result.timeline, "requests": records_to_json(result.records),
    }


def _kv_peak(result: ReplayResult) -> dict[str, Any]:
    """Peak KV blocks in use: the engine's own peak in-process, else the timeline's highest sample."""
    kv = result.engine.get("kv_cache") or {}
    samples = [s for s in result.timeline if s.get("kv_used_blocks") is not None]
    peak = kv.get("peak_used_blocks", max((s["kv_used_blocks"] for s in samples), default=None))
    total = kv.get("num_blocks") or next((s["kv_num_blocks"] for s in samples if s.get("kv_num_blocks")), None)
    return {"peak_kv_used_blocks": peak, "kv_num_blocks": total,
            "peak_kv_fraction": peak / total if peak is not None and total else None}


def _trace_section(scenario, trace) -> dict[str, Any]:
    """Trace identity and load stats, and a downsampled series per entity of what the triggers
    watch: each threshold's left side (``RRU.PrbUsedDl / RRU.PrbAvailDl``) with its threshold, or
    the KPIs a threshold reads, or PRB usage when no trigger reads any."""
    signals = _watched_signals(scenario)
    pacing = scenario.pacing
    end = float("inf") if pacing.duration_s is None else pacing.start_s + pacing.duration_s
    rows = [r for r in trace.rows if pacing.start_s <= r.time_s < end]
    series: dict[str, dict[str, list]] = {}
    for row in rows:
        entry = series.setdefault(row.entity, {"t": [], **{s["name"]: [] for s in signals}})
        entry["t"].append(row.time_s)
        for watched in signals:
            entry[watched["name"]].append(watched["read"](row.kpis))
    for entity, entry in series.items():
        step = max(1, len(entry["t"]) // TRACE_SERIES_POINTS)
        series[entity] = {k: v[::step] for k, v in entry.items()}
    return {"source": str(trace.path), "rows": len(trace.rows), "rows_replayed": len(rows),
            "entities": trace.entities(), "duration_s": trace.rows[-1].time_s if trace.rows else 0.0,
            "load_stats": trace.stats.as_dict(),
            "series": {"signals": [{"name": s["name"], "threshold": s["threshold"]} for s in signals],
                       "entities": series}}


def _watched_signals(scenario) -> list[dict[str, Any]]:
    from ricllm.replay.scenario import Threshold

    kpis = scenario.trace_kpis()
    signals: dict[str, dict[str, Any]] = {}
    for trigger in scenario.triggers:
        if not trigger.threshold:
            continue
        threshold = Threshold(trigger.threshold, kpis)
        if threshold.signal is not None:
            signals.setdefault(threshold.signal[0], {"name": threshold.signal[0], "threshold": threshold.signal[2],
                                                     "read": threshold.signal_value})
        else:
            for name in threshold.names:
                signals.setdefault(name, {"name": name, "threshold": None, "read": _kpi_reader(name)})
    if not signals:
        name = "RRU.PrbTotDl" if "RRU.PrbTotDl" in kpis else kpis[0]
        signals[name] = {"name": name, "threshold": None, "read": _kpi_reader(name)}
    return list(signals.values())[:3]


def _kpi_reader(name: str):
    return lambda kpis: kpis.get(name)


# ---------------------------------------------------------------------------------------- CLI

def add_replay_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm replay``: registered by ``ricllm.cli.build_parser``."""
    parser = sub.add_parser(
        "replay", help="replay a RAN KPI trace scenario against the engine and write a report",
        description="Replay a scenario (a YAML file, or a bundled name: default, overload, templates): send its "
                    "requests on the trace's schedule, open loop, in-process or to a running `ricllm serve`, then "
                    "write report.json, report.html and plots. Exit status 1 when the scenario's compliance "
                    "targets are missed, 2 for a mistake in the scenario, 130 when interrupted.")
    parser.add_argument("scenario", help="scenario file, or the name of a bundled scenario")
    parser.add_argument("--endpoint", default=None,
                        help="replay against `ricllm serve` at this ZeroMQ endpoint (e.g. tcp://127.0.0.1:5555) "
                             "instead of an engine in this process")
    parser.add_argument("--out", default=None, help="report folder (default: reports/<scenario>-<YYYYmmdd-HHMMSS>)")
    parser.add_argument("--speed", type=float, default=None, help="replay speed over the trace's timestamps "
                        "(default: the scenario's pacing.speed)")
    parser.add_argument("--latency-fit", default=None, help="stored latency-model fit (JSON) for admission, "
                        "instead of calibrating (in-process only)")
    parser.add_argument("--model", default=None, help="model file, overriding the scenario's engine.model "
                        "(in-process only)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a scenario field, e.g. --set engine.enable_prefix_caching=false (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from ricllm.replay.scenario import ScenarioError, load_scenario, load_scenario_trace, plan_requests

    if args.speed is not None and not args.speed > 0:
        raise ScenarioError(f"--speed must be > 0, got {args.speed}")
    scenario = load_scenario(args.scenario, args.overrides)
    speed = args.speed or scenario.pacing.speed
    trace = load_scenario_trace(scenario)
    plan = plan_requests(scenario, trace, speed)
    if not plan:
        raise ScenarioError(f"{scenario.path.name}: no trigger fires on the {len(trace.rows)} rows of the trace "
                            "(in the pacing window): nothing to replay")
    backend = _backend(args, scenario, plan)
    replayer = Replayer(scenario, plan, backend, progress=False if args.no_progress else None)
    result = asyncio.run(replayer.run())
    report = build_report(scenario, list(args.overrides), trace, plan, result, backend.mode, args.endpoint, speed)
    directory = Path(args.out) if args.out else _default_out(scenario.name, report["created_at"])
    from ricllm.report import print_summary, write_report

    paths = write_report(report, directory)
    print_summary(report)
    print(f"report: {paths['html']}", file=sys.stderr)
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if report["compliant"] else EXIT_TARGETS_MISSED


def _backend(args: argparse.Namespace, scenario, plan: list):
    if args.endpoint:
        if not args.endpoint.startswith(("tcp://", "ipc://")):
            raise RicllmError(f"--endpoint {args.endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
        for flag, value in (("--latency-fit", args.latency_fit), ("--model", args.model)):
            if value:
                raise RicllmError(f"{flag} applies to in-process replays; over ZeroMQ the server's own setting holds")
        return ZmqBackend(args.endpoint, timeout_s=scenario.pacing.drain_timeout_s)
    return InProcessBackend(engine_kwargs(scenario, args.model, args.latency_fit))


def engine_kwargs(scenario, model: str | None = None, latency_fit: str | None = None) -> dict[str, Any]:
    """``EngineConfig`` arguments: the scenario's engine section, its paths resolved, CLI flags over it.

    The tightest deadline class sets ``tightest_deadline_ms``/``_tokens`` unless the scenario does.
    """
    kwargs = scenario.engine.config_kwargs()
    for name in ("model", "latency_fit"):
        if name in kwargs:
            kwargs[name] = scenario.resolve_path(kwargs[name])
    if model:
        kwargs["model"] = model
    if latency_fit:
        kwargs["latency_fit"] = latency_fit
    with_deadline = [c for c in scenario.classes.values() if c.deadline_ms is not None]
    if with_deadline:
        tightest = min(with_deadline, key=lambda c: c.deadline_ms)
        kwargs.setdefault("tightest_deadline_ms", tightest.deadline_ms)
        kwargs.setdefault("tightest_deadline_tokens", tightest.max_tokens)
    return kwargs


def _default_out(name: str, created_at: str) -> Path:
    import re

    stamp = datetime.fromisoformat(created_at).astimezone().strftime("%Y%m%d-%H%M%S")
    base = Path("reports") / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{stamp}"
    candidate, n = base, 2
    while candidate.exists():
        candidate, n = Path(f"{base}-{n}"), n + 1
    return candidate

