"""Timing an engine's decode steps, shared by the benchmarks that time them."""

from __future__ import annotations

import time


def full_decode_step_ms(engine, seqs: list, script: str) -> list[float]:
    """Step ``engine`` until nothing is unfinished; the wall time (ms) of each step in which every one
    of ``seqs`` decodes (the allowed tokens, the model, the head, sampling and the grammar included).
    A refused request ends the benchmark, named by ``script``."""
    if any(s.rejection is not None for s in seqs):
        raise SystemExit(f"{script}: a request was refused: {seqs[0].rejection}")
    times = []
    while engine.has_unfinished():
        every_stream = all(s.in_decode and not s.is_finished for s in seqs)
        started = time.perf_counter()
        engine.step()
        if every_stream:
            times.append((time.perf_counter() - started) * 1000)
    return times
