"""The engine's injected clock stamps every request: its arrival, first schedule, first token and
finish all read it, so a request's timings are on the one clock its deadline counts on."""

from __future__ import annotations

import ast
from pathlib import Path

from ricllm.config import EngineConfig
from ricllm.engine.llm_engine import LLMEngine
from ricllm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


class SteppingClock:
    """A clock that moves one second each time it is read: any stamp not taken from it shows."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_every_stamp_of_a_request_comes_from_the_engine_clock(tiny_gguf):
    clock = SteppingClock()
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", kv_cache_budget=64 * 16 * 512),
                       clock=clock)
    start = clock.now
    seq = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    assert start < seq.arrival_time <= clock.now
    while engine.has_unfinished():
        outputs = engine.step()
    out, = outputs
    for stamp in (seq.first_scheduled_time, seq.first_token_time, seq.finish_time):
        assert start < stamp <= clock.now
    assert out.e2e_s == seq.finish_time - seq.arrival_time and out.e2e_s >= 3  # three steps, each read the clock


def test_no_time_is_taken_beside_the_engine_clock():
    """The request and the engine modules that stamp it read no clock of their own."""
    owners = [ROOT / "ricllm" / "sequence.py", *sorted((ROOT / "ricllm" / "engine").glob("*.py"))]
    exempt = {"calibration.py", "latency_model.py"}  # measure the machine's own time, not a request's
    found = []
    for path in owners:
        if path.name in exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"perf_counter", "monotonic", "time"} \
                    and isinstance(node.value, ast.Name) and node.value.id == "time":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: time.{node.attr}")
    allowed = {"ricllm/engine/llm_engine.py"}  # the clock's default: time.perf_counter, once
    assert [f for f in found if f.split(":")[0] not in allowed] == []
    assert sum(f.startswith("ricllm/engine/llm_engine.py") for f in found) == 1
