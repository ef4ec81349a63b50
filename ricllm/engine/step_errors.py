"""How far measured steps run from the latency fit, per kind of step: what admission's bounds add.

Three kinds, because they err differently:

- ``decode``: a step that carries no prefill token;
- ``prefill``: a step that carries prefill (a prompt's chunk, forced tokens), decodes beside it or not;
- ``after_idle``: the first step after the engine had nothing to run for more than ``IDLE_GAP_S``
  (a gap after a step that left work is its own intake, not idle time), and every
  probe step (``StepRecorder.probe``, run only while idle). Cold caches and a CPU clock that ramps back
  up make it run many times its fit; the next step is already warm.

``decode`` and ``prefill`` hold the ratio measured / fitted: a slower machine (a neighbour, thermal
limits) stretches every step in proportion, and the fit minimises relative error, so its residuals
are ratios too. Each kind's multiplier is the ``quantile`` (0.9) of its ratios among the last
``window`` (32) busy steps (both kinds counted), no older than ``max_age_s`` (2 s): a sustained
slowdown is past the quantile once 4 slowed steps of a kind are in (the bound takes the larger
kind's, so within 8 slowed steps of a half-and-half mix), and forgotten 32 busy steps, or 2 s,
after it ends; 2 s also covers an engine that refuses everything and so measures no busy step.
While fewer than ``min_samples`` (32) recent ratios are at hand the
calibration's own residuals stand in for the missing ones, so a fresh start is neither blind (the
fit at its word) nor pessimistic (the max of the first few steps); once three recent ratios are in,
the stand-ins are lifted by how much slower their median runs than the residuals' (never lowered):
steps of 400 ms (a backlog prefilled sixty requests at a time) come five to a 2 s window, too few to
set the quantile alone, and where the fit underrates them all (1.3-1.7x) the residuals' own spread
would otherwise keep the bound below most of them. The slowest tenth of steps are
the stall reserve's (``LatencyModel.stall_reserve``), an amount of seconds held once per bound, as
one stall is. A quantile over a 32-step window, not an adaptive conformal update: at a 0.999
coverage such an update lowers itself by 0.1% of its step size per covered step, so it could not
come back down within 50 steps of a slowdown's end; the far tail is the stall reserve's, the
largest overrun of the last 1024 busy steps.

``after_idle`` holds the same ratio measured / fitted, of first steps after a gap: what such a step
costs past a busy one is its cache refilled and its clock ramped up, work of the step's own size.
Measured on a 2-core EPYC with the OpenMP team pinned (``PinnedTeam``; the sleeping worker's wake, a
fixed cost, is gone there): over 100 such steps of a replay, the 0.9 quantile of the seconds past
the fit was 4.8 ms for steps fitted at 12 ms and 17.9 ms for steps fitted at 23 ms, while the ratio's
was 1.40 and 1.61. A bound made while idle charges its first step (the one after the gap) this
kind's multiplier where it is the larger, and every other step the busy one's. Its figure is the
same 0.9 quantile as the busy kinds', over the last ``AFTER_IDLE_WINDOW`` (64) such steps, with no
age limit: they come one per idle gap, and forgetting them between two bursts seconds apart would
forget the lesson; while an idle engine refuses, its probes (one per 50 ms) renew the window within
about 3 s. The worst of the window would let one outlier (a process's first step) set every idle
bound for the next 64 arrivals; a cold step past the quantile is what the safety margin and the
slack of the other steps absorb. The calibration's cold steps seed it with the weight of
``AFTER_IDLE_SEED_WEIGHT`` (16) steps, so the first real gaps take over within two. It never moves
the busy multipliers, so it never inflates the bound of a busy engine.

A busy engine's next step follows its last at once, and tends to run as it did: promises re-checked
between its steps (``AdmissionController._late``) charge every step at least the last busy step's
ratio (``latest_busy_ratio``), so the rescue answers a slowdown on its first slowed step, and a lone
stall for one step only.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

IDLE_GAP_S = 0.02  # had nothing to run for longer than this: idle. A busy engine steps back to back (well under
# 1 ms between steps, or the time its intake of a burst takes); every probe (at most one per 50 ms) comes after
# a longer gap
AFTER_IDLE_WINDOW = 64  # after-idle steps whose 0.9 quantile of measured / fitted a bound made while idle charges
AFTER_IDLE_SEED_WEIGHT = 16  # steps the calibration's cold steps stand in for until real ones come
LEVEL_MIN_SAMPLES = 3  # recent values whose median may lift the seed's level (``_level``)
BUSY_KINDS = ("decode", "prefill")
STEP_KINDS = (*BUSY_KINDS, "after_idle")


@dataclass
class RecentQuantile:
    """The ``quantile`` of the values of the last ``window`` steps (counted by the caller, all
    kinds of busy steps together) no older than ``max_age_s``, topped up to
    ``min_samples`` values with evenly spaced quantiles of ``seed`` (no seed: ``neutral``, the fit at
    its word): the seed weighs as many steps as are missing, so one stall among the first few steps
    is the stall reserve's, not the quantile's."""

    seed: list[float] = field(default_factory=list)
    neutral: float = 1.0
    quantile: float = 0.9
    window: int = 32
    max_age_s: float = 2.0
    min_samples: int = 32  # the 0.9 quantile of 32 values is the fourth largest: three outliers pass
    recent: deque = field(default_factory=deque, repr=False)  # (engine-clock time, step number, value)
    _cached: float | None = field(default=None, init=False, repr=False)

    def add(self, value: float, at: float, step: int) -> None:
        self.recent.append((at, step, value))
        self.value(at, step)
        self._cached = None

    def value(self, now: float, step: int) -> float:
        """The quantile as of ``now``, ``step``: values older than ``max_age_s`` or ``window``
        steps no longer count."""
        while self.recent and (now - self.recent[0][0] > self.max_age_s or step - self.recent[0][1] >= self.window):
            self.recent.popleft()
            self._cached = None
        if self._cached is None:
            self._cached = self._quantile()
        return self._cached

    def _quantile(self) -> float:
        return _at(sorted(self._pool()), self.quantile)

    def _pool(self) -> list[float]:
        recent = [v for _, _, v in self.recent]
        missing = self.min_samples - len(recent)
        if missing <= 0:
            return recent
        seed = self.seed or [self.neutral]
        level = _level(recent, seed)
        return recent + _spread([v * level for v in seed], missing)

    def median(self, now: float, step: int) -> float:
        """The typical value, of the same values as the quantile."""
        self.value(now, step)
        return _at(sorted(self._pool()), 0.5)


def _level(recent: list[float], seed: list[float]) -> float:
    """How much slower than the seed's the recent values run: the ratio of their medians once
    ``LEVEL_MIN_SAMPLES`` are in (a median, so one stall does not move it), never below 1. The seed
    gives the spread, the recent values its level: a workload the fit underrates (its steps all run
    1.4x it) raises the quantile within a few steps, though they are too few to set it alone."""
    if len(recent) < LEVEL_MIN_SAMPLES:
        return 1.0
    seed_median = _at(sorted(seed), 0.5)
    return max(_at(sorted(recent), 0.5) / seed_median, 1.0) if seed_median > 0 else 1.0


def _at(ordered: list[float], quantile: float) -> float:
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def _spread(values: list[float], count: int) -> list[float]:
    """``count`` values at evenly spaced quantiles of ``values``: a seed that weighs ``count`` steps."""
    ordered = sorted(values)
    return [_at(ordered, (i + 0.5) / count) for i in range(max(count, 0))]


def busy_kind(num_prefill_tokens: int) -> str:
    return "prefill" if num_prefill_tokens > 0 else "decode"


@dataclass
class StepErrors:
    """The per-kind error model: a multiplier (measured / fitted) for each kind of step.
    ``residuals`` are the calibration's ratios, by kind: the seeds, and all of it that a saved fit
    keeps, so no learned error outlives its process."""

    residuals: dict[str, list[float]] = field(default_factory=dict)
    quantile: float = 0.9
    window: int = 32
    max_age_s: float = 2.0
    kinds: dict[str, RecentQuantile] = field(init=False, repr=False)
    last_busy: tuple[float, float] | None = field(default=None, init=False, repr=False)  # (time, ratio)
    steps: dict[str, int] = field(default_factory=lambda: {"busy": 0, "after_idle": 0}, init=False, repr=False)

    def __post_init__(self) -> None:
        def seed(kind: str) -> list[float]:
            return list(self.residuals.get(kind, []))

        self.kinds = {kind: RecentQuantile(seed(kind), 1.0, self.quantile, self.window, self.max_age_s)
                      for kind in BUSY_KINDS}
        self.kinds["after_idle"] = RecentQuantile(seed("after_idle"), 1.0, self.quantile, AFTER_IDLE_WINDOW,
                                                  math.inf, AFTER_IDLE_SEED_WEIGHT)

    def multiplier(self, kind: str, now: float) -> float:
        """measured / fitted that all but the slowest tenth of recent ``kind`` steps stay within."""
        return self.kinds[kind].value(now, self._count(kind))

    def typical_ratio(self, kind: str, now: float) -> float:
        return self.kinds[kind].median(now, self._count(kind))

    def _count(self, kind: str) -> int:
        """Busy kinds count steps together: a kind that runs rarely still forgets within ``window`` steps."""
        return self.steps["after_idle" if kind == "after_idle" else "busy"]

    def latest_busy_ratio(self, now: float) -> float:
        """The last busy step's own ratio (0 when older than ``max_age_s``): a step that follows
        it at once tends to run as it did, and a slowdown shows there before the quantile sees it."""
        if self.last_busy is None or now - self.last_busy[0] > self.max_age_s:
            return 0.0
        return self.last_busy[1]

    def add(self, kind: str, value: float, at: float) -> None:
        self.steps["after_idle" if kind == "after_idle" else "busy"] += 1
        self.kinds[kind].add(value, at, self._count(kind))
        if kind in BUSY_KINDS:
            self.last_busy = (at, value)
