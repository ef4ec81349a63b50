"""The sustained-slowdown detector: is the machine slower now than it has been?

It compares the typical step now (the median measured / predicted ratio over the last ``window``
steps) with the typical step of the recent past (a low quantile of those medians over the last
``horizon`` steps), not with the fit itself: a fit calibrated on a busier or quieter moment is
off by a constant factor, which the step multipliers absorb but which must not make the
detector fire, or stay silent, on its own. The fit is also off by different factors for
different kinds of steps, so the mix of traffic moves the typical ratio; a long window and a
quantile baseline (not the quietest moment ever seen) keep such swings from reading as a
slowdown. A slowdown that lasts most of ``horizon`` steps becomes the new normal (the
multipliers keep covering it; the detector says it is over).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SlowdownDetector:
    threshold: float = 1.25  # typical ratio now / typical ratio of the recent past
    window: int = 64  # steps whose median ratio is the typical step now
    horizon: int = 2048  # steps of typical ratios the baseline is taken from
    baseline_quantile: float = 0.2  # of those: the recent past's quieter moments, not its quietest
    slow: bool = False
    baseline: float = 1.0
    _ratios: deque = field(default_factory=deque, repr=False)
    _typicals: deque = field(default_factory=deque, repr=False)
    _since_baseline: int = 0

    @property
    def typical(self) -> float:
        return statistics.median(self._ratios) if self._ratios else 1.0

    @property
    def slowdown(self) -> float:
        """How much slower the typical step is now than the recent past's."""
        return self.typical / self.baseline

    def observe(self, ratio: float) -> bool | None:
        """Feed one step's measured / predicted ratio; the new state when it changes (else None).
        Silent until the window is full."""
        self._ratios.append(ratio)
        if len(self._ratios) > self.window:
            self._ratios.popleft()
        if len(self._ratios) < self.window:
            return None
        self._remember(self.typical)
        slow = self.slowdown >= self.threshold
        if slow == self.slow:
            return None
        self.slow = slow
        return slow

    def _remember(self, typical: float) -> None:
        """Keep the typical ratio; refresh the baseline every eighth of a window (sorting is not free)."""
        self._typicals.append(typical)
        if len(self._typicals) > self.horizon:
            self._typicals.popleft()
        self._since_baseline -= 1
        if self._since_baseline <= 0:
            ordered = sorted(self._typicals)
            self.baseline = ordered[int(self.baseline_quantile * (len(ordered) - 1))]
            self._since_baseline = max(self.window // 8, 1)
