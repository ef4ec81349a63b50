"""The C kernels' thread team, one CPU per thread while a step runs (``kernels/cpu_team.c``).

Why: libgomp's workers sleep a few milliseconds after a parallel region, and the scheduler may
wake a sleeping worker on the CPU of the thread that woke it, which then spins at the region's
barrier until the scheduler's next tick. On a 2-CPU VM every first step after a pause of 5 ms or
more waited 4-8 ms for that (benchmarks/RESULTS.md, "a woken worker waits for the scheduler's
tick"). With each worker pinned to a CPU of its own and the stepping thread on the remaining one
while it computes, a woken worker starts at once.

The stepping thread is pinned only for the duration of ``computing()``: threads it starts between
steps (a user's own, in an offline ``LLM``) keep its CPUs. Only a thread whose CPUs number exactly
the team's threads is pinned (``engine_cpus``, or a pod's cpuset, sized to the team; a 2-CPU VM):
with more, other processes may load any of them, and the scheduler's freedom to move a thread off a
loaded CPU is worth more than a fast wake; with fewer, two threads of the team share a CPU either way.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import numpy as np

from ricllm.kernels.cpu_library import library
from ricllm.logging import get_logger

log = get_logger("ricllm.kernels.team")


class PinnedTeam:
    """``threads`` threads of the C kernels, each on one of the stepping thread's CPUs while a step
    runs. Invariant: inside ``computing()`` on a thread whose CPUs are ``cpus`` (sorted, as many as
    ``threads``), that thread runs on ``cpus[0]`` and worker t of its team on ``cpus[t]``; outside,
    and on a thread with another number of CPUs, the thread's CPUs are as they were."""

    def __init__(self, threads: int):
        self.threads = threads
        # per stepping thread: the CPUs its workers were pinned among, and its own CPU while computing
        self._pinned: dict[int, tuple[set[int], int | None]] = {}

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        own_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        cpu = self._cpu_while_computing(own_cpus)
        if cpu is None:
            yield
            return
        os.sched_setaffinity(0, {cpu})
        try:
            yield
        finally:
            os.sched_setaffinity(0, own_cpus)

    def _cpu_while_computing(self, own_cpus: set[int]) -> int | None:
        """This thread's CPU while it computes, its team's workers pinned among ``own_cpus`` (again
        when the thread's CPUs changed since); None where nothing is pinned."""
        thread = threading.get_ident()
        pinned = self._pinned.get(thread)
        if pinned is None or pinned[0] != own_cpus:
            pinned = self._pinned[thread] = (own_cpus, self._pin_workers(own_cpus))
        return pinned[1]

    def _pin_workers(self, own_cpus: set[int]) -> int | None:
        if self.threads < 2:
            return None
        if len(own_cpus) != self.threads:
            log.info("team_not_pinned", threads=self.threads, cpus=len(own_cpus))
            return None
        cpus = np.array(sorted(own_cpus), dtype=np.int32)  # as many as threads: one each
        failed = library().ricllm_pin_team(cpus.ctypes.data, self.threads)
        if failed:
            log.warning("team_not_pinned", threads=self.threads, workers_not_pinned=failed)
            return None
        log.debug("team_pinned", cpus=cpus.tolist())
        return int(cpus[0])
