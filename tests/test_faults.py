"""ricllm.faults: a CpuHog's processes run where they are told and never outlive it (nor its parent);
slow_steps makes an engine's steps measurably slower, and undoing it restores them."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ricllm.faults import CpuHog, slow_steps

ROOT = Path(__file__).parents[1]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.timeout(60)
def test_cpu_hog_spins_on_its_cpus_and_stop_leaves_no_process():
    cpus = sorted(os.sched_getaffinity(0))[:1]
    hog = CpuHog(cpus, duty=0.3, period_s=0.01)
    hog.start()
    try:
        pids = [child.pid for child in hog._children]
        assert len(pids) == 1 and hog.running and all(alive(p) for p in pids)
        assert os.sched_getaffinity(pids[0]) == set(cpus)
        hog.start()  # idempotent while running
        assert [child.pid for child in hog._children] == pids
    finally:
        hog.stop()
    assert not hog.running and wait_gone(pids, 5) == []
    hog.stop()  # idempotent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(60)
def test_a_spawned_hog_waits_without_spinning_until_it_starts():
    """Spawned ahead, the processes are up (their start-up done) and idle: the neighbour begins at its
    duty cycle when started, not with interpreters starting up."""
    hog = CpuHog(sorted(os.sched_getaffinity(0))[:1], duty=0.5, period_s=0.01)
    hog.spawn()
    try:
        pid = hog._children[0].pid
        assert alive(pid) and not hog.running
        waiting = cpu_seconds(pid)
        time.sleep(0.5)
        assert cpu_seconds(pid) - waiting <= 0.02, "a spawned hog spins before it is started"
        hog.start()
        assert hog.running and [child.pid for child in hog._children] == [pid]
        time.sleep(0.5)
        assert cpu_seconds(pid) - waiting >= 0.1, "a started hog does not spin"
    finally:
        hog.stop()
    assert wait_gone([pid], 5) == []


@pytest.mark.timeout(60)
def test_cpu_hog_as_context_manager_stops_on_error():
    with pytest.raises(RuntimeError), CpuHog(duty=0.2) as hog:
        pids = [child.pid for child in hog._children]
        assert len(pids) == len(os.sched_getaffinity(0))
        raise RuntimeError("boom")
    assert wait_gone(pids, 5) == []


@pytest.mark.timeout(60)
def test_cpu_hog_children_exit_when_their_parent_dies_without_stopping_them():
    code = ("import os, sys; from ricllm.faults import CpuHog\n"
            "hog = CpuHog(duty=0.2); hog.start()\n"
            "print(' '.join(str(c.pid) for c in hog._children), flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True, timeout=30)
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stderr
    assert wait_gone(pids, 10) == []


@pytest.mark.parametrize("kwargs, words", [({"duty": 0.0}, "duty must be in (0, 1]"),
                                           ({"duty": 1.5}, "duty must be in (0, 1]"),
                                           ({"period_s": 0}, "period_s must be positive")])
def test_cpu_hog_refuses_bad_settings(kwargs, words):
    with pytest.raises(ValueError) as info:
        CpuHog(**kwargs)
    assert words in str(info.value)


@pytest.mark.timeout(300)
def test_slow_steps_multiplies_a_tiny_engines_step_time(tiny_gguf):
    from ricllm.config import EngineConfig
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", kv_cache_budget="2MiB"))

    def median_step_s(steps: int) -> float:
        engine.add_request(list(range(5, 37)), SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        engine.step()  # the prefill
        durations = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            durations.append(time.perf_counter() - started)
        while engine.has_unfinished():
            engine.step()
        return statistics.median(durations)

    median_step_s(5)  # warm up
    # the fault stretches the model's run, about half of a tiny engine's step (scheduling and
    # sampling are the rest): 8x the run makes the step well over 2.5x, since the wait is
    # proportional to each run's own time. Another process taking the CPU during one measurement
    # (fresh-clone CI once saw a 2.6 ms base step against the usual 0.25) can hide that, so the
    # measurements are taken again, up to three times; a fault that does nothing fails every time.
    for _ in range(3):
        base = median_step_s(15)
        undo = slow_steps(engine, 8.0)
        slowed = median_step_s(15)
        undo()
        again = median_step_s(15)
        if slowed > 2.5 * base and again < slowed / 2:
            break
    assert slowed > 2.5 * base, (base, slowed)
    assert again < slowed / 2, (again, slowed)
    factor = [1.0]
    undo = slow_steps(engine, lambda: factor[0])  # read every step
    factor[0] = 8.0
    assert median_step_s(15) > 2.5 * base
    undo()
