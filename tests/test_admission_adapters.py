"""Admission knows what LoRA adapters cost: a step's rows under adapters read their weights, and
the bound charges those reads, so a promise made to a request under an adapter holds on a clock
where adapted rows cost extra. Without the term the same bounds fall short of the finish.

The clock is the deterministic one of ``test_admission`` plus an adapter cost that is not the
latency model's own form: per adapted row, not per block of four, with a fixed share per adapter.
"""

from __future__ import annotations

import pytest

from ricllm import LoRARequest, SamplingParams
from ricllm.engine.scheduler import ScheduledBatch
from tests.lora_adapters import write_lora_adapter
from tests.test_admission import drain, make_engine, prompt, true_step_time

ROW_S, PER_ADAPTER_S = 0.002, 0.002  # the clock's: each adapted row, and each adapter in the step
BLOCK_S = 4 * ROW_S + PER_ADAPTER_S  # the model's: one read of up to four rows (a slower read than the clock's)


def step_time_with_adapters(batch: ScheduledBatch) -> float:
    rows = [(seq.adapter.slot, n) for seq, n in batch.items if seq.adapter is not None]
    return true_step_time(batch.features()) + ROW_S * sum(n for _, n in rows) + PER_ADAPTER_S * len({s for s, _ in rows})


@pytest.fixture
def engine_with_adapters(tiny_gguf, tmp_path):
    engine, clock = make_engine(tiny_gguf, max_loras=2, step_time=lambda f, s=1.0: 0.0)
    real_run = engine.runtime.runner.run

    def timed_run(batch, *allowed):
        result = real_run(batch, *allowed)
        clock.now += step_time_with_adapters(batch)
        return result

    engine.runtime.runner.run = timed_run
    for name, seed in (("congestion", 1), ("energy", 2)):
        engine.loras.add(name, write_lora_adapter(tmp_path / name, engine.spec, rank=4, seed=seed))
    return engine, clock


def admit_burst(engine, block_s: float) -> list:
    engine.admission.latency.adapter_block_s = block_s
    names = ["congestion", "energy", None]
    params = SamplingParams(max_tokens=12, deadline_ms=5000, ignore_eos=True)
    seqs = [engine.add_request(prompt(24, i), params,
                               lora_request=LoRARequest(names[i % 3]) if names[i % 3] else None) for i in range(9)]
    assert all(s.promised for s in seqs)
    return seqs


def test_bounds_under_adapters_hold_when_the_adapter_term_is_known(engine_with_adapters):
    engine, _ = engine_with_adapters
    seqs = admit_burst(engine, BLOCK_S)
    drain(engine)
    assert all(s.finish_time <= s.promised_finish for s in seqs), \
        [(s.request_id, s.finish_time - s.promised_finish) for s in seqs if s.finish_time > s.promised_finish]


def test_without_the_adapter_term_the_same_bounds_fall_short(engine_with_adapters):
    engine, _ = engine_with_adapters
    seqs = admit_burst(engine, 0.0)
    drain(engine)
    assert any(s.finish_time > s.promised_finish for s in seqs)


def test_a_step_counts_its_adapter_reads_and_groups_each_adapters_rows(engine_with_adapters):
    engine, _ = engine_with_adapters
    names = ["congestion", None, "energy", "congestion", "congestion", None, "energy", "congestion", "congestion"]
    for i, name in enumerate(names):
        engine.add_request(prompt(6, 50 + i), SamplingParams(max_tokens=4, ignore_eos=True),
                           lora_request=LoRARequest(name) if name else None)
    batch = engine.scheduler.schedule(0.0)
    order = [seq.adapter.name if seq.adapter else None for seq, _ in batch.items]
    assert order == [None, None] + ["congestion"] * 5 + ["energy"] * 2 or \
        order == [None, None] + ["energy"] * 2 + ["congestion"] * 5
    rows = {name: sum(n for s, n in batch.items if s.adapter and s.adapter.name == name) for name in ("congestion", "energy")}
    assert batch.features().adapter_blocks == -(-rows["congestion"] // 4) + -(-rows["energy"] // 4)
