"""Which CPUs the engine computes on (``EngineConfig.engine_cpus``), and keeping other threads off them.

Why: the engine's OpenMP workers meet at a barrier after every kernel, many times per layer. A
thread that preempts one worker (the server's socket thread, libzmq's I/O thread, a client on
the same node) stalls the others at the next barrier, so a little protocol work stretches a
whole step. With the engine on CPUs of its own and the server's other threads on the rest, the
two stop competing (benchmarks/RESULTS.md, protocol overhead). Linux only: it uses
``sched_setaffinity``, which pins the calling thread; threads it starts later (OpenMP's
workers) inherit its CPUs.

``engine_cpus`` counts within the CPUs the process may run on (``os.sched_getaffinity``, sorted):
``"0-2"`` is the first three of them, whichever CPUs those are. A Guaranteed Kubernetes pod under
the static CPU manager gets a cpuset the node picks (say 12-15), so a descriptor written before
deployment cannot name absolute CPUs; counted this way, the same controls hold on any node. Where
the process may use every CPU of the machine (no taskset, no cpuset) the two readings agree.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator

from ricllm.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(spec: str | Iterable[int]) -> tuple[int, ...]:
    """``"0-3,6"`` (the kernel's cpulist format) or integers -> sorted, distinct CPU numbers."""
    if isinstance(spec, str):
        if not spec.strip():
            raise ConfigError("engine_cpus: empty; give CPU numbers such as '0-3', or leave it unset")
        cpus: set[int] = set()
        for part in spec.replace(" ", "").split(","):
            match = _RANGE.match(part)
            if match is None:
                raise ConfigError(f"engine_cpus: {part!r} in {spec!r} is not a CPU number or a range "
                                  "such as 0-3 (expected a list like '0-3,6')")
            first, last = int(match[1]), int(match[2] or match[1])
            if last < first:
                raise ConfigError(f"engine_cpus: range {part!r} runs backwards")
            cpus.update(range(first, last + 1))
    else:
        cpus = set()
        for cpu in spec:
            if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
                raise ConfigError(f"engine_cpus: {cpu!r} is not a CPU number (an integer >= 0)")
            cpus.add(cpu)
    if not cpus:
        raise ConfigError("engine_cpus: empty; give CPU numbers such as '0-3', or leave it unset")
    return tuple(sorted(cpus))


def check_cpu_list_field(value: str | list[int] | None) -> str | list[int] | None:
    """A pydantic field validator's body (descriptor controls, scenario settings): the value as
    given, or a ValueError that pydantic reports under the field's name."""
    if value is not None:
        try:
            parse_cpu_list(value)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("engine_cpus: ")) from None
    return value


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (a container's cpuset, taskset)."""
    if not hasattr(os, "sched_getaffinity"):
        raise ConfigError("engine_cpus needs Linux (sched_setaffinity); leave it unset on this system")
    return os.sched_getaffinity(0)


def check_engine_cpus(spec: str | Iterable[int]) -> tuple[int, ...]:
    """The CPUs ``spec`` names, counted from 0 within the CPUs this process may run on, as the
    sorted CPU numbers the kernel knows them by; else a ConfigError naming the count and those CPUs."""
    indices = parse_cpu_list(spec)
    allowed = sorted(allowed_cpus())
    beyond = [index for index in indices if index >= len(allowed)]
    if beyond:
        listed, span = ", ".join(map(str, beyond)), format_cpu_list(range(len(allowed)))
        raise ConfigError(f"engine_cpus: {listed} {'is' if len(beyond) == 1 else 'are'} beyond the {len(allowed)} "
                          f"CPUs this process may run on (engine_cpus counts them from 0: give numbers in "
                          f"{span}; they are CPUs {format_cpu_list(allowed)} here)")
    return tuple(allowed[index] for index in indices)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ordered, parts = sorted(cpus), []
    start = previous = None
    for cpu in ordered + [None]:
        if start is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)


def pin_current_thread(cpus: Iterable[int]) -> None:
    os.sched_setaffinity(0, set(cpus))


def other_cpus(engine_cpus: Iterable[int] | None) -> set[int]:
    """Where the server's other threads go: the allowed CPUs the engine does not use (empty when
    the engine has them all, or no ``engine_cpus`` is set: then nothing is pinned)."""
    if not engine_cpus:
        return set()
    return allowed_cpus() - set(engine_cpus)


@contextlib.contextmanager
def threads_started_on(cpus: set[int]) -> Iterator[None]:
    """Threads started inside run on ``cpus`` (they inherit the starting thread's CPUs); the
    calling thread gets its own CPUs back after. No CPUs: nothing changes."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_current_thread(cpus)
    try:
        yield
    finally:
        pin_current_thread(before)
