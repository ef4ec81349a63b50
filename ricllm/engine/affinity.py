"""Which CPUs the engine computes on (``EngineConfig.engine_cpus``), and keeping other threads off them.

Why: the engine's OpenMP workers meet at a barrier after every kernel, many times per layer. A
thread that preempts one worker (the server's socket thread, libzmq's I/O thread, a client on
the same node) stalls the others at the next barrier, so a little protocol work stretches a
whole step. With the engine on CPUs of its own and the server's other threads on the rest, the
two stop competing (benchmarks/RESULTS.md, protocol overhead). Linux only: it uses
``sched_setaffinity``, which pins the calling thread; threads it starts later (OpenMP's
workers) inherit its CPUs.
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
    """Parsed, and each CPU one this process may use; else a ConfigError that lists those."""
    cpus = parse_cpu_list(spec)
    allowed = allowed_cpus()
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ConfigError(f"engine_cpus: CPU {', '.join(map(str, outside))} is not available to this process "
                          f"(it may use {format_cpu_list(allowed)})")
    return cpus


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
