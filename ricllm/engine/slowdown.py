"""The sustained-slowdown detector: is the machine slower now than it has been?

It compares the typical step now (the median measured / predicted ratio over the latency model's
window) with the quietest typical step of the recent past (the lowest such median over the last
``horizon`` steps), not with the fit itself: a fit calibrated on a busier or quieter moment is
off by a constant factor, which the online correction absorbs but which must not make the
detector fire, or stay silent, on its own. A slowdown that lasts longer than ``horizon`` steps
becomes the new normal (the correction keeps covering it; the detector says it is over).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SlowdownDetector:
    threshold: float = 1.25  # typical ratio now / quietest recent typical ratio
    horizon: int = 1024  # steps the quiet baseline is remembered
    slow: bool = False
    _step: int = 0
    _minima: deque = field(default_factory=deque, repr=False)  # (step, median): increasing medians

    def observe(self, typical_ratio: float) -> bool | None:
        """Feed one step's typical ratio (once the window is full); the new state when it changes."""
        self._step += 1
        while self._minima and self._minima[-1][1] >= typical_ratio:
            self._minima.pop()
        self._minima.append((self._step, typical_ratio))
        while self._minima[0][0] <= self._step - self.horizon:
            self._minima.popleft()
        slow = typical_ratio >= self.threshold * self.baseline
        if slow == self.slow:
            return None
        self.slow = slow
        return slow

    @property
    def baseline(self) -> float:
        """The quietest typical ratio over the last ``horizon`` steps."""
        return self._minima[0][1] if self._minima else 1.0

    @property
    def slowdown(self) -> float:
        """How much slower the typical step is now than the quiet baseline."""
        return self._minima[-1][1] / self.baseline if self._minima else 1.0
