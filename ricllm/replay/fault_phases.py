"""Fault phases of a replay: a noisy neighbour started and stopped on the trace's schedule, and
which requests were admitted before the engine's slowdown detector noticed it.

A phase (``faults:`` in the scenario) starts a ``ricllm.faults.CpuHog`` on the engine's CPUs at
its start and stops it at its end, in replay seconds (``(trace time - pacing.start_s) / speed``,
as requests are sent). Hogs are stopped when the replay ends, however it ends.

The **reaction window** of a phase runs from its start to the detector's first ``slow`` verdict
after it (the engine snapshot's ``slowdowns``; the phase's end when the detector never fired during
it; the phase's start when the detector already said slow then). A request is *in the window*
when it was admitted (sent, in-process: its arrival is stamped at submission) before the window
closed and was still unfinished when the phase began: admission planned it with steps as fast
as those ahead of the phase, and nothing can promise more than that. Its outcome is reported apart (count, met,
missed, how late); every other admitted request is held to its deadline. Over ZeroMQ the
server's detector is not visible: the window is the whole phase and the report says the
detector was not measured. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ricllm.report.aggregate import window_counts


class FaultSchedule:
    """Starts and stops each phase's hog at its replay time; ``stop_all`` ends whatever still runs."""

    def __init__(self, phases: Sequence, speed: float, pacing_start_s: float, cpus: Sequence[int] | None = None):
        self.phases = list(phases)
        self.offsets = [((p.start_s - pacing_start_s) / speed, (p.stop_s - pacing_start_s) / speed) for p in phases]
        self.cpus = None if cpus is None else tuple(cpus)
        self.hogs: list = [None] * len(self.phases)
        self.started: list[float | None] = [None] * len(self.phases)
        self.stopped: list[float | None] = [None] * len(self.phases)
        self.t0 = 0.0

    def __bool__(self) -> bool:
        return bool(self.phases)

    async def run(self, t0: float, sleep: Callable[[float], Awaitable[None]], stop: asyncio.Event) -> None:
        """Each phase in turn; ``sleep`` wakes at once on Ctrl-C (``stop``), which ends the schedule."""
        self.t0 = t0
        try:
            for i, (start, end) in enumerate(self.offsets):
                for at, action in ((start, self._start), (end, self._stop)):
                    delay = t0 + at - time.perf_counter()
                    if delay > 0:
                        await sleep(delay)
                    if stop.is_set():
                        return
                    action(i)
        finally:
            self.stop_all()

    def spawn_all(self) -> None:
        """Every phase's processes, started and waiting (``CpuHog.spawn``): called before the replay's
        clock starts, so a phase's start is its duty cycle, not interpreters starting up."""
        for i in range(len(self.phases)):
            if self.hogs[i] is None and self.started[i] is None:
                self._spawn(i)

    def _spawn(self, i: int) -> None:
        from ricllm.faults import CpuHog

        phase = self.phases[i]
        self.hogs[i] = CpuHog(self.cpus, duty=phase.duty, period_s=phase.period_ms / 1000)
        self.hogs[i].spawn()

    def _start(self, i: int) -> None:
        if self.hogs[i] is None:  # not spawned ahead (a schedule run without ``spawn_all``)
            self._spawn(i)
        self.hogs[i].start()
        self.started[i] = time.perf_counter() - self.t0

    def _stop(self, i: int) -> None:
        hog, self.hogs[i] = self.hogs[i], None
        if hog is not None:
            spinning = hog.running
            hog.stop()
            if spinning:
                self.stopped[i] = time.perf_counter() - self.t0

    def stop_all(self) -> None:
        """Idempotent; safe from ``finally`` on any path (error, Ctrl-C, cancellation)."""
        for i in range(len(self.phases)):
            self._stop(i)

    def report(self) -> list[dict[str, Any]]:
        """Each phase as planned and as run (``started_s``/``stopped_s``: replay seconds, None if it never ran)."""
        return [{"index": i, "name": p.label(i), "kind": p.kind, "duty": p.duty, "period_ms": p.period_ms,
                 "cpus": list(self.cpus) if self.cpus is not None else None,
                 "trace_start_s": p.start_s, "trace_stop_s": p.stop_s,
                 "start_s": round(start, 4), "stop_s": round(end, 4),
                 "started_s": _round(self.started[i]), "stopped_s": _round(self.stopped[i])}
                for i, (p, (start, end)) in enumerate(zip(self.phases, self.offsets))]


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# ------------------------------------------------------------------- the detector's reaction

def reaction_windows(phases: list[dict[str, Any]], events: list[dict[str, Any]] | None,
                     timeline: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each phase with its ``detector`` reaction and its ``window`` (``start_s``, ``end_s``).

    ``events`` are the detector's verdicts in replay seconds, in time order (``t_s``, ``slow``,
    ``slowdown``: the typical step against the recent past's (a low quantile of recent window medians), ``typical_ratio``: the median
    measured / predicted step time, ``step_multiplier``: admission's high quantile of that ratio, the
larger of decode and prefill steps'); None
    when they could not be read (over ZeroMQ, or without admission)."""
    result = []
    for phase in phases:
        phase = dict(phase)
        start, stop = phase.get("started_s"), phase.get("stopped_s")
        if start is None:  # never started (interrupted before it)
            phase.update(detector=None, window=None)
            result.append(phase)
            continue
        stop = stop if stop is not None else start
        detector: dict[str, Any] = {"measured": events is not None, "fired_s": None, "reaction_ms": None,
                                    "slowdown": None, "typical_ratio": None, "step_multiplier": None,
                                    "already_slow": False}
        end = stop
        if events is not None:
            before = [e for e in events if e["t_s"] < start]
            fired = next((e for e in events if e["slow"] and start <= e["t_s"] <= stop), None)
            if before and before[-1]["slow"]:
                detector.update(already_slow=True, fired_s=before[-1]["t_s"], reaction_ms=0.0, **_verdict(before[-1]))
                end = start
            elif fired is not None:
                detector.update(fired_s=fired["t_s"], reaction_ms=round(1000 * (fired["t_s"] - start), 1),
                                **_verdict(fired))
                end = fired["t_s"]
            detector["events"] = [e for e in events if start <= e["t_s"] <= stop]
        detector.update(_phase_steps(timeline, start, stop))
        phase.update(detector=detector, window={"start_s": start, "end_s": end})
        result.append(phase)
    return result


def _verdict(event: dict[str, Any]) -> dict[str, Any]:
    return {key: event.get(key) for key in ("slowdown", "typical_ratio", "step_multiplier")}


def _phase_steps(timeline: Sequence[dict[str, Any]], start: float, stop: float) -> dict[str, Any]:
    """The timeline's view of the phase: the highest busy-step multiplier sampled in it (decode or
    prefill), and the median step
    time in it against the same length of time just before it (a rough slowdown: the step mix moves)."""
    def in_span(a: float, b: float, key: str) -> list[float]:
        return [s[key] for s in timeline if a <= s["t_s"] <= b and s.get(key) is not None]

    during, before = in_span(start, stop, "step_ms_mean"), in_span(max(0.0, 2 * start - stop), start, "step_ms_mean")
    multipliers = in_span(start, stop, "latency_decode_multiplier") + in_span(start, stop, "latency_prefill_multiplier")
    step_during = statistics.median(during) if during else None
    step_before = statistics.median(before) if before else None
    return {"peak_step_multiplier": max(multipliers) if multipliers else None,
            "step_ms_before": step_before, "step_ms_during": step_during,
            "step_slowdown": step_during / step_before if step_during and step_before else None}


def mark_windows(records: Sequence, phases: list[dict[str, Any]]) -> None:
    """Set each record's ``reaction_window`` (the phase index) when it was admitted before that phase's
    window closed and was still unfinished when the phase began; None otherwise."""
    for record in records:
        record.reaction_window = None
        if not record.admitted or record.sent_s is None:
            continue
        for phase in phases:
            window = phase.get("window")
            if window is None:
                continue
            unfinished = record.done_s is None or record.done_s > window["start_s"]
            if record.sent_s < window["end_s"] and unfinished:
                record.reaction_window = phase["index"]
                break


def fault_section(phases: list[dict[str, Any]], events: list[dict[str, Any]] | None, records: Sequence,
                  timeline: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """``report.json``'s ``faults``: each phase with its detector reaction and window outcome; marks
    the records' ``reaction_window``."""
    phases = reaction_windows(phases, events, timeline)
    mark_windows(records, phases)
    for phase in phases:
        if phase["window"] is not None:
            phase["window"].update(window_counts([r for r in records if r.reaction_window == phase["index"]]))
    return {"phases": phases, "detector_measured": events is not None, "detector_events": events}
