"""The replay loop: send a plan's requests on the trace's schedule, sample the engine, collect records.

The replay is open loop: every request leaves at its planned time whether or not earlier ones
were answered, as KPI reports arrive over E2 regardless of how busy the xApp is. The loop drives
a backend (``engine_backend.InProcessBackend`` or ``zmq_backend.ZmqBackend``: ``start``,
``generate``, ``sample``, ``finish``) and knows nothing of either. A timeline sampler reads the
engine's KV usage and batch four times a second. Ctrl-C stops sending, marks what is still
outstanding as ``interrupted`` and still returns what ran; a second Ctrl-C aborts.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ricllm.errors import RicllmError

SAMPLE_PERIOD_S = 0.25
QUIET_STATUS_PERIOD_S = 10.0


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
    faults: list[dict[str, Any]] = field(default_factory=list)  # each fault phase as planned and as run
    slowdowns: list[dict[str, Any]] | None = None  # the detector's verdicts, replay seconds; None: not measured


class Replayer:
    """Sends the plan on schedule, samples the engine, collects the records."""

    def __init__(self, scenario, plan: list, backend, progress: bool | None = None, speed: float | None = None,
                 adapters: dict | None = None):
        """``adapters``: the templates' ``TemplateAdapter`` by template name (``scenario_adapters``)."""
        from ricllm.replay.fault_phases import FaultSchedule

        self.scenario, self.plan, self.backend = scenario, plan, backend
        self.adapters = adapters or {}
        cpus = backend.fault_cpus() if scenario.faults and hasattr(backend, "fault_cpus") else None
        self.faults = FaultSchedule(scenario.faults, speed or scenario.pacing.speed, scenario.pacing.start_s, cpus)
        self.records: list = []
        self.timeline: list[dict[str, Any]] = []
        self.stop = asyncio.Event()
        self.interrupted = False
        self.max_lag = 0.0
        self.t0 = 0.0
        self.progress = _Progress(len(plan), scenario.name, progress)
        self.checks: dict = {}

    async def _start_backend(self) -> dict[str, dict]:
        """Pin (or register) every template; the report's template entries also say what each holds."""
        from ricllm.replay.decisions import AnswerCheck
        from ricllm.replay.templates import scenario_templates

        templates = scenario_templates(self.scenario)
        entries = self.scenario.prompts.templates
        templates.update({name: a.template(entries[name], self.scenario.base_dir) for name, a in self.adapters.items()})
        self.checks = {name: AnswerCheck(t.structured) for name, t in templates.items() if t.structured}
        pinned = await self.backend.start(self.plan, templates, {a.name: a.folder for a in self.adapters.values()})
        return {name: {**pinned[name], "examples": t.num_examples,
                       "constraint": t.structured.kind if t.structured else None, "adapter": t.adapter,
                       **({"min_confidence": t.fallback.min_confidence, "fallback": t.fallback.answer}
                          if t.fallback else {}),
                       **self._adapter_entry(name)} for name, t in templates.items()}

    def _adapter_entry(self, name: str) -> dict:
        adapter = self.adapters.get(name)
        if adapter is None:
            return {}
        return {"adapter_folder": str(adapter.folder), "adapter_trained_now": adapter.trained_now,
                "system_prompt": adapter.system_prompt}

    async def run(self) -> ReplayResult:
        loop = asyncio.get_running_loop()
        self._install_sigint(loop)
        try:
            templates = await self._start_backend()
            started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            print(f"replaying {len(self.plan)} requests over {self.plan[-1].send_offset_s:.1f} s "
                  f"({self.backend.mode}); Ctrl-C stops and still writes the report", file=sys.stderr, flush=True)
            self.faults.spawn_all()
            self.t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample_loop())
            faults = asyncio.create_task(self.faults.run(self.t0, self._sleep, self.stop)) if self.faults else None
            tasks = await self._send_all()
            timed_out = await self._drain(tasks)
            wall = time.perf_counter() - self.t0
            for task in (sampler, faults):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (sampler, faults) if t is not None), return_exceptions=True)
            self.faults.stop_all()
            self._mark_outstanding(tasks)
            engine = await self.backend.finish(self.interrupted)
        finally:
            self.faults.stop_all()  # a noisy neighbour never outlives the replay
            self.progress.close()
            self._remove_sigint(loop)
        slowdowns = self.backend.slowdowns(engine, self.t0) if hasattr(self.backend, "slowdowns") else None
        return ReplayResult(self.records, self.timeline, templates, engine, wall, self.interrupted, self.max_lag,
                            started_at, sent_all=len(self.records) == len(self.plan), drain_timed_out=timed_out,
                            faults=self.faults.report(), slowdowns=slowdowns)

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
        from ricllm.report.records import RequestRecord

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
                                   spec.max_tokens, planned.send_offset_s, expected=planned.expected)
            self.records.append(record)
            self.max_lag = max(self.max_lag, time.perf_counter() - self.t0 - planned.send_offset_s)
            tasks.append(asyncio.create_task(self._one(planned, spec, record)))
            self.progress.sent()
        return tasks

    async def _one(self, planned, spec, record) -> None:
        from ricllm.replay.decisions import judge

        await self.backend.generate(planned, spec, record, self.t0)
        judge(record, self.checks.get(planned.template))
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

        self.counts = {"sent": 0, "done": 0, "admitted": 0, "met": 0, "rejected": 0, "judged": 0, "useful": 0}
        self.bar = tqdm(total=total, desc=f"replay {name}", unit="req", file=sys.stderr,
                        disable=None if enabled is None else not enabled, dynamic_ncols=True)
        self.quiet = self.bar.disable and enabled is None
        self.last_status = time.monotonic()

    def summary(self) -> str:
        c = self.counts
        met = f"{100 * c['met'] / c['admitted']:.1f}%" if c["admitted"] else "n/a"
        useful = f", useful {c['useful']} of {c['judged']}" if c["judged"] else ""
        return f"sent {c['sent']}, admitted {c['admitted']}, met {met} of admitted, rejected {c['rejected']}{useful}"

    def sent(self) -> None:
        self.counts["sent"] += 1

    def done(self, record) -> None:
        self.counts["done"] += 1
        self.counts["admitted"] += bool(record.admitted)
        self.counts["met"] += bool(record.met)
        self.counts["rejected"] += record.status == "rejected"
        self.counts["judged"] += record.useful is not None
        self.counts["useful"] += bool(record.useful)
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
