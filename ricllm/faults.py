"""Fault injection: a machine slower than the one admission was calibrated on.

Two faults, for tests, benchmarks and scenario replay:

- ``CpuHog``: a noisy neighbour. One child process per CPU spins for ``duty`` of every
  ``period_s`` on the CPUs the engine uses, the way another xApp on a shared RIC node would.
  How much slower steps get depends on the machine and the OpenMP runtime, so it is what a
  scenario measures, not what it assumes.
- ``slow_steps``: a deterministic step-time multiplier. Each model step is followed by a wait of
  ``(factor - 1)`` times its duration, so a step measures ``factor`` times what it did.

Both are started and stopped mid-run; neither touches the engine's numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Self

# Says it is up, waits for "go", then spins for duty·period and sleeps the rest; exits when its parent is
# gone (a crashed run leaves no hog) or closes its stdin without "go".
_HOG_SOURCE = """
import os, sys, time
duty, period, parent = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
if sys.stdin.readline() != "go\\n":
    sys.exit(0)
while os.getppid() == parent:
    start = time.perf_counter()
    while time.perf_counter() - start < duty * period:
        pass
    if duty < 1.0:
        time.sleep((1.0 - duty) * period)
"""


class CpuHog:
    """Child processes that keep ``cpus`` busy for ``duty`` (0 to 1) of every ``period_s``.

    ``cpus`` defaults to every CPU this process may run on (the engine's, when it is pinned).
    A context manager; ``start`` and ``stop`` may also be called mid-run. ``spawn`` starts the processes
    ahead, waiting: a Python interpreter's own start-up takes a whole CPU for tens of milliseconds, a
    burst that is not the neighbour the duty describes, so a scenario spawns before its clock starts and
    ``start`` only lets them spin.
    """

    def __init__(self, cpus: Iterable[int] | None = None, duty: float = 1.0, period_s: float = 0.01):
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.cpus = tuple(sorted(cpus if cpus is not None else os.sched_getaffinity(0)))
        self.duty = duty
        self.period_s = period_s
        self._children: list[subprocess.Popen] = []
        self._spinning = False

    @property
    def running(self) -> bool:
        """Spinning (started, and a process still alive)."""
        return self._spinning and any(child.poll() is None for child in self._children)

    def spawn(self) -> None:
        """Start the processes, each pinned to its CPU and waiting to spin; returns once all are up."""
        if self._children:
            return
        for cpu in self.cpus:
            child = subprocess.Popen([sys.executable, "-c", _HOG_SOURCE, str(self.duty), str(self.period_s),
                                      str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            os.sched_setaffinity(child.pid, {cpu})
            self._children.append(child)
        for child in self._children:
            child.stdout.readline()

    def start(self) -> None:
        if self.running:
            return
        self.spawn()
        for child in self._children:
            child.stdin.write("go\n")
            child.stdin.close()
        self._spinning = True

    def stop(self) -> None:
        for child in self._children:
            child.kill()
        for child in self._children:
            child.wait()
            for pipe in (child.stdin, child.stdout):
                pipe.close()
        self._children = []
        self._spinning = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def slow_steps(engine, factor: float | Callable[[], float]) -> Callable[[], None]:
    """Make every model step of ``engine`` take ``factor`` times as long (a callable is read each
    step, so a test or benchmark can change it mid-run). Returns the function that undoes it."""
    runner = engine.runtime.runner
    real_run = runner.run
    factor_now = factor if callable(factor) else (lambda: factor)

    def slowed_run(batch, *allowed):
        started = time.perf_counter()
        result = real_run(batch, *allowed)
        extra = (factor_now() - 1.0) * (time.perf_counter() - started)
        if extra > 0:
            time.sleep(extra)
        return result

    runner.run = slowed_run

    def undo() -> None:
        runner.run = real_run

    return undo
