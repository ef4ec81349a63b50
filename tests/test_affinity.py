"""``engine_cpus``: the engine computes on the CPUs it is given, the server's other threads on the rest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ricllm.affinity import format_cpu_list, parse_cpu_list
from ricllm.config import EngineConfig
from ricllm.errors import ConfigError

ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


@pytest.mark.parametrize(("spec", "cpus"), [("0-3,6", (0, 1, 2, 3, 6)), (" 2, 0 ", (0, 2)), ("5", (5,)),
                                            ([3, 1, 3], (1, 3))])
def test_cpu_lists_read_as_the_kernel_writes_them(spec, cpus):
    assert parse_cpu_list(spec) == cpus


def test_cpu_lists_are_written_back_in_ranges():
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpu_list([4]) == "4"


@pytest.mark.parametrize(("spec", "message"), [
    ("", "engine_cpus: empty"), ("0-x", "'0-x' in '0-x' is not a CPU number or a range"),
    ("3-1", "range '3-1' runs backwards"), ([-1], "-1 is not a CPU number"), ([], "engine_cpus: empty")])
def test_a_bad_cpu_list_is_named(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_cpu_list(spec)


def test_a_cpu_beyond_the_ones_the_process_may_use_is_refused_with_those():
    beyond = len(ALLOWED)
    with pytest.raises(ConfigError) as refused:
        EngineConfig(engine_cpus=[beyond])
    assert str(refused.value) == (f"engine_cpus: {beyond} is beyond the {len(ALLOWED)} CPUs this process may run "
                                  f"on (engine_cpus counts them from 0: give numbers in "
                                  f"{format_cpu_list(range(len(ALLOWED)))}; they are CPUs "
                                  f"{format_cpu_list(ALLOWED)} here)")


@pytest.mark.parametrize(("mask", "spec", "cpus"), [
    ({12, 13, 14, 15}, "0-2", (12, 13, 14)),  # a Guaranteed pod's cpuset under the static CPU manager
    ({12, 13, 14, 15}, "3", (15,)),
    ({0, 1, 2, 3}, "1-3", (1, 2, 3)),  # every CPU of the machine: the same as absolute numbers
    ({2, 5, 7, 11}, [3, 1], (5, 11)),  # counted in sorted order, holes and all
])
def test_engine_cpus_count_within_the_affinity_mask(monkeypatch, mask, spec, cpus):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mask))
    assert EngineConfig(engine_cpus=spec).engine_cpus == cpus


def test_engine_cpus_past_the_cpuset_are_refused_with_the_cpuset(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {12, 13, 14, 15})
    with pytest.raises(ConfigError) as refused:
        EngineConfig(engine_cpus="2-5")
    assert str(refused.value) == ("engine_cpus: 4, 5 are beyond the 4 CPUs this process may run on (engine_cpus "
                                  "counts them from 0: give numbers in 0-3; they are CPUs 12-15 here)")


def test_the_service_threads_get_the_rest_of_the_cpuset(monkeypatch):
    from ricllm.affinity import other_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {12, 13, 14, 15})
    assert other_cpus(EngineConfig(engine_cpus="1-3").engine_cpus) == {12}


def test_the_cli_refuses_an_unavailable_cpu_without_a_traceback(tiny_gguf):
    beyond = len(ALLOWED)
    done = subprocess.run([sys.executable, "-m", "ricllm.cli", "generate", "hi", "--model", str(tiny_gguf),
                           "--engine-cpus", str(beyond)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"engine_cpus: {beyond} is beyond the {len(ALLOWED)} CPUs this process may run on" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_engine_thread_computes_on_its_cpus_with_a_thread_each(tiny_native_gguf):
    from ricllm.engine.async_engine import EngineThread
    from ricllm.sampling_params import SamplingParams

    before = os.sched_getaffinity(0)
    config = EngineConfig(model=str(tiny_native_gguf), kv_cache_budget="2MiB", weights="int4", runtime="native",
                          weight_cache=False, engine_cpus=str(len(ALLOWED) - 1))  # native: torch's threads untouched
    worker = EngineThread(config)
    try:
        out = worker.submit([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=60)
        assert len(out.token_ids) == 2
        assert worker.call(lambda engine: os.sched_getaffinity(0)).result(timeout=10) == {max(ALLOWED)}
        assert worker.engine.runtime.threads == 1
    finally:
        worker.stop()
    assert os.sched_getaffinity(0) == before  # the caller's thread is not moved


def test_a_descriptor_names_a_bad_cpu_list(tmp_path):
    from ricllm.config import SettingsError, load_controls_file

    path = tmp_path / "config-file.json"
    path.write_text('{"controls": {"engine_cpus": "0-x"}}')
    with pytest.raises(SettingsError, match="field 'engine_cpus'"):
        load_controls_file(path, "--config")


def test_a_scenario_names_a_bad_cpu_list():
    from pydantic import ValidationError

    from ricllm.config import EngineSettings

    assert EngineSettings.model_validate({"engine_cpus": "0-1"}).engine_cpus == "0-1"
    with pytest.raises(ValidationError, match=r"engine_cpus\n.*range '3-1' runs backwards"):
        EngineSettings.model_validate({"engine_cpus": "3-1"})
