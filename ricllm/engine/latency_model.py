"""Predict one engine step's time from what it carries, so admission can promise deadlines.

    t(step) = max( roofline,  a + b·P + c·D + d·C + e·Q + S·(f + g·P + h·Q + j·C) + (1−S)·x·P
                             + k·H ) + l·A

P prefill tokens, D decode sequences, C Σ context positions read, Q Σ (chunk × context) over
prefill chunks (a chunk's attention costs its length times what it attends to, which a linear
term in P misses for long prompts). C and Q are taken per KV cache group and averaged over the
groups (``StepFeatures``): a sliding-window group's layers read at most their window, so a
Gemma 3 sequence of 4,096 tokens reads 4,096 positions in its one global group and 512 in each
of its five sliding ones; with one group (the Llama family) they are the whole context. H the LM
head's rows, each by the share of the vocabulary's columns computed (the k-wide constrained head
computes its allowed tiles only; ``narrow_head``). S = 1 for a step past the runtime's kernel limits
(``runs_op_by_op``; ``RuntimeCapabilities.kernel_limits``): with the C kernels, decode steps and
small prefill chunks (a prompt's tail behind its template) run as one C call, whose prefill rows
ride on the weights the decodes read anyway, while larger prefill steps run op by op (attention in
SDPA or the C prefill kernel), a fixed cost and dearer tokens of their own. Which way is dearer per
token depends on the CPU (on a 2-core EPYC, a prompt's token costs less in the large products of the
op-by-op path than as a row of the one call), so a prefill token in the one call has an extra price of
its own too (``x``), and each fit is non-negative. A runtime without such
limits (a GPU, the torch reference) has S = 0 on every step. Op by op, each prefill chunk's
attention reads its whole context apart (``j·C``): a burst of short tails behind one long cached
template reads that template once per tail, which its few chunk × context products do not price.
The roofline ``(weight bytes + KV
bytes read per group + head bytes read) / bandwidth`` is the floor: no step can be faster than
reading its bytes once (a step that samples no row reads none of the head). A Σ over
the step's LoRA adapters of ⌈its rows / 4⌉, the reads of their weights the CPU kernel makes (4 rows
of one adapter share each read); ``l`` is not fitted: it is the largest resident adapter's bytes at
the roofline's measured bandwidth (``price_adapters``), so the term is known before any adapter's
step runs, and the step errors learn how far real steps under adapters run from it.

The fit is non-negative least squares on a calibration sweep. Online, ``StepErrors``
(``step_errors.py``) tracks how far measured steps run from it, per kind of step (decode, prefill,
the first after an idle gap), seeded from the sweep's own residuals: promises are made against how
slow steps run on this machine now, not against their average, and every prediction's error is
recorded.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ricllm.engine.scheduler import StepFeatures
from ricllm.engine.step_errors import BUSY_KINDS, STEP_KINDS, StepErrors, busy_kind

if TYPE_CHECKING:
    from ricllm.engine.runtime.capabilities import KernelLimits

RESIDUAL_UNITS = "ratio"  # what a fit file's residuals hold, every kind's: measured / fitted
# The first step after an idle gap runs cold (caches, the CPU's clock, woken threads) for about this long, then
# warm: on a 2-core EPYC, first steps fitted at 19-420 ms ran 4-21 ms (medians) past the same steps run warm,
# 1.22 times a 19 ms step, 1.05 times a 420 ms one. Its multiplier is taken over, and charged to, this much.
AFTER_IDLE_WARM_S = 0.06
FEATURES = ("intercept", "prefill_tokens", "decode_seqs", "context_tokens", "prefill_attention", "op_by_op_step",
            "op_by_op_prefill_tokens", "op_by_op_prefill_attention", "head_rows", "op_by_op_context_tokens",
            "kernel_prefill_tokens")


def runs_op_by_op(f: StepFeatures, limits: KernelLimits | None) -> bool:
    """A step with prefill beyond the runtime's kernel ``limits`` (None: it has none, so no step
    passes them; a one-token prefill chunk counts as prefill here and as a decode row in the kernel)."""
    return limits is not None and f.num_prefill_tokens > 0 and not limits.cover(f.num_prefill_tokens,
                                                                                 f.prefill_products)


def feature_vector(f: StepFeatures, limits: KernelLimits | None) -> np.ndarray:
    op = 1.0 if runs_op_by_op(f, limits) else 0.0
    return np.array([1.0, f.num_prefill_tokens, f.num_decode_seqs, f.num_context_tokens, f.prefill_attention,
                     op, op * f.num_prefill_tokens, op * f.prefill_attention, f.head_rows, op * f.num_context_tokens,
                     (1.0 - op) * f.num_prefill_tokens])


@dataclass
class Roofline:
    """Bytes a step must read, at a measured bandwidth: the weights (the head's share of them as
    far as its rows read it), and the K/V of every layer at each cache group's positions read."""

    weight_bytes: float  # every weight a step with a whole head row reads, the head's included
    kv_bytes_per_token: float  # K and V of one position across every layer
    bandwidth_bytes_per_s: float
    head_bytes: float = 0.0  # of ``weight_bytes``, the LM head's

    def seconds(self, f: StepFeatures) -> float:
        """A narrowed head's rows share their tiles' reads: ``head_rows`` (capped at one whole read)
        is at least the share a step reads."""
        unread_head = self.head_bytes * max(1.0 - f.head_rows, 0.0)
        kv = self.kv_bytes_per_token * f.num_context_tokens
        return (self.weight_bytes - unread_head + kv) / self.bandwidth_bytes_per_s


@dataclass
class LatencyModel:
    coefficients: list[float]  # seconds per unit of each FEATURES entry
    roofline: Roofline | None = None
    residuals: dict[str, list[float]] = field(default_factory=dict)  # the calibration's, per step kind
    quantile: float = 0.9  # of each kind's recent ratios: promises hold for all but its slowest tenth of steps
    kernel_limits: KernelLimits | None = None  # the runtime's, which the op-by-op terms are about (the engine sets it)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)  # the engine's (it sets it)
    errors: deque = field(default_factory=lambda: deque(maxlen=2048), repr=False)
    overruns: deque = field(default_factory=lambda: deque(maxlen=1024), repr=False)  # s past the prediction
    stall_cap: float = 0.05  # s: the most one step's stall is reserved for
    stall_share: float = 0.0  # of a request's mean step: the least its bound reserves for one slow step
    adapter_block_s: float = 0.0  # l: one read of the dearest resident adapter's weights for up to 4 rows
    step_errors: StepErrors = field(init=False, repr=False)
    _worst_overrun: float = field(default=0.0, init=False, repr=False)  # max(overruns), kept as they come and go

    def __post_init__(self) -> None:
        if len(self.coefficients) > len(FEATURES):
            raise ValueError(f"{len(self.coefficients)} coefficients, but the model has {len(FEATURES)} terms")
        # a fit written before a term was added: that term is 0
        self.coefficients = list(self.coefficients) + [0.0] * (len(FEATURES) - len(self.coefficients))
        self.step_errors = StepErrors(self.residuals, self.quantile)

    @property
    def kernel_prefill_work(self) -> float:
        """The attention work a step's prefill may do within ``kernel_limits``: unbounded without any."""
        return math.inf if self.kernel_limits is None else self.kernel_limits.prefill_work

    def base(self, f: StepFeatures) -> float:
        linear = float(feature_vector(f, self.kernel_limits) @ np.asarray(self.coefficients))
        floor = self.roofline.seconds(f) if self.roofline else 0.0
        return max(linear, floor) + self.adapter_block_s * f.adapter_blocks

    def price_adapters(self, largest_adapter_bytes: int) -> None:
        """Set ``adapter_block_s`` for the adapters now resident: one read of the largest at the
        roofline's bandwidth (no roofline: no term)."""
        bandwidth = self.roofline.bandwidth_bytes_per_s if self.roofline is not None else 0.0
        self.adapter_block_s = largest_adapter_bytes / bandwidth if bandwidth > 0 else 0.0

    def multiplier(self, kind: str) -> float:
        """measured / fitted for ``kind`` (``decode`` or ``prefill``): the bound's factor for its steps."""
        return self.step_errors.multiplier(kind, self.clock())

    @property
    def multipliers(self) -> dict[str, float]:
        return {kind: self.multiplier(kind) for kind in BUSY_KINDS}

    @property
    def step_multiplier(self) -> float:
        """The larger busy multiplier: the one figure for logs and the slowdown detector's verdicts."""
        return max(self.multipliers.values())

    def bound_multiplier(self, follow_last_step: bool) -> float:
        """The factor a bound charges every step: ``step_multiplier``, with ``follow_last_step`` at
        least the last busy step's own ratio too (``StepErrors.latest_busy_ratio``)."""
        if not follow_last_step:
            return self.step_multiplier
        return max(self.step_multiplier, self.step_errors.latest_busy_ratio(self.clock()))

    @property
    def after_idle_multiplier(self) -> float:
        """measured / fitted that all but the slowest tenth of recent first steps after an idle gap
        stay within: a bound made while the engine is idle charges its first step this where it is
        the larger (``after_idle_charge``)."""
        return self.step_errors.multiplier("after_idle", self.clock())

    def after_idle_charge(self, first_step_s: float) -> float:
        """Seconds a bound made while idle adds beyond ``step_multiplier`` on every step: the
        first step's cold part (its first ``AFTER_IDLE_WARM_S`` at most, of at most ``first_step_s``)
        charged the after-idle multiplier instead, where that is the larger."""
        return max(self.after_idle_multiplier - self.step_multiplier, 0.0) * min(first_step_s, AFTER_IDLE_WARM_S)

    def predict(self, f: StepFeatures) -> float:
        """Seconds for one busy step carrying ``f``: the fit times its kind's multiplier."""
        return self.base(f) * self.multiplier(busy_kind(f.num_prefill_tokens))

    def observe(self, f: StepFeatures, measured_s: float, after_idle: bool = False) -> None:
        """Learn from a measured step: a busy one moves its kind's multiplier and the stall reserve,
        one after an idle gap (or a probe) only the after-idle multiplier. Either records the
        relative error of the point estimate (the fit times the kind's median ratio)."""
        base, now = self.base(f), self.clock()
        kind = "after_idle" if after_idle else busy_kind(f.num_prefill_tokens)
        typical = self.step_errors.typical_ratio(kind, now)
        point = base + (typical - 1.0) * min(base, AFTER_IDLE_WARM_S) if after_idle else base * typical
        self.errors.append((measured_s - point) / measured_s if measured_s > 0 else 0.0)
        if not after_idle:
            self._record_overrun(max(measured_s - base * self.step_errors.multiplier(kind, now), 0.0))
        if base > 0 and measured_s > 0:
            self.step_errors.add(kind, after_idle_ratio(measured_s, base) if after_idle else measured_s / base, now)

    @property
    def stall_reserve(self) -> float:
        """Seconds every bound sets aside for one stalled busy step: the worst overrun of the bound's
        step time over the recent busy steps (``overruns``' window), at most ``stall_cap``. The
        multipliers cover all but the slowest tenth of steps in proportion; a request of three steps
        cannot absorb a single step that runs 20 ms late (a neighbour's burst, a page fault) in a 10%
        margin, this reserve does. A longer stall is the machine taken away, not one slow step:
        reserving it would refuse every request for the whole window (a 5 s stall did, for about
        50 s of idle probes); the multipliers and the slowdown detector answer a machine that stays
        slow. Steps after an idle gap are the after-idle multiplier's, not this."""
        return min(self._worst_overrun, self.stall_cap)

    def reserve(self, busy_steps: int, mean_step_s: float = 0.0) -> float:
        """Seconds a bound holds beyond its steps' fitted time × multiplier when at least one of its
        steps runs busy (``busy_steps``): the stall reserve, and at least ``stall_share`` of the
        request's mean step (``mean_step_s``, as the bound charges it). The stall reserve sees a stall
        only after one happened, and is capped in seconds; a host that slows one 400 ms step by a
        third costs as large a share of it as of a 20 ms step, and the first such step comes
        unannounced. A request that an idle engine serves in one step runs no busy step, so no busy
        step's stall can delay it."""
        if busy_steps <= 0:
            return 0.0
        return max(self.stall_reserve, self.stall_share * mean_step_s)

    def keep_overruns(self, steps: int, cap_s: float, share: float = 0.0) -> None:
        """Size the window ``stall_reserve`` looks at (0: no reserve), its cap, and the share of a
        request's mean step every bound with a busy step reserves."""
        self.stall_share = share
        self.overruns = deque(self.overruns, maxlen=steps)
        self._worst_overrun = max(self.overruns, default=0.0)
        self.stall_cap = cap_s

    def _record_overrun(self, overrun: float) -> None:
        """Keep the window's worst at hand: every bound reads it (several times a step, at every
        arrival); it is recomputed only when the worst one leaves the window."""
        if self.overruns.maxlen == 0:
            return
        leaving = self.overruns[0] if len(self.overruns) == self.overruns.maxlen else None
        self.overruns.append(overrun)
        if leaving is not None and leaving >= self._worst_overrun:
            self._worst_overrun = max(self.overruns)
        else:
            self._worst_overrun = max(self._worst_overrun, overrun)

    def typical_ratio(self, kind: str = "decode") -> float:
        """The median measured / fitted ratio of recent ``kind`` steps: how much slower the typical
        step runs than the fit (outliers, which the multiplier covers, do not move it)."""
        return self.step_errors.typical_ratio(kind, self.clock())

    def error_summary(self) -> dict:
        """Median and p95 of |relative error|, over the recorded steps."""
        if not self.errors:
            return {"steps": 0, "median_abs_error": None, "p95_abs_error": None}
        absolute = sorted(abs(e) for e in self.errors)
        return {"steps": len(absolute), "median_abs_error": statistics.median(absolute),
                "p95_abs_error": absolute[min(len(absolute) - 1, int(0.95 * len(absolute)))]}

    def to_json(self) -> dict:
        """The fit and the calibration's residuals: nothing learned online, so a slow run's errors
        do not outlive it in the cached fit."""
        return {"features": list(FEATURES), "coefficients": self.coefficients,
                "roofline": asdict(self.roofline) if self.roofline else None, "residuals": self.residuals,
                "residual_units": RESIDUAL_UNITS}

    @classmethod
    def from_json(cls, data: dict) -> "LatencyModel":
        """A fit file (a ``correction`` an older version wrote is ignored: it was one run's; so are
        after-idle residuals in a file not marked ``residual_units: ratio``, which are seconds: that
        kind then starts at the fit's word). Its
        ``features`` must be the leading terms of ``FEATURES``, in order: a term it lacks is 0."""
        named = list(data.get("features") or FEATURES[:len(data["coefficients"])])
        if named != list(FEATURES[:len(named)]) or len(named) != len(data["coefficients"]):
            raise ValueError(f"its terms {named} are not this ricllm's {list(FEATURES)}: calibrate afresh")
        roofline = Roofline(**data["roofline"]) if data.get("roofline") else None
        residuals = {kind: [float(v) for v in values] for kind, values in (data.get("residuals") or {}).items()
                     if kind in STEP_KINDS}
        if data.get("residual_units") != RESIDUAL_UNITS:  # a file whose after-idle residuals are seconds
            residuals.pop("after_idle", None)
        return cls(coefficients=list(data["coefficients"]), roofline=roofline, residuals=residuals)

    def save(self, path: Path, key: dict | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key or {}, "model": self.to_json()}, indent=2))

    @classmethod
    def load(cls, path: Path) -> "LatencyModel":
        return cls.from_json(json.loads(Path(path).read_text())["model"])


def after_idle_ratio(measured_s: float, fitted_s: float) -> float:
    """What a first step after an idle gap ran past its fit, over the cold part it is charged on:
    measured / fitted for a step within ``AFTER_IDLE_WARM_S``; a longer one's excess over that much,
    so a bound that charges the ratio to a step's cold part covers the whole step."""
    return 1.0 + (measured_s - fitted_s) / min(fitted_s, AFTER_IDLE_WARM_S)


def fit(samples: list[tuple[StepFeatures, float]], roofline: Roofline | None = None,
        kernel_limits: KernelLimits | None = None) -> LatencyModel:
    """Non-negative least squares over ``(features, seconds)`` samples, refitted once without outliers.

    Relative (not absolute) error is minimised: rows are weighted by 1/t, so a 2 ms decode
    step counts as much as a 200 ms prefill. Steps that took more than twice (or less than half)
    the first fit's prediction are dropped before the refit: a first run of a new shape pays
    one-off kernel compilation, and a noisy neighbour can stall a step; neither is the model.
    The kept steps' ratios measured / fitted, per kind, are the model's ``residuals``: where the
    error model starts (a stall is the stall reserve's, learned online, not a fit's spread).
    """
    x = np.stack([feature_vector(f, kernel_limits) for f, _ in samples])
    y = np.array([t for _, t in samples])
    coefficients = _nnls(x, y)
    ratio = y / np.maximum(x @ coefficients, 1e-9)
    keep = (ratio < 2.0) & (ratio > 0.5)
    if keep.sum() >= x.shape[1] * 2:
        coefficients = _nnls(x[keep], y[keep])
    model = LatencyModel(coefficients=coefficients.tolist(), roofline=roofline, kernel_limits=kernel_limits)
    kept = [sample for sample, kept in zip(samples, keep) if kept]
    return LatencyModel(coefficients=model.coefficients, roofline=roofline, residuals=busy_residuals(model, kept),
                        kernel_limits=kernel_limits)


def busy_residuals(model: LatencyModel, samples: list[tuple[StepFeatures, float]]) -> dict[str, list[float]]:
    """measured / fitted of each sample, by busy kind (4 significant digits: a fit file stays small)."""
    residuals: dict[str, list[float]] = {kind: [] for kind in BUSY_KINDS}
    for f, seconds in samples:
        base = model.base(f)
        if base > 0 and seconds > 0:
            residuals[busy_kind(f.num_prefill_tokens)].append(float(f"{seconds / base:.4g}"))
    return residuals


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Active-set NNLS on relative error: drop the most negative term until all are >= 0."""
    weights = 1.0 / np.maximum(y, 1e-6)
    active = list(range(x.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (solution >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(solution)))
    coefficients = np.zeros(x.shape[1])
    coefficients[active] = np.maximum(solution, 0)
    return coefficients
