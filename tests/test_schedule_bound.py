"""The bound that follows the schedule: it admits what only the closed form's worst sum refuses, and
it stays a bound, on a clock that is not the latency model's own form (5% slower, seeded noise).

Same deterministic clock as ``test_admission``; the scene: eight short requests due first, then a
long one. The closed form charges the long one's 60 decode steps at the batch of nine; the batch
is one from the shorts' fifth step on.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ricllm import SamplingParams
from ricllm.engine.admission import NO_BEST_EFFORT, BestEffortLoad, Work, finish_bounds, work_of
from ricllm.engine.latency_model import LatencyModel
from ricllm.engine.runtime.capabilities import C_KERNEL_LIMITS
from ricllm.engine.schedule_bound import schedule_bounds, step_counts
from tests.test_admission import COEFFICIENTS, drain, make_engine, prompt, true_step_time

SHORT = SamplingParams(max_tokens=4, deadline_ms=500, ignore_eos=True)
LONG = SamplingParams(max_tokens=60, deadline_ms=1200, ignore_eos=True)


def slower_noisy_step_time(seed: int):
    """5% slower than the fit, plus up to 4% seeded noise: inside the 10% margin the tests set."""
    rng = random.Random(seed)

    def step_time(features, slowdown: float = 1.0) -> float:
        return true_step_time(features, slowdown) * (1.05 + rng.uniform(0.0, 0.04))

    return step_time


def shorts_then_long(engine, seed: int):
    shorts = [engine.add_request(prompt(8, seed + i), SHORT) for i in range(8)]
    return shorts, engine.add_request(prompt(8, seed + 100), LONG)


def closed_form_bound(engine, seqs, now: float) -> list[float]:
    ordered = sorted(seqs, key=lambda s: (s.deadline, s.arrival_time))
    works = [work_of(s) for s in ordered]
    return finish_bounds(works, engine.admission.latency, engine.config.max_num_batched_tokens, now)


def test_a_long_request_behind_short_ones_is_admitted_and_met(tiny_gguf):
    engine, clock = make_engine(tiny_gguf, step_time=slower_noisy_step_time(3), safety_margin=0.1)
    shorts, long = shorts_then_long(engine, seed=10)
    assert closed_form_bound(engine, [*shorts, long], clock.now)[-1] * 1.1 - clock.now > 1.2  # it alone refuses
    assert long.rejection is None and long.promised
    outputs = drain(engine)
    assert len(outputs) == 9 and all(o.deadline_met for o in outputs), [(o.request_id, o.e2e_s) for o in outputs]
    by_id = {o.request_id: o for o in outputs}  # each output carries the bound it was promised against
    assert by_id[long.request_id].predicted_e2e_s == pytest.approx(long.predicted_finish - long.arrival_time)
    assert all(o.predicted_e2e_s > 0 for o in outputs)


def test_the_schedule_bound_is_never_below_the_real_finish(tiny_gguf):
    engine, clock = make_engine(tiny_gguf, step_time=slower_noisy_step_time(4), safety_margin=0.1)
    for i in range(6):  # some busy steps first: the multipliers learn this clock
        engine.add_request(prompt(30, 200 + i), SamplingParams(max_tokens=8, ignore_eos=True))
    drain(engine)
    shorts, long = shorts_then_long(engine, seed=20)
    seqs = [*shorts, long]  # EDF order: same deadline, earlier arrival first
    closed = closed_form_bound(engine, seqs, clock.now)
    planned = schedule_bounds([work_of(s) for s in seqs], engine.admission.latency,
                              engine.config.max_num_batched_tokens, clock.now, NO_BEST_EFFORT)
    assert long.promised and long.predicted_finish == planned[-1] < closed[-1]  # the schedule's, not the closed form's
    drain(engine)
    assert all(s.finish_time <= bound for s, bound in zip(seqs, planned)), \
        [(s.request_id, s.finish_time - clock.now, bound - clock.now) for s, bound in zip(seqs, planned)]


def test_the_schedule_bound_follows_the_batch_as_it_shrinks():
    """Exact arithmetic on the fit: eight 1-step requests and one of 10 steps, 8 prompt tokens each."""
    model = LatencyModel([0.010, 0.0, 0.002, 0.0, 0.0])
    works = [Work(1.0, 8, 1, 9, f"s{i}") for i in range(8)] + [Work(2.0, 8, 10, 18, "long")]
    bounds = schedule_bounds(works, model, 64, 0.0, NO_BEST_EFFORT)
    # step 1: 64 prefill tokens (8 sequences), whose end samples each short's one token: they leave;
    # step 2: the long one's prefill alone, which samples its first token; then 9 decode steps alone
    first, alone = 0.010 + 0.002 * 8, 0.010 + 0.002
    assert bounds[:8] == pytest.approx([first] * 8)
    assert bounds[-1] == pytest.approx(first + 10 * alone)
    assert bounds[-1] < finish_bounds(works, model, 64, 0.0)[-1]


def test_a_waiting_request_due_first_still_waits_for_the_running_prefills():
    """The scheduler serves running prefills before it seats a waiting request, whatever their
    deadlines: an 11-token request due in 40 ms beside a 60-token prefill already running takes two
    64-token steps, not one (a random load found a promise the closed form put at one step missed)."""
    works = [Work(0.04, 11, 1, 60, "urgent"), Work(2.0, 60, 10, 100, "running", running=True)]
    assert step_counts(works, 64) == [(2, 2), (1, 10)]
    assert step_counts([replace(works[0], running=True), works[1]], 64) == [(1, 1), (2, 11)]


def test_the_schedule_bound_charges_best_effort_on_every_step():
    model = LatencyModel(list(COEFFICIENTS))
    works = [Work(1.0, 16, 20, 36, "a")]
    alone = schedule_bounds(works, model, 64, 0.0, NO_BEST_EFFORT)[0]
    beside = schedule_bounds(works, model, 64, 0.0, BestEffortLoad(3, 3000, 500), best_effort_chunk=32)[0]
    per_step = COEFFICIENTS[2] * 3 + COEFFICIENTS[3] * 3000 + COEFFICIENTS[1] * 32
    assert beside - alone == pytest.approx(20 * per_step, rel=0.01)  # a prefill step (the first token), 19 decodes


def test_prefill_waits_while_decodes_take_the_whole_budget():
    """Decodes are served first: with as many decoding sequences as budget tokens, no prefill runs
    until they leave; with best effort decoding beside them for ever, it never runs."""
    model = LatencyModel(list(COEFFICIENTS))
    works = [Work(1.0, 0, 1000, 1010, f"d{i}") for i in range(8)] + [Work(2.0, 8, 4, 12, "p")]
    bounds = schedule_bounds(works, model, 8, 0.0, NO_BEST_EFFORT)
    assert bounds[-1] > max(bounds[:8]) + 4 * COEFFICIENTS[0]  # its prefill step (its first token), 3 decodes after
    assert schedule_bounds(works[-1:], model, 8, 0.0, BestEffortLoad(8, 800))[0] == float("inf")


def test_a_small_chunk_is_charged_the_c_kernels_costs_and_a_large_one_the_op_by_op_terms():
    """A prompt's tail behind its template (8 tokens at 700 positions) runs in the CPU kernel's one
    C call; 200 tokens pass its limits and run op by op, at the fixed cost and dearer tokens the
    fit gives such steps. Both bounds, the closed form and the schedule's, charge each its own."""
    model = LatencyModel([0.0, 1e-4, 0.0, 0.0, 0.0, 0.01, 1e-3, 0.0], kernel_limits=C_KERNEL_LIMITS)
    small, large = [Work(1.0, 8, 1, 700, "small")], [Work(1.0, 200, 1, 700, "large")]
    for bound in (finish_bounds, lambda w, m, b, t: schedule_bounds(w, m, b, t, NO_BEST_EFFORT)):
        assert bound(small, model, 512, 0.0) == pytest.approx([8 * 1e-4])
        assert bound(large, model, 512, 0.0) == pytest.approx([200 * (1e-4 + 1e-3) + 0.01])


def test_a_prompt_rides_on_the_weights_the_roofline_reads():
    """A step's time is the larger of its terms and the roofline (its weights read once): a lone
    prompt's one step is charged that, not the roofline plus the prompt, by both bounds; and a
    prompt split over several steps is still charged at least what its steps take."""
    from ricllm.engine.latency_model import Roofline
    from ricllm.engine.scheduler import StepFeatures

    model = LatencyModel([0.004, 0.0005], roofline=Roofline(8e6, 0.0, 1e9))  # 4 ms + 0.5 ms a token; 8 ms floor
    for tokens in (4, 12, 40):
        one_step = [Work(deadline=1.0, prefill_left=tokens, decode_left=1, final_context=tokens + 1)]
        fitted = model.base(StepFeatures(tokens, 0, tokens))
        assert fitted == pytest.approx(max(0.004 + 0.0005 * tokens, 0.008))
        assert finish_bounds(one_step, model, 64, 0.0) == pytest.approx([fitted])
        assert schedule_bounds(one_step, model, 64, 0.0, NO_BEST_EFFORT) == pytest.approx([fitted])
    chunked = [Work(deadline=1.0, prefill_left=40, decode_left=1, final_context=41)]  # 16 + 16 + 8 tokens
    steps = sum(model.base(StepFeatures(n, 0, 0)) for n in (16, 16, 8))  # 12 + 12 + 8 ms
    for bound in (finish_bounds(chunked, model, 16, 0.0), schedule_bounds(chunked, model, 16, 0.0, NO_BEST_EFFORT)):
        assert steps <= bound[0] <= steps + 0.008 + 1e-12  # the floor's room is taken off once, not per step
