"""Predict one engine step's time from what it carries, so admission can promise deadlines.

    t(step) = max( roofline,  a + b·P + c·D + d·C + e·Q + f·S )

P prefill tokens, D decode sequences, C Σ context positions read, Q Σ (chunk × context) over
prefill chunks (a chunk's attention costs its length times what it attends to, which a linear
term in P misses for long prompts), S = 1 for a step that runs its layers op by op from
Python: on the CPU, decode steps and small prefill steps run as one C call, larger prefill
steps (attention in SDPA or the C prefill kernel) op by op, a fixed cost of its own. The roofline ``(weight bytes + KV bytes read) / bandwidth``
is the floor: no step can be faster than reading its bytes once.

The fit is non-negative least squares on a calibration sweep; online, a multiplicative
correction tracks a high quantile (0.9 by default) of the ratio of measured to predicted time over
the last steps: a promise is made against how slow steps run on this machine now, not against
their average, yet one stalled step cannot swing it; a machine that slows down is caught within a
few dozen steps, and every prediction's error is recorded.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ricllm.attention.cpu_policy import C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK
from ricllm.engine.scheduler import StepFeatures

FEATURES = ("intercept", "prefill_tokens", "decode_seqs", "context_tokens", "prefill_attention", "op_by_op_step")


def runs_op_by_op(f: StepFeatures) -> bool:
    """A step with prefill beyond what the CPU attention kernel takes (``c_kernel_attends``; a
    one-token prefill chunk counts as prefill here and as a decode row there)."""
    return f.num_prefill_tokens > 0 and (f.num_prefill_tokens > C_KERNEL_PREFILL_ROWS
                                         or f.prefill_attention > C_KERNEL_PREFILL_WORK)


def feature_vector(f: StepFeatures) -> np.ndarray:
    return np.array([1.0, f.num_prefill_tokens, f.num_decode_seqs, f.num_context_tokens, f.prefill_attention,
                     1.0 if runs_op_by_op(f) else 0.0])


@dataclass
class Roofline:
    weight_bytes: float
    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float

    def seconds(self, f: StepFeatures) -> float:
        return (self.weight_bytes + self.kv_bytes_per_token * f.num_context_tokens) / self.bandwidth_bytes_per_s


@dataclass
class LatencyModel:
    coefficients: list[float]  # seconds per unit of each FEATURES entry
    roofline: Roofline | None = None
    correction: float = 1.0  # measured / predicted, tracked online
    window: int = 32  # steps whose measured/predicted ratios set the correction
    quantile: float = 0.9  # of those ratios: promises hold for all but the slowest tenth of steps
    errors: deque = field(default_factory=lambda: deque(maxlen=2048), repr=False)
    ratios: deque = field(default_factory=lambda: deque(maxlen=32), repr=False)
    overruns: deque = field(default_factory=lambda: deque(maxlen=1024), repr=False)  # s past the prediction
    stall_cap: float = 0.05  # s: the most one step's stall is reserved for
    _worst_overrun: float = field(default=0.0, init=False, repr=False)  # max(overruns), kept as they come and go

    def __post_init__(self) -> None:
        if len(self.coefficients) > len(FEATURES):
            raise ValueError(f"{len(self.coefficients)} coefficients, but the model has {len(FEATURES)} terms")
        # a fit written before a term was added: that term is 0
        self.coefficients = list(self.coefficients) + [0.0] * (len(FEATURES) - len(self.coefficients))

    def base(self, f: StepFeatures) -> float:
        linear = float(feature_vector(f) @ np.asarray(self.coefficients))
        floor = self.roofline.seconds(f) if self.roofline else 0.0
        return max(linear, floor)

    def predict(self, f: StepFeatures) -> float:
        """Seconds for one step carrying ``f``, with the online correction applied."""
        return self.base(f) * self.correction

    def observe(self, f: StepFeatures, measured_s: float) -> None:
        """Refine online from a measured step; record the relative error of the point estimate
        (the median-corrected prediction; the promise-making correction is a higher quantile) and
        how far the step ran past the prediction promises were made with."""
        base = self.base(f)
        self._record_overrun(max(measured_s - base * self.correction, 0.0))
        point = base * self.typical_ratio
        self.errors.append((measured_s - point) / measured_s if measured_s > 0 else 0.0)
        if base > 0 and measured_s > 0:
            if self.ratios.maxlen != self.window:
                self.ratios = deque(self.ratios, maxlen=self.window)
            self.ratios.append(measured_s / base)
            self.correction = self._ratio_quantile()

    @property
    def stall_reserve(self) -> float:
        """Seconds every bound sets aside for one stalled step: the worst overrun of the prediction
        over the recent steps (``overruns``' window), at most ``stall_cap``. The correction covers
        all but the slowest tenth of steps in proportion; a request of three steps cannot absorb a
        single step that runs 20 ms late (a neighbour's burst, a page fault) in a 10% margin, this
        reserve does. A longer stall is the machine taken away, not one slow step: reserving it
        would refuse every request for the whole window (a 5 s stall did, for about 50 s of idle
        probes); the correction and the slowdown detector answer a machine that stays slow."""
        return min(self._worst_overrun, self.stall_cap)

    def keep_overruns(self, steps: int, cap_s: float) -> None:
        """Size the window ``stall_reserve`` looks at (0: no reserve) and its cap."""
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

    @property
    def typical_ratio(self) -> float:
        """The median measured / predicted ratio over the window: how much slower the typical step
        runs than the fit (outliers, which the correction covers, do not move it)."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def _ratio_quantile(self) -> float:
        ordered = sorted(self.ratios)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def error_summary(self) -> dict:
        """Median and p95 of |relative error|, over the recorded steps."""
        if not self.errors:
            return {"steps": 0, "median_abs_error": None, "p95_abs_error": None}
        absolute = sorted(abs(e) for e in self.errors)
        return {"steps": len(absolute), "median_abs_error": statistics.median(absolute),
                "p95_abs_error": absolute[min(len(absolute) - 1, int(0.95 * len(absolute)))]}

    def to_json(self) -> dict:
        return {"features": list(FEATURES), "coefficients": self.coefficients,
                "roofline": asdict(self.roofline) if self.roofline else None, "correction": self.correction}

    @classmethod
    def from_json(cls, data: dict) -> "LatencyModel":
        roofline = Roofline(**data["roofline"]) if data.get("roofline") else None
        return cls(coefficients=list(data["coefficients"]), roofline=roofline,
                   correction=float(data.get("correction", 1.0)))

    def save(self, path: Path, key: dict | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key or {}, "model": self.to_json()}, indent=2))

    @classmethod
    def load(cls, path: Path) -> "LatencyModel":
        return cls.from_json(json.loads(Path(path).read_text())["model"])


def fit(samples: list[tuple[StepFeatures, float]], roofline: Roofline | None = None) -> LatencyModel:
    """Non-negative least squares over ``(features, seconds)`` samples, refitted once without outliers.

    Relative (not absolute) error is minimised: rows are weighted by 1/t, so a 2 ms decode
    step counts as much as a 200 ms prefill. Steps that took more than twice (or less than half)
    the first fit's prediction are dropped before the refit: a first run of a new shape pays
    one-off kernel compilation, and a noisy neighbour can stall a step; neither is the model.
    """
    x = np.stack([feature_vector(f) for f, _ in samples])
    y = np.array([t for _, t in samples])
    coefficients = _nnls(x, y)
    ratio = y / np.maximum(x @ coefficients, 1e-9)
    keep = (ratio < 2.0) & (ratio > 0.5)
    if keep.sum() >= x.shape[1] * 2:
        coefficients = _nnls(x[keep], y[keep])
    return LatencyModel(coefficients=coefficients.tolist(), roofline=roofline)


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
