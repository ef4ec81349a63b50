"""Deadline-aware admission on a deterministic clock with a fake step time: no wall-clock flakiness.

The model still runs (the tiny random one), but each step advances the engine's clock by a
known function of what the step carried, so predictions and outcomes are exact.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from ricllm import LLM, SamplingParams
from ricllm.config import AdmissionSettings, EngineConfig
from ricllm.engine.latency_model import LatencyModel, runs_op_by_op
from ricllm.engine.llm_engine import LLMEngine
from ricllm.engine.runtime.capabilities import C_KERNEL_LIMITS
from ricllm.engine.scheduler import StepFeatures
from ricllm.errors import InvalidRequestError
from ricllm.sequence import Sequence

COEFFICIENTS = [0.010, 0.0002, 0.002, 1e-6, 0.0]  # a, per prefill token, per decode seq, per context token, Q


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def true_step_time(features, slowdown: float = 1.0) -> float:
    a, b, c, d, _ = COEFFICIENTS
    return slowdown * (a + b * features.num_prefill_tokens + c * features.num_decode_seqs
                       + d * features.num_context_tokens)


def heavy_step_time(features, slowdown: float = 1.0) -> float:
    """Not the model's own form: a step that runs op by op costs three times the linear fit, as such
    steps did on CPUs before the fit had a term for them."""
    return true_step_time(features, slowdown) * (3.0 if runs_op_by_op(features, C_KERNEL_LIMITS) else 1.0)


def make_engine(tiny_gguf, slowdown=lambda: 1.0, step_time=true_step_time, **overrides) -> tuple[LLMEngine, FakeClock]:
    clock = FakeClock()
    admission = dict(policy="deadline", safety_margin=0.0)
    admission.update({name: overrides.pop(name) for name in list(overrides) if name in AdmissionSettings.model_fields})
    settings = dict(model=str(tiny_gguf), dtype="float32", kv_cache_budget=64 * 16 * 512, block_size=16,
                    max_num_batched_tokens=64, admission=admission)
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(**settings), clock=clock, latency_model=LatencyModel(list(COEFFICIENTS)))
    real_run = engine.runtime.runner.run

    def timed_run(batch, *allowed):
        result = real_run(batch, *allowed)
        clock.now += step_time(batch.features(), slowdown())
        return result

    engine.runtime.runner.run = timed_run
    return engine, clock


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


def run_arrivals(engine, clock, arrivals) -> list:
    """Event-driven: the engine steps until the next arrival time, idles only when it has no work."""
    outputs = []
    for arrival, token_ids, params in arrivals:
        while engine.has_unfinished() and clock.now < arrival:
            outputs += engine.step()
        clock.now = max(clock.now, arrival)
        engine.add_request(token_ids, params)
    return outputs + drain(engine)


def poisson_arrivals(rng, count, mean_gap_s, start, make):
    t, arrivals = start, []
    for i in range(count):
        t += rng.expovariate(1 / mean_gap_s)
        arrivals.append((t, *make(i)))
    return arrivals


def drain(engine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_infeasible_deadline_is_rejected_at_arrival_with_numbers(tiny_gguf):
    engine, _ = make_engine(tiny_gguf)
    seq = engine.add_request(prompt(20, 1), SamplingParams(max_tokens=10, deadline_ms=30, ignore_eos=True))
    assert seq.finish_reason == "rejected" and seq.rejection.code == "DEADLINE_INFEASIBLE"
    numbers = seq.rejection.numbers
    assert numbers["bound_ms"] > numbers["deadline_ms"] == 30
    assert "finish bound of it is" in seq.rejection.message and "> 30.0 ms" in seq.rejection.message
    [out] = drain(engine)
    assert not out.admitted and out.deadline_met is None and out.rejection.code == "DEADLINE_INFEASIBLE"


def test_kv_budget_and_context_rejections(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, max_model_len=256)
    too_long = engine.add_request(prompt(250, 2), SamplingParams(max_tokens=10, deadline_ms=10_000))
    assert too_long.rejection.code == "CONTEXT_TOO_LONG" and too_long.rejection.numbers["max_model_len"] == 256
    big = engine.add_request(prompt(200, 3), SamplingParams(max_tokens=50, deadline_ms=100_000, ignore_eos=True))
    assert big.promised  # 16 blocks of 64
    rejected = [engine.add_request(prompt(200, 10 + i), SamplingParams(max_tokens=50, deadline_ms=100_000))
                for i in range(4)]
    assert [r.rejection is None for r in rejected] == [True, True, True, False]
    assert rejected[-1].rejection.code == "KV_RESERVED"  # for the present load: it fits once one finishes
    assert rejected[-1].rejection.numbers == {"blocks_needed": 16, "blocks_free": 0, "blocks_reserved": 64}


@pytest.mark.parametrize("seed", range(26, 30))
def test_the_engine_never_builds_an_empty_step_while_requests_wait(tiny_gguf, seed):
    """Arrivals faster than a small budget (24 or 40 blocks, 3 to 12 seats) serves, a third best
    effort. A best-effort sequence that cannot grow within the blocks nobody reserved preempts
    itself; when it was all the step carried, the waiting requests are seated in its place (with
    seed 29 the engine raised "could not schedule any request" instead)."""
    rng = random.Random(seed)
    engine, clock = make_engine(tiny_gguf, max_num_seqs=rng.choice([3, 6, 12]),
                                kv_cache_budget=rng.choice([24, 40]) * 16 * 512)
    arrivals = poisson_arrivals(rng, 150, rng.choice([0.005, 0.01, 0.03]), clock.now, lambda i: (
        prompt(rng.randint(5, 120), 1000 * seed + i),
        SamplingParams(max_tokens=rng.randint(2, 24), deadline_ms=rng.choice([150, 400, 2000, 6000]), ignore_eos=True,
                       priority=rng.choice(["near_rt", "non_rt", "best_effort"]))))
    outputs = run_arrivals(engine, clock, arrivals)
    assert len(outputs) == 150 and engine.admission.reserved_blocks == 0


def test_a_prompt_that_fills_the_token_budget_is_bounded_with_the_decodes_beside_it(tiny_gguf):
    """Two requests decode; a third's 63-token prompt would fill one 64-token step alone, but the
    decodes take two tokens of every step's budget, so its prefill needs two steps. Its bound
    counts them: it finishes within it (with step times of the model's own form, no margin). Random
    load found a 150 ms promise kept by 142 ms bounds finishing at 150.4 and 152.5 ms."""
    engine, clock = make_engine(tiny_gguf)
    decoding = [engine.add_request(prompt(10, 70 + i), SamplingParams(max_tokens=30, deadline_ms=60_000,
                                                                      ignore_eos=True)) for i in range(2)]
    engine.step()
    assert all(s.num_computed_tokens >= s.num_prompt_tokens for s in decoding)
    filling = engine.add_request(prompt(63, 72), SamplingParams(max_tokens=3, deadline_ms=60_000, ignore_eos=True))
    assert filling.promised
    drain(engine)
    assert filling.finish_time <= filling.predicted_finish


def test_reservations_never_oversubscribe_and_admitted_requests_are_never_late(tiny_gguf):
    engine, clock = make_engine(tiny_gguf)
    rng = random.Random(7)
    original_step = engine.step

    def checked_step():
        finished = original_step()
        assert engine.admission.reserved_blocks <= engine.kv_cache.geometry.num_blocks
        assert all(len(s.block_table) <= s.reserved_blocks for s in engine.admission.admitted.values())
        return finished

    engine.step = checked_step
    arrivals = poisson_arrivals(rng, 120, 0.01, clock.now, lambda i: (
        prompt(rng.randint(5, 120), 100 + i),
        SamplingParams(max_tokens=rng.randint(4, 24), deadline_ms=rng.choice([150, 400, 2000]), ignore_eos=True)))
    outputs = run_arrivals(engine, clock, arrivals)  # ~100 requests/s: far beyond capacity
    admitted = [o for o in outputs if o.admitted]
    assert len(outputs) == 120 and 0 < len(admitted) < 120
    assert all(o.deadline_met for o in admitted), [o.request_id for o in admitted if not o.deadline_met]
    snap = engine.snapshot()
    assert (snap.deadlines_met, snap.deadlines_missed, snap.deadlines_ended_early) == (len(admitted), 0, 0)
    assert engine.snapshot().kv_cache.preemptions == 0


def test_earliest_deadline_first(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, max_num_batched_tokens=32)
    deadlines = [5000, 3000, 1000]  # arrive latest-deadline first
    seqs = [engine.add_request(prompt(60, i), SamplingParams(max_tokens=4, deadline_ms=d, ignore_eos=True))
            for i, d in enumerate(deadlines)]
    drain(engine)
    by_first_token = sorted(seqs, key=lambda s: s.first_token_time)
    assert [s.params.deadline_ms for s in by_first_token] == [1000, 3000, 5000]


def test_best_effort_waits_in_a_bounded_queue(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, max_queue=2, max_num_seqs=1)
    seqs = [engine.add_request(prompt(10, i), SamplingParams(max_tokens=3)) for i in range(4)]
    assert [s.rejection.code if s.rejection else None for s in seqs] == [None, None, "QUEUE_FULL", "QUEUE_FULL"]
    assert seqs[2].rejection.numbers == {"waiting": 2, "max_queue": 2}
    outputs = drain(engine)
    assert sorted(o.finish_reason for o in outputs) == ["length", "length", "rejected", "rejected"]


@pytest.mark.parametrize("drift", [1.3, 3.0])
def test_drift_is_caught_online_and_misses_are_counted(tiny_gguf, drift):
    """Misses while the correction catches up are counted and reported on their outputs (at 3x
    there must be some); requests that arrive after it caught up all meet their deadline."""
    slow = {"factor": 1.0}
    engine, clock = make_engine(tiny_gguf, slowdown=lambda: slow["factor"])
    rng = random.Random(3)
    arrivals = poisson_arrivals(rng, 200, 0.03, clock.now, lambda i: (
        prompt(rng.randint(5, 60), 500 + i),
        SamplingParams(max_tokens=rng.randint(4, 16), deadline_ms=rng.choice([200, 600]), ignore_eos=True)))
    drift_at = arrivals[60][0]
    original_step = engine.step

    def drifting_step():
        if clock.now >= drift_at:
            slow["factor"] = drift  # the machine gets slower than the fit
        return original_step()

    engine.step = drifting_step
    with capture_logs() as logs:
        outputs = run_arrivals(engine, clock, arrivals)
    assert engine.admission.latency.multipliers == pytest.approx({"decode": drift, "prefill": drift}, rel=0.02)
    slowdowns = [e for e in logs if e["event"] == "sustained_slowdown"]
    assert len(slowdowns) == 1 and slowdowns[0]["step_multiplier"] >= 1.25  # said once, with the number
    late = [o for o in outputs if o.admitted and not o.deadline_met]
    assert engine.snapshot().deadlines_missed == len(late)  # counted, not hidden
    if drift > 2:
        assert late, "a 3x slowdown must make some admitted requests late"
    caught_up = arrivals[90][0]
    after = [o for o, (t, _, _) in zip(sorted(outputs, key=lambda o: int(o.request_id)), arrivals)
             if o.admitted and t >= caught_up]
    assert after and all(o.deadline_met for o in after)
    summary = engine.admission.latency.error_summary()
    assert summary["steps"] > 0 and summary["median_abs_error"] < 0.05


def test_llm_generate_with_admission_returns_rejections_in_order(tiny_gguf, tmp_path):
    fit = tmp_path / "fit.json"
    LatencyModel(list(COEFFICIENTS)).save(fit)
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_budget="8MiB", admission="deadline", latency_fit=str(fit))
    outs = llm.generate([prompt(10, 1), prompt(10, 2), prompt(10, 3)], [
        SamplingParams(max_tokens=4, deadline_ms=60_000, ignore_eos=True),
        SamplingParams(max_tokens=4, deadline_ms=0.5),
        SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [o.finish_reason for o in outs] == ["length", "rejected", "length"]
    assert outs[0].admitted and outs[0].deadline_met is True and outs[0].queue_s is not None
    assert outs[1].rejection.code == "DEADLINE_INFEASIBLE" and outs[1].token_ids == []
    assert outs[2].deadline_met is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(deadline_ms=0), "deadline_ms must be > 0"),
    (dict(deadline_ms=-5), "deadline_ms must be > 0"),
    (dict(deadline_ms="soon"), "deadline_ms must be a number"),
    (dict(deadline_ms=100, priority="urgent"), "unknown priority 'urgent'"),
    (dict(priority="near_rt"), "priority 'near_rt' needs a deadline_ms"),
])
def test_bad_deadline_input(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_caps_and_stats_are_computed_from_the_model(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, tightest_deadline_ms=500, tightest_deadline_tokens=16)
    caps = {row["context"]: row for row in engine.caps}
    # 64 blocks of 16 tokens: at context 128 each request holds ceil(144/16) = 9 blocks -> 7 fit
    assert caps[128]["max_batch_memory"] == 7
    assert 0 < caps[128]["max_batch"] <= 7 and caps[256]["max_batch"] <= caps[128]["max_batch"]
    # the batch found meets the deadline by the bound, one more does not (or memory stops it)
    from ricllm.engine.admission import Work, finish_bounds
    latency, budget = engine.admission.latency, engine.admission.token_budget
    best = caps[128]["max_batch"]
    assert finish_bounds([Work(0.5, 128, 16, 144)] * best, latency, budget, 0.0)[-1] <= 0.5
    if best < 7:
        assert finish_bounds([Work(0.5, 128, 16, 144)] * (best + 1), latency, budget, 0.0)[-1] > 0.5
    engine.add_request(prompt(10, 1), SamplingParams(max_tokens=4, deadline_ms=1, ignore_eos=True))
    drain(engine)
    stats = engine.snapshot()
    assert stats.rejected == {"DEADLINE_INFEASIBLE": 1}
    assert (stats.deadlines_met, stats.deadlines_missed, stats.deadlines_ended_early) == (0, 0, 0)


def test_calibration_sweep_is_bounded_cached_and_loadable(tiny_gguf, tmp_path, monkeypatch):
    import time

    from ricllm.engine import calibration

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    started = time.perf_counter()
    first = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", admission="deadline"))
    assert time.perf_counter() - started < 30
    fits = list((tmp_path / "latency").glob("*.json"))
    assert len(fits) == 1
    stored = LatencyModel.load(fits[0])
    assert stored.coefficients == first.admission.latency.coefficients and stored.roofline is not None
    # the fit's residuals per kind, and the steps measured after a pause: where the error model starts
    assert len(stored.residuals["after_idle"]) == calibration.AFTER_IDLE_PAUSES
    assert len(stored.residuals["decode"]) > 20 and stored.residuals["prefill"]
    assert stored.residuals == first.admission.latency.residuals
    assert first.snapshot().kv_cache.prefix_cache_queries_tokens == 0  # sweep counters reset
    monkeypatch.setattr(calibration, "calibrate", lambda engine, budget_s=20: pytest.fail("recalibrated"))
    second = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", admission="deadline"))
    assert second.admission.latency.coefficients == stored.coefficients
    given = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", admission="deadline",
                                   latency_fit=str(fits[0])))
    assert given.admission.latency.coefficients == stored.coefficients


def test_a_fit_is_not_reused_after_the_kernels_or_the_packing_change(tiny_gguf, monkeypatch):
    from ricllm.kernels import cpu_library

    from ricllm.engine import calibration

    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32"))
    assert engine.runtime.attention_backend == "cpu"
    key = calibration.fit_key(engine)
    assert key["kernels"] == cpu_library.library_identity()
    monkeypatch.setattr(cpu_library, "library_identity", lambda compiler=None: "edited kernels")
    assert calibration.fit_key(engine) != key
    monkeypatch.undo()
    engine.config.max_packed_rows = 16
    assert calibration.fit_key(engine) != key


def test_the_fit_separates_the_costs_of_steps_run_op_by_op():
    """A step past the CPU kernel's limits pays a fixed cost and dearer prefill tokens and attention
    of its own; the fit finds all three apart from the small chunks' costs."""
    from ricllm.engine.latency_model import FEATURES, feature_vector, fit, runs_op_by_op

    truth = [0.004, 2e-5, 3e-4, 1e-7, 1e-9, 0.006, 4e-4, 2e-8, 5e-5, 3e-6, 1e-5]  # op by op: 6 ms more, dearer tokens
    # each decode samples a head row, and so does each step whose prefill chunk ends its prompt
    samples = [StepFeatures(p, d, c, p * c // 2, head_rows=d + (p > 0)) for p in (0, 8, 16, 48, 64, 128, 256)
               for d in (0, 1, 4, 16) for c in (64, 512, 2048) if p or d]
    assert {runs_op_by_op(f, C_KERNEL_LIMITS) for f in samples} == {True, False}
    assert not runs_op_by_op(StepFeatures(0, 32, 4096), C_KERNEL_LIMITS)
    assert runs_op_by_op(StepFeatures(256, 0, 256, 256 * 128), C_KERNEL_LIMITS)
    model = fit([(f, float(feature_vector(f, C_KERNEL_LIMITS) @ truth)) for f in samples],
                kernel_limits=C_KERNEL_LIMITS)
    fitted = dict(zip(FEATURES, model.coefficients))
    assert fitted["op_by_op_step"] == pytest.approx(0.006, rel=0.02)
    # a token's price in the one call (b + x) and op by op (b + g); b alone is either's share
    assert fitted["prefill_tokens"] + fitted["kernel_prefill_tokens"] == pytest.approx(3e-5, rel=0.05)
    assert fitted["prefill_tokens"] + fitted["op_by_op_prefill_tokens"] == pytest.approx(4.2e-4, rel=0.02)
    assert fitted["head_rows"] == pytest.approx(5e-5, rel=0.05)
    assert fitted["op_by_op_context_tokens"] == pytest.approx(3e-6, rel=0.05)
    older = LatencyModel.from_json({"coefficients": truth[:5]})  # a fit saved before the terms existed
    assert older.coefficients == truth[:5] + [0.0] * 6
    with pytest.raises(ValueError, match="12 coefficients, but the model has 11 terms"):
        LatencyModel(truth + [1.0])


def test_unreadable_latency_fit_is_a_clear_error(tiny_gguf, tmp_path):
    from ricllm.errors import ConfigError

    bad = tmp_path / "fit.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read latency fit"):
        LLMEngine(EngineConfig(model=str(tiny_gguf), admission="deadline", latency_fit=str(bad)))


def test_pinned_prefix_is_not_charged_as_prefill(tiny_gguf):
    from ricllm.cache.kv_cache_manager import PinHandle
    from ricllm.engine.admission import work_of

    engine, _ = make_engine(tiny_gguf)
    template = prompt(96, 40)
    handle = PinHandle(handle_id=1, token_ids=template)
    engine.add_request(template, SamplingParams(max_tokens=1, ignore_eos=True, deadline_ms=60_000),
                       pin_on_finish=handle)
    drain(engine)
    assert len(handle.block_ids) == 6
    seq = engine.add_request(template + prompt(10, 41), SamplingParams(max_tokens=4, deadline_ms=60_000))
    assert seq.pinned_prefix_tokens == 96 and work_of(seq).prefill_left == 10


def test_a_cached_prefix_is_credited_at_admission_and_held_until_the_request_runs(tiny_gguf):
    """A prompt whose leading blocks an earlier request left in the prefix cache (not pinned) is
    planned with only its uncached tail as prefill; before it runs, allocations that take every free
    block (and so evict every cached block nobody holds) leave its prefix alone, so the plan holds."""
    from ricllm.engine.admission import work_of

    engine, _ = make_engine(tiny_gguf)
    shared = prompt(96, 50)
    engine.add_request(shared + prompt(4, 51), SamplingParams(max_tokens=1, ignore_eos=True))
    drain(engine)
    seq = engine.add_request(shared + prompt(10, 52), SamplingParams(max_tokens=4, deadline_ms=60_000))
    assert seq.promised and seq.pinned_prefix_tokens == 0 and work_of(seq).prefill_left == 10
    pool = engine.cache.pool
    taken = [pool.allocate() for _ in range(pool.num_free)]
    for block in taken:
        pool.release(block)
    engine.step_history.clear()
    [out] = drain(engine)
    assert out.num_cached_tokens == 96 and engine.step_history[0].features.num_prefill_tokens == 10


def test_a_burst_of_one_prompt_prefills_it_once_for_the_requests_still_waiting(tiny_gguf):
    """Cells at the same levels send the same prompt at once. Admitted requests that hold their cached
    prefix from arrival take what the first one computes as soon as it is cached, so they prefill
    only the last, partial block, and answer what the first answers."""
    from ricllm.engine.admission import work_of

    engine, _ = make_engine(tiny_gguf, max_num_batched_tokens=40)
    shared = prompt(96, 53)
    engine.add_request(shared + prompt(4, 54), SamplingParams(max_tokens=1, ignore_eos=True))
    drain(engine)
    same = shared + prompt(40, 55)  # 136 tokens: 8 full blocks of 16, the 6 shared ones cached
    params = SamplingParams(max_tokens=3, deadline_ms=60_000, ignore_eos=True)
    burst = [engine.add_request(same, params) for _ in range(3)]
    assert all(seq.promised and work_of(seq).prefill_left == 40 for seq in burst)
    engine.step_history.clear()
    engine.step()
    assert [work_of(seq).prefill_left for seq in burst[1:]] == [8, 8]
    done = {o.request_id: o for o in drain(engine)}
    first, *others = (done[seq.request_id] for seq in burst)
    assert [h.features.num_prefill_tokens for h in list(engine.step_history)[:2]] == [40, 16]
    assert first.num_cached_tokens == 96 and [o.num_cached_tokens for o in others] == [128, 128]
    assert all(o.token_ids == first.token_ids and o.deadline_met for o in others)


def test_a_later_admission_re_promises_the_earlier_request_with_its_work_beside_it(tiny_gguf):
    """A request due sooner, admitted after another, runs ahead of it: the earlier one's bound as
    last promised takes that work in, and its finish keeps within it where the bound at its own
    arrival could not know of it."""
    engine, clock = make_engine(tiny_gguf)
    first = engine.add_request(prompt(40, 60), SamplingParams(max_tokens=8, deadline_ms=10_000, ignore_eos=True))
    sooner = engine.add_request(prompt(40, 61), SamplingParams(max_tokens=8, deadline_ms=5_000, ignore_eos=True))
    assert first.promised and sooner.promised
    assert first.promised_finish > first.predicted_finish and sooner.promised_finish == sooner.predicted_finish
    done = {o.request_id: o for o in drain(engine)}
    late = done[first.request_id]
    assert late.e2e_s > late.predicted_e2e_s and late.e2e_s <= late.promised_e2e_s


def test_a_request_an_idle_engine_serves_in_one_step_holds_no_stall_reserve():
    """The stall reserve is room for a busy step to run late; a request whose only step is the
    first after an idle gap is charged that step's after-idle multiplier instead, and one more step
    brings the reserve back."""
    from ricllm.engine.admission import Work, finish_bounds

    model = LatencyModel([0.010, 0.0, 0.0, 0.0, 0.0, 0.0])
    model.keep_overruns(64, 0.05)
    model.observe(StepFeatures(0, 1, 10), 0.040)  # one busy step 30 ms past its bound
    for _ in range(20):
        model.observe(StepFeatures(6, 0, 6), 0.015, after_idle=True)  # first steps after a gap: 1.5x their fit
    assert model.stall_reserve == pytest.approx(0.030) and model.after_idle_multiplier == pytest.approx(1.5)
    assert model.step_multiplier == pytest.approx(1.0)
    one_step, two_steps = Work(1.0, 6, 1, 20), Work(1.0, 6, 2, 20)
    [idle_one] = finish_bounds([one_step], model, 64, 0.0, after_idle=True)
    [idle_two] = finish_bounds([two_steps], model, 64, 0.0, after_idle=True)
    [busy_one] = finish_bounds([one_step], model, 64, 0.0)
    assert idle_one == pytest.approx(1.5 * 0.010)
    assert idle_two == pytest.approx(1.5 * 0.010 + 0.010 + 0.030)
    assert busy_one == pytest.approx(0.010 + 0.030)


def test_an_idle_engine_that_refuses_measures_probe_steps_and_follows_the_machine(tiny_gguf):
    """Probes measure what a step after a gap costs on the machine now, the after-idle multiplier:
    1 at the fit's speed, 1.5 at 1.5x. A burst of stalled busy steps that made the engine
    refuse is forgotten within 2 s, though no busy step runs, and probes never move it."""
    for factor in (1.0, 1.5):
        engine, clock = make_engine(tiny_gguf, slowdown=lambda factor=factor: factor)
        latency = engine.admission.latency
        for _ in range(8):
            latency.observe(_decode_features(), 1.0)  # a burst of stalled steps, then the machine settles
        inflated = latency.multiplier("decode")
        for i in range(60):
            clock.now += 0.1  # idle time passes between refusals
            engine.add_request(prompt(10, 60 + i), SamplingParams(max_tokens=4, deadline_ms=20))
        assert engine.snapshot().steps >= 40  # each refusal, at most every 50 ms, measured one probe step
        probe = engine.step_history[-1].features
        assert probe.num_prefill_tokens == 1
        assert latency.after_idle_multiplier == pytest.approx(factor)
        assert latency.multipliers == {"decode": 1.0, "prefill": 1.0} and inflated > 50


def _decode_features():
    from ricllm.engine.scheduler import StepFeatures

    return StepFeatures(0, 1, 20, 0)


def _long_prompt_among_running_decodes(tiny_gguf, long_deadline_ms: float, **overrides):
    """Four deadline requests decoding, then a 400-token prompt arrives: ``(pace, step)`` for each
    step while all four decode, where pace is the tightest ``(deadline − now) / tokens left`` at its start."""
    engine, clock = make_engine(tiny_gguf, max_num_batched_tokens=512, kv_cache_budget=256 * 16 * 512,
                                **overrides)
    streams = [engine.add_request(prompt(8, 70 + i), SamplingParams(max_tokens=40, deadline_ms=2000,
                                                                     ignore_eos=True)) for i in range(4)]
    for _ in range(3):
        engine.step()
    long = engine.add_request(prompt(400, 80), SamplingParams(max_tokens=4, deadline_ms=long_deadline_ms,
                                                              ignore_eos=True))
    assert long.promised and all(s.promised for s in streams)
    paced_steps = []
    while engine.has_unfinished():
        decoding = [s for s in streams if not s.is_finished]
        pace = min((s.deadline - clock.now) / (40 - s.num_output_tokens) for s in decoding) if decoding else None
        outputs = engine.step()
        assert all(o.deadline_met for o in outputs)
        if len(decoding) == 4:
            paced_steps.append((pace, engine.step_history[-1]))
    return paced_steps


def test_prefill_is_paced_so_running_decodes_keep_their_deadline_pace(tiny_gguf):
    paced = _long_prompt_among_running_decodes(tiny_gguf, 10_000)
    unpaced = _long_prompt_among_running_decodes(tiny_gguf, 10_000, pace_prefill=False)
    # unpaced, the 400-token prompt is one step of 10 + 0.2·400 + 2·4 ms and more: all four streams stall
    assert [r.features.num_prefill_tokens for _, r in unpaced if r.features.num_prefill_tokens] == [400]
    [(pace, step)] = [(pace, r) for pace, r in unpaced if r.features.num_prefill_tokens]
    assert step.duration_s > 0.098 > pace
    # paced: the prompt is spread over several steps, each within the tightest pace (~52 ms)
    chunks = [r.features.num_prefill_tokens for _, r in paced if r.features.num_prefill_tokens]
    assert len(chunks) >= 3 and sum(chunks) == 400
    assert all(r.duration_s <= pace for pace, r in paced)


def test_pacing_never_breaks_a_promise(tiny_gguf):
    """The long prompt's own deadline leaves no room for small chunks: it gets the full budget."""
    steps = _long_prompt_among_running_decodes(tiny_gguf, 185)
    assert max(r.features.num_prefill_tokens for _, r in steps) == 400


def test_pace_cap_is_the_largest_prefill_within_the_tightest_pace(tiny_gguf):
    engine, clock = make_engine(tiny_gguf, max_num_batched_tokens=512)
    seq = engine.add_request(prompt(8, 90), SamplingParams(max_tokens=11, deadline_ms=500, ignore_eos=True))
    engine.step()  # prefill; now it decodes with 10 tokens left and 500 − 11.6 ms to go
    gate = engine.admission
    first = Sequence(request_id="x", token_ids=prompt(300, 91), num_prompt_tokens=300, params=SamplingParams(),
                     arrival_time=clock.now)
    cap = gate.prefill_token_cap(clock.now, [seq], first, 512)
    pace = (seq.deadline - clock.now) / 10
    step = lambda p: true_step_time(StepFeatures(p, 1, seq.num_computed_tokens + 1 + p, p * p))  # noqa: E731
    assert step(cap) <= pace < step(cap + 1)
    assert gate.stats()["paced_steps"] == 1
    gate.config.pace_prefill = False
    assert gate.prefill_token_cap(clock.now, [seq], first, 512) == 512


def _largest_admitted_max_tokens(tiny_gguf, token_ids, deadline_ms, **overrides) -> int:
    """What a plain (non-degrading) engine admits, found one max_tokens at a time."""
    for tokens in range(60, 0, -1):
        engine, _ = make_engine(tiny_gguf, **overrides)
        seq = engine.add_request(token_ids, SamplingParams(max_tokens=tokens, deadline_ms=deadline_ms))
        if seq.rejection is None:
            return tokens
    return 0


def test_degrade_admits_with_the_largest_max_tokens_that_meets_the_deadline(tiny_gguf):
    token_ids = prompt(20, 95)
    fits = _largest_admitted_max_tokens(tiny_gguf, token_ids, 150)
    assert 1 <= fits < 60
    engine, _ = make_engine(tiny_gguf, degrade=True)
    asked = SamplingParams(max_tokens=60, deadline_ms=150, ignore_eos=True)
    seq = engine.add_request(token_ids, asked)
    assert seq.rejection is None and seq.promised
    d = seq.degradation
    assert (d.code, d.requested_max_tokens, d.granted_max_tokens) == ("DEADLINE_INFEASIBLE", 60, fits)
    assert d.message.startswith(f"max_tokens 60 -> {fits}: finish bound of it is")
    assert asked.max_tokens == 60  # the caller's params are not changed (they may be shared)
    [out] = drain(engine)
    assert out.admitted and out.deadline_met and out.finish_reason == "length"
    assert len(out.token_ids) == fits and out.degradation == d
    assert engine.snapshot().degraded == 1 and engine.snapshot().rejected == {}


def test_degrade_shrinks_to_the_context_and_the_kv_budget(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, max_model_len=256, degrade=True)
    long = engine.add_request(prompt(250, 96), SamplingParams(max_tokens=10, deadline_ms=100_000))
    assert (long.degradation.code, long.degradation.granted_max_tokens) == ("CONTEXT_TOO_LONG", 6)
    drain(engine)
    engine, _ = make_engine(tiny_gguf, degrade=True)  # 64 blocks of 16
    for i in range(3):  # 256 tokens = 16 blocks each
        held = engine.add_request(prompt(200, 97 + i), SamplingParams(max_tokens=56, deadline_ms=100_000))
        assert held.promised and held.degradation is None
    last = engine.add_request(prompt(100, 198), SamplingParams(max_tokens=200, deadline_ms=100_000))
    assert last.degradation.code == "KV_RESERVED"
    assert last.degradation.granted_max_tokens == 16 * 16 - 100  # the 16 blocks left, less the prompt
    assert last.degradation.numbers == {"blocks_needed": 19, "blocks_free": 16, "blocks_reserved": 48}
    assert engine.admission.reserved_blocks == 64


def test_degrade_still_rejects_what_no_length_can_save(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, degrade=True)
    seq = engine.add_request(prompt(20, 99), SamplingParams(max_tokens=8, deadline_ms=5))
    assert seq.rejection.code == "DEADLINE_INFEASIBLE" and seq.degradation is None
    assert seq.params.max_tokens == 8 and "8 decode steps to run" in seq.rejection.message
    best_effort = [engine.add_request(prompt(10, 100 + i), SamplingParams(max_tokens=3)) for i in range(300)]
    assert best_effort[-1].rejection.code == "QUEUE_FULL"  # not a matter of length: never degraded


def test_degrade_never_grants_fewer_tokens_than_a_whole_constrained_answer(tiny_gguf):
    token_ids = prompt(20, 95)
    fits = _largest_admitted_max_tokens(tiny_gguf, token_ids, 150)
    longer = {"choice": ["x" * (fits + 5), "y" * (fits + 5)]}  # one token per letter in the tiny vocabulary
    engine, _ = make_engine(tiny_gguf, degrade=True)
    compiled = engine.compile_structured(longer)
    assert compiled.min_tokens == fits + 5
    # every letter a decode step, as if the grammar forced nothing (here it forces all after the first)
    longer_grammar = replace(compiled, max_decisions=None)
    shorter = {"choice": ["x" * (fits - 2), "y" * (fits - 2)]}
    shorter_grammar = replace(engine.compile_structured(shorter), max_decisions=None)
    seq = engine.add_request(token_ids, SamplingParams(max_tokens=60, deadline_ms=150, structured=longer),
                             grammar=longer_grammar)
    assert seq.rejection is not None and seq.rejection.code == "DEADLINE_INFEASIBLE" and seq.degradation is None
    seq = engine.add_request(token_ids, SamplingParams(max_tokens=60, deadline_ms=150, structured=shorter),
                             grammar=shorter_grammar)
    assert seq.rejection is None and seq.degradation is None  # the answer's own bound fits: nothing to shrink
    assert seq.params.max_tokens == fits - 2  # its longest answer, the engine's way: the grammar stops after it
    [out] = [o for o in drain(engine) if o.request_id == seq.request_id]
    assert out.deadline_met and out.text in ("x" * (fits - 2), "y" * (fits - 2))


def test_the_bound_counts_the_fixed_cost_of_steps_run_op_by_op():
    from ricllm.engine.admission import Work, finish_bounds

    model = LatencyModel([0.0, 0.0, 0.0, 0.0, 0.0, 0.05], kernel_limits=C_KERNEL_LIMITS)  # only the op-by-op term
    work = Work(deadline=1.0, prefill_left=600, decode_left=3, final_context=603)
    assert model.predict(StepFeatures(600, 0, 600, 600 * 600)) == pytest.approx(0.05)
    [bound] = finish_bounds([work], model, token_budget=512, now=0.0)
    assert bound == pytest.approx(2 * 0.05)  # two prefill steps, each possibly op by op


@pytest.mark.parametrize("seed", range(5))
def test_a_near_rt_request_beside_a_large_best_effort_prompt_meets_its_deadline(tiny_gguf, seed):
    engine, _ = make_engine(tiny_gguf, step_time=heavy_step_time, max_num_batched_tokens=512)
    near = engine.add_request(prompt(64, seed), SamplingParams(max_tokens=8, deadline_ms=300, ignore_eos=True))
    bulk = engine.add_request(prompt(480, 100 + seed), SamplingParams(max_tokens=8, ignore_eos=True))
    outputs = {o.request_id: o for o in drain(engine)}
    assert near.promised and outputs[near.request_id].deadline_met
    assert outputs[bulk.request_id].finish_reason == "length"  # best effort is still served, around the promise


def test_best_effort_pauses_when_a_slowdown_puts_an_admitted_request_at_risk(tiny_gguf):
    """Admitted beside 20 best-effort streams at the fitted speed; then every step runs 1.4x slower.
    The bound slips past the deadline after the first slow step, and best effort sits out until it is safe."""
    slow = {"factor": 1.0}
    engine, _ = make_engine(tiny_gguf, slowdown=lambda: slow["factor"], max_num_seqs=32)
    bulk = [engine.add_request(prompt(8, 700 + i), SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(20)]
    while not all(s.in_decode for s in bulk):
        engine.step()
    near = engine.add_request(prompt(8, 7), SamplingParams(max_tokens=8, deadline_ms=560, ignore_eos=True))
    assert near.promised
    slow["factor"] = 1.4
    outputs = {o.request_id: o for o in drain(engine)}
    assert outputs[near.request_id].deadline_met
    assert engine.snapshot().best_effort_paused_steps > 0
    assert all(outputs[s.request_id].finish_reason == "length" for s in bulk)  # paused, then finished
