"""What each executed step carried and how long it took, and what that says about the machine.

``StepRecorder`` keeps the recent steps (calibration fits the latency model to them, the replay
timeline plots them), feeds the latency model its online errors, runs the slowdown detector on
busy steps, knows whether the engine has been idle (its next step is a cold one), and measures a
probe step while idle when admission asks what a cold step costs now.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.engine.runtime.interface import Runtime
from ricllm.engine.scheduler import ScheduledBatch, StepFeatures
from ricllm.engine.slowdown import SlowdownDetector
from ricllm.engine.stats import SlowdownEvent
from ricllm.engine.step_errors import IDLE_GAP_S
from ricllm.logging import get_logger
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence

log = get_logger("ricllm.engine")
PROBE_INTERVAL_S = 0.05  # an idle engine that refuses for time measures a probe step at most this often
STEPS_KEPT = 4096


@dataclass(frozen=True)
class StepRecord:
    """One executed step: what it carried and how long it took (for the latency model)."""

    features: StepFeatures
    duration_s: float


class StepRecorder:
    """``history``: the latest steps, oldest first; ``num_steps``: all steps run (probes included);
    ``slowdowns``: the detector's verdicts. ``latency`` is admission's latency model (None without
    admission: nothing learns from the steps but the history)."""

    def __init__(self, clock: Callable[[], float], runtime: Runtime, cache: KVCacheManager) -> None:
        self.clock = clock
        self.runtime = runtime
        self.cache = cache
        self.latency = None
        self.history: deque[StepRecord] = deque(maxlen=STEPS_KEPT)
        self.num_steps = 0
        self.detector = SlowdownDetector()  # is the typical step slower than it has lately been?
        self.slowdowns: list[SlowdownEvent] = []
        self.last_end = -math.inf  # engine-clock time the last step (probes included) ended
        self.work_left = False  # the engine still had requests to run when its last step ended
        self.last_probe = -math.inf

    def idle_at(self, now: float) -> bool:
        """Whether the engine has had nothing to run for longer than ``IDLE_GAP_S``: the next step
        is a cold one. A gap after a step that left work is the engine's own (taking in a burst of
        arrivals between two steps can take longer than that), not idle time."""
        return not self.work_left and now - self.last_end > IDLE_GAP_S

    def record(self, features: StepFeatures, duration_s: float, after_idle: bool = False,
               work_left: bool = False) -> None:
        """``after_idle``: the step followed a gap (or was a probe); the slowdown detector watches
        busy steps only, as a cold step is no sign of a slower machine. ``work_left``: requests
        remain to be run after it."""
        self.num_steps += 1
        self.last_end = self.clock()
        self.work_left = work_left
        self.history.append(StepRecord(features, duration_s))
        if self.latency is not None:
            self.latency.observe(features, duration_s, after_idle)
            if not after_idle:
                self._watch_slowdown(features, duration_s)

    def _watch_slowdown(self, features: StepFeatures, duration_s: float) -> None:
        """Say when steps run persistently slower than they lately did (a noisy neighbour, thermal
        limits), and when that ends (``engine/slowdown.py``). Admission does not wait for this:
        its bound scales with the step multipliers, high quantiles, which rise within a few steps."""
        latency, detector = self.latency, self.detector
        predicted = latency.base(features)
        if predicted <= 0 or duration_s <= 0:
            return
        changed = detector.observe(duration_s / predicted)
        if changed is None:
            return
        self.slowdowns.append(SlowdownEvent(self.clock(), changed, detector.slowdown, detector.typical,
                                            latency.step_multiplier))
        event = "sustained_slowdown" if changed else "slowdown_over"
        (log.warning if changed else log.info)(event, slowdown=round(detector.slowdown, 3),
                                               typical_ratio=round(detector.typical, 3),
                                               step_multiplier=round(latency.step_multiplier, 3),
                                               threshold=detector.threshold, window_steps=detector.window)

    def probe(self, now: float) -> None:
        """Measure one small step while idle and refusing for time: what a first step after a gap
        costs here now (cold caches, the clock ramped down), the bound's after-idle multiplier. It
        informs that alone: a step of an idle machine says nothing of a busy one's, whose recent
        errors age out instead (``StepErrors``). At most one probe per ``PROBE_INTERVAL_S``."""
        if now - self.last_probe < PROBE_INTERVAL_S:
            return
        self.last_probe = now
        seq = Sequence(request_id="probe", token_ids=[0], num_prompt_tokens=1, params=SamplingParams(max_tokens=1),
                       arrival_time=now)
        grant = self.cache.allocate(seq, 1)
        if grant is None:
            return
        seq.take_blocks(grant)
        batch = ScheduledBatch([(seq, 1)])
        started = self.clock()
        self.runtime.runner.run(batch)
        self.record(batch.features(), self.clock() - started, after_idle=True)
        self.cache.free(seq)
        seq.drop_blocks()
        log.info("latency_probe", after_idle_multiplier=round(self.latency.after_idle_multiplier, 3))
