"""The C kernels' team on CPUs of its own while a step runs (ricllm.kernels.team): the stepping
thread on its first CPU inside ``computing()`` and back on all of them after, each worker on the
next CPU, and nothing pinned where the thread has fewer CPUs than the team has threads.

Each case runs on a thread of its own: libgomp keeps one worker pool per thread that starts
parallel regions, and the pinning is per stepping thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ricllm.kernels.cpu_library import cpu_kernels_available
from ricllm.kernels.team import PinnedTeam

pytestmark = [
    pytest.mark.skipif(not cpu_kernels_available()[0], reason="the C kernels need a C compiler"),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="pinning a team of two needs Linux and two CPUs"),
]


def on_own_thread(body):
    """``body()``'s value, run on a new thread (with a worker pool of its own); its exception re-raised."""
    result: dict = {}

    def run():
        try:
            result["value"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def thread_cpus() -> dict[int, set[int]]:
    """Every thread of this process: its id and the CPUs it may run on."""
    cpus = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            cpus[int(task.name)] = os.sched_getaffinity(int(task.name))
        except OSError:  # the thread ended meanwhile
            continue
    return cpus


def test_the_stepping_thread_computes_on_its_first_cpu_and_gets_all_back_after():
    def body():
        own = os.sched_getaffinity(0)
        team = PinnedTeam(2)
        with team.computing():
            inside = os.sched_getaffinity(0)
        return own, inside, os.sched_getaffinity(0)

    own, inside, after = on_own_thread(body)
    assert inside == {min(own)}
    assert after == own


def test_a_worker_of_the_team_is_pinned_to_the_next_cpu():
    def body():
        before = set(thread_cpus())
        with PinnedTeam(2).computing():
            pass
        return sorted(os.sched_getaffinity(0)), {tid: cpus for tid, cpus in thread_cpus().items() if tid not in before}

    own, new_threads = on_own_thread(body)
    assert {own[1]} in new_threads.values(), f"no new thread on CPU {own[1]} alone: {new_threads}"


def test_a_thread_with_fewer_cpus_than_the_team_pins_nothing():
    def body():
        one_cpu = {min(os.sched_getaffinity(0))}
        os.sched_setaffinity(0, one_cpu)
        before = set(thread_cpus())
        with PinnedTeam(2).computing():
            inside = os.sched_getaffinity(0)
        new_threads = {tid: cpus for tid, cpus in thread_cpus().items() if tid not in before}
        return one_cpu, inside, new_threads

    one_cpu, inside, new_threads = on_own_thread(body)
    assert inside == one_cpu
    assert all(len(cpus) >= 1 and cpus == one_cpu for cpus in new_threads.values())


@pytest.mark.parametrize("pin_threads", [True, False])
def test_the_native_engine_pins_its_team_only_when_its_setting_says(tiny_native_gguf, pin_threads):
    """``pin_threads`` (default on): a generate on the engine's thread leaves a worker on its second
    CPU alone; off, every thread the step started may run on all of the thread's CPUs."""
    from ricllm import LLM, SamplingParams

    def body():
        before = set(thread_cpus())
        llm = LLM(str(tiny_native_gguf), runtime="native", weights="int4", threads=2, pin_threads=pin_threads,
                  weight_cache=False, kv_cache_budget="4MiB")
        llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))
        return sorted(os.sched_getaffinity(0)), [cpus for tid, cpus in thread_cpus().items() if tid not in before]

    own, new_threads = on_own_thread(body)
    assert ({own[1]} in new_threads) is pin_threads


def test_a_thread_with_more_cpus_than_the_team_is_left_to_the_scheduler(monkeypatch):
    """Three CPUs for a team of two (no engine_cpus on a bigger node): nothing is pinned, since other
    processes may load any of them and the scheduler may move a thread off a loaded one."""
    import ricllm.kernels.team as team_module

    calls = []
    monkeypatch.setattr(team_module.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(team_module.os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    monkeypatch.setattr(team_module, "library", lambda: pytest.fail("the team's workers were pinned"))
    with PinnedTeam(2).computing():
        pass
    assert calls == []
