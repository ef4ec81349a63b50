"""Keeping every promise: queue policies without promises, priority, rescue, ending early, and
admission on a clock that is not the latency model's own form (noise, overhead, a slower machine).

Same deterministic clock as ``test_admission``: each step advances it by a function of what the
step carried, chosen so the holes these tests guard against could make them fail.
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace

import pytest

from ricllm import SamplingParams
from ricllm.engine.admission import BestEffortLoad, Work, finish_bounds
from ricllm.engine.latency_model import LatencyModel
from ricllm.engine.runtime.capabilities import C_KERNEL_LIMITS
from ricllm.engine.scheduler import StepFeatures
from tests.test_admission import (
    drain,
    make_engine,
    poisson_arrivals,
    prompt,
    run_arrivals,
    true_step_time,
)


def noisy_step_time(seed: int):
    """Not the model's form: per-step noise (lognormal, 8%), 1 ms of Python overhead, and one step in 50
    twice as long."""
    rng = random.Random(seed)

    def step_time(features, slowdown: float = 1.0) -> float:
        tail = 2.0 if rng.random() < 0.02 else 1.0
        return true_step_time(features, slowdown) * rng.lognormvariate(0.0, 0.08) * tail + 0.001 * slowdown

    return step_time


def record_sequences(engine) -> dict:
    """Every sequence ``engine.add_request`` makes from now on, by request id."""
    seqs = {}
    add = engine.add_request

    def recording_add(*args, **kwargs):
        seq = add(*args, **kwargs)
        seqs[seq.request_id] = seq
        return seq

    engine.add_request = recording_add
    return seqs


# ---------------------------------------------------------------- baselines: queues without promises

def test_fcfs_serves_in_arrival_order_and_bounds_every_queued_request(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, policy="fcfs", max_queue=2, max_num_seqs=1, max_num_batched_tokens=32)
    deadlines = [5000, 3000, 1000, 800]
    seqs = [engine.add_request(prompt(40, i), SamplingParams(max_tokens=3, deadline_ms=d, ignore_eos=True))
            for i, d in enumerate(deadlines)]
    assert [s.rejection.code if s.rejection else None for s in seqs] == [None, None, "QUEUE_FULL", "QUEUE_FULL"]
    assert "2 requests already wait (max_queue 2)" in seqs[2].rejection.message
    assert not any(s.promised for s in seqs)  # fcfs queues, it does not promise
    drain(engine)
    served = [s for s in seqs if s.rejection is None]
    assert sorted(served, key=lambda s: s.first_token_time) == served  # first come, first served


def test_edf_queues_without_admission_and_serves_earliest_deadline_first(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, policy="edf", max_num_batched_tokens=32)
    seqs = [engine.add_request(prompt(60, i), SamplingParams(max_tokens=4, deadline_ms=d, ignore_eos=True))
            for i, d in enumerate([5000, 3000, 1])]  # 1 ms can never be met: edf queues it anyway
    assert all(s.rejection is None and not s.promised for s in seqs)
    outputs = {o.request_id: o for o in drain(engine)}
    assert [s.params.deadline_ms for s in sorted(seqs, key=lambda s: s.first_token_time)] == [1, 3000, 5000]
    assert outputs[seqs[2].request_id].deadline_met is False


def test_abort_drops_requests_already_late_waiting_or_running(tiny_gguf):
    engine, _ = make_engine(tiny_gguf, policy="fcfs", on_late="abort", max_num_seqs=1)
    first = engine.add_request(prompt(10, 1), SamplingParams(max_tokens=40, deadline_ms=150, ignore_eos=True))
    second = engine.add_request(prompt(10, 2), SamplingParams(max_tokens=4, deadline_ms=100, ignore_eos=True))
    outputs = {o.request_id: o for o in drain(engine)}
    for seq in (first, second):
        out = outputs[seq.request_id]
        assert out.finish_reason == "deadline" and out.deadline_met is False
    assert len(outputs[first.request_id].token_ids) < 40 and outputs[second.request_id].token_ids == []
    assert engine.snapshot().deadlines_missed == 2


# ---------------------------------------------------------------- priority is an input

def test_a_best_effort_priority_with_a_deadline_is_served_but_never_promised(tiny_gguf):
    engine, _ = make_engine(tiny_gguf)
    low = engine.add_request(prompt(10, 1), SamplingParams(max_tokens=4, deadline_ms=1, priority="best_effort",
                                                          ignore_eos=True))
    high = engine.add_request(prompt(10, 2), SamplingParams(max_tokens=4, deadline_ms=900, ignore_eos=True))
    assert low.rejection is None and not low.promised and low.reserved_blocks == 0  # no promise, no refusal
    assert high.promised and high.params.priority == "near_rt"
    outputs = {o.request_id: o for o in drain(engine)}
    assert outputs[low.request_id].finish_reason == "length" and outputs[high.request_id].deadline_met


def test_rescue_pauses_the_fewest_best_effort_lowest_priority_first(tiny_gguf):
    """A slowdown puts an admitted request at risk beside best effort; the rescue pauses only some of
    the best effort, the plain best-effort requests (newest first) before the ones with a deadline."""
    slow = {"factor": 1.0}
    engine, _ = make_engine(tiny_gguf, slowdown=lambda: slow["factor"], max_num_seqs=32)
    with_deadline = [engine.add_request(prompt(8, 800 + i), SamplingParams(
        max_tokens=60, deadline_ms=60_000, priority="best_effort", ignore_eos=True)) for i in range(4)]
    plain = [engine.add_request(prompt(8, 700 + i), SamplingParams(max_tokens=60, ignore_eos=True))
             for i in range(16)]
    while not all(s.in_decode for s in with_deadline + plain):
        engine.step()
    near = engine.add_request(prompt(8, 7), SamplingParams(max_tokens=8, deadline_ms=560, ignore_eos=True))
    assert near.promised
    slow["factor"] = 1.4
    engine.step()  # the first slow step is measured: the correction rises
    rescue = engine.admission.rescue(engine.clock(), engine.scheduler._running_best_effort())
    assert rescue is not None and 0 < len(rescue.paused) < 20
    paused = set(map(id, rescue.paused))
    assert not any(id(s) in paused for s in with_deadline) or all(id(s) in paused for s in plain)
    assert [s.arrival_time for s in rescue.paused] == sorted((s.arrival_time for s in rescue.paused), reverse=True)
    outputs = {o.request_id: o for o in drain(engine)}
    assert outputs[near.request_id].deadline_met
    assert all(outputs[s.request_id].finish_reason == "length" for s in with_deadline + plain)


def test_when_pausing_is_not_enough_only_the_request_at_risk_prefills(tiny_gguf):
    slow = {"factor": 1.0}
    engine, clock = make_engine(tiny_gguf, slowdown=lambda: slow["factor"], max_num_batched_tokens=64)
    urgent = engine.add_request(prompt(120, 1), SamplingParams(max_tokens=4, deadline_ms=250, ignore_eos=True))
    later = engine.add_request(prompt(120, 2), SamplingParams(max_tokens=4, deadline_ms=5000, ignore_eos=True))
    assert urgent.promised and later.promised
    slow["factor"] = 3.0
    engine.step()  # a 3x step: the bound of `urgent` passes its deadline
    rescue = engine.admission.rescue(clock.now, [])
    assert rescue is not None and rescue.paused == [] and rescue.prefill_until == urgent.deadline
    batch = engine.scheduler.schedule(clock.now)
    assert [s for s, _ in batch.items] == [urgent]  # `later` waits a step: its deadline is far
    assert engine.snapshot().rescue_prefill_steps == 1


# ---------------------------------------------------------------- ending early, by policy

def test_end_early_answers_on_time_with_what_it_has_and_counts_it(tiny_gguf):
    slow = {"factor": 1.0}
    engine, _ = make_engine(tiny_gguf, slowdown=lambda: slow["factor"], on_late="end_early")
    seq = engine.add_request(prompt(10, 1), SamplingParams(max_tokens=30, deadline_ms=400, ignore_eos=True))
    assert seq.promised
    engine.step()
    slow["factor"] = 4.0  # far slower than any margin
    [out] = drain(engine)
    assert out.finish_reason == "deadline" and out.deadline_met is False
    assert 0 < len(out.token_ids) < 30 and out.e2e_s <= 0.4  # on time, with the tokens it had
    snap = engine.snapshot()
    assert (snap.deadlines_met, snap.deadlines_missed, snap.deadlines_ended_early) == (0, 0, 1)


def test_without_end_early_the_same_request_is_late_and_counted_missed(tiny_gguf):
    slow = {"factor": 1.0}
    engine, _ = make_engine(tiny_gguf, slowdown=lambda: slow["factor"])
    engine.add_request(prompt(10, 1), SamplingParams(max_tokens=30, deadline_ms=400, ignore_eos=True))
    engine.step()
    slow["factor"] = 4.0
    [out] = drain(engine)
    assert out.finish_reason == "length" and out.deadline_met is False and out.e2e_s > 0.4
    assert engine.snapshot().deadlines_missed == 1


# ---------------------------------------------------------------- the bound

def test_the_bound_charges_best_effort_at_its_own_context():
    model = LatencyModel([0.0, 0.0, 0.0, 1e-5, 0.0])  # only context is charged
    work = Work(deadline=1.0, prefill_left=0, decode_left=10, final_context=100)
    short = finish_bounds([work], model, 512, 0.0, best_effort=BestEffortLoad(1, 100))[0]
    long = finish_bounds([work], model, 512, 0.0, best_effort=BestEffortLoad(1, 8000))[0]
    assert short == pytest.approx(10 * 1e-5 * 200) and long == pytest.approx(10 * 1e-5 * 8100)


def test_best_effort_prefill_is_charged_only_while_some_may_come_and_at_its_size():
    # prefill tokens and attention work only
    model = LatencyModel([0.0, 1e-4, 0.0, 0.0, 1e-7], kernel_limits=C_KERNEL_LIMITS)
    work = Work(deadline=1.0, prefill_left=0, decode_left=10, final_context=100)

    def bound(load):
        return finish_bounds([work], model, 512, 0.0, best_effort=load, best_effort_chunk=32)[0]

    assert bound(BestEffortLoad(2, 800, longest_pending=0)) == 0.0  # decoding only: no chunk comes
    assert bound(BestEffortLoad(2, 800, longest_pending=300)) == pytest.approx(10 * (32e-4 + 32 * 300 * 1e-7))
    capped = bound(BestEffortLoad(2, 8000, longest_pending=4000))  # 32 x 4000 > the C kernel's work
    assert capped == pytest.approx(10 * (32e-4 + 64 * 512 * 1e-7))


def test_a_near_rt_request_beside_long_best_effort_contexts_meets_its_deadline(tiny_gguf):
    """Best-effort decodes at 480-token contexts make every step read far more K/V than the admitted
    request's own 80 tokens: the bound must charge them at their contexts."""
    heavy_context = [0.004, 0.0001, 0.001, 1e-5, 0.0]

    def step_time(features, slowdown=1.0):
        a, b, c, d, _ = heavy_context
        return a + b * features.num_prefill_tokens + c * features.num_decode_seqs + d * features.num_context_tokens

    engine, _ = make_engine(tiny_gguf, step_time=step_time, max_num_seqs=16, max_num_batched_tokens=512,
                            kv_cache_budget=512 * 16 * 512)  # 512 blocks
    engine.admission.latency = LatencyModel(list(heavy_context))
    bulk = [engine.add_request(prompt(440, 900 + i), SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(6)]
    while not all(s.in_decode for s in bulk):
        engine.step()
    near = [engine.add_request(prompt(64, i), SamplingParams(max_tokens=4, deadline_ms=d, ignore_eos=True))
            for i, d in enumerate([150, 250, 400])]  # 150 ms passes if best effort is charged at 80 tokens
    outputs = {o.request_id: o for o in drain(engine)}
    admitted = [s for s in near if s.promised]
    assert admitted and all(outputs[s.request_id].deadline_met for s in admitted)


# ---------------------------------------------------------------- drift on a clock that is not the model

def test_a_slowdown_after_calibration_misses_only_inside_the_detector_window(tiny_gguf):
    """Noisy steps (not the fit's form), near-RT requests and best-effort bulk; from the middle of the
    run every step takes 1.5x. Requests admitted once the detector fired all meet their deadline; the
    misses are among those admitted before it, while the machine was already slower, and are few."""
    slow = {"factor": 1.0}
    engine, clock = make_engine(tiny_gguf, slowdown=lambda: slow["factor"], step_time=noisy_step_time(5),
                                safety_margin=0.1, max_num_seqs=32)
    rng = random.Random(9)

    def request(i):
        if i % 4 == 3:
            return prompt(rng.randint(100, 300), 2000 + i), SamplingParams(max_tokens=30, ignore_eos=True)
        return prompt(rng.randint(10, 60), 1000 + i), SamplingParams(
            max_tokens=rng.randint(2, 6), deadline_ms=rng.choice([150, 300, 500]), ignore_eos=True)

    arrivals = poisson_arrivals(rng, 240, 0.06, clock.now, request)
    slow_from = arrivals[120][0]
    original_step = engine.step

    def drifting_step():
        if clock.now >= slow_from:
            slow["factor"] = 1.5
        return original_step()

    engine.step = drifting_step
    seqs_by_id = record_sequences(engine)
    outputs = run_arrivals(engine, clock, arrivals)
    detected = [e.time for e in engine.snapshot().slowdowns if e.slow]
    assert detected and detected[0] >= slow_from  # said once the steps were slower, not before
    reacted = detected[0]
    promised = [o for o in outputs if seqs_by_id[o.request_id].promised]
    after = [o for o in promised if seqs_by_id[o.request_id].arrival_time >= reacted]
    in_window = [o for o in promised if seqs_by_id[o.request_id].arrival_time < reacted
                 and seqs_by_id[o.request_id].finish_time >= slow_from]
    assert len(after) > 25 and all(o.deadline_met for o in after)
    before = [o for o in promised if o not in in_window and o not in after]
    assert before and all(o.deadline_met for o in before)  # noise and overhead alone break no promise
    misses = [o for o in in_window if not o.deadline_met]
    assert len(misses) <= 3 and engine.snapshot().deadlines_missed == len(misses)
    assert reacted - slow_from < 2.0  # about half the detector's 64-step window of slowed steps (~40 ms each)


@pytest.mark.parametrize("fit_bias", [0.66, 1.0, 1.3])
def test_the_detector_reads_slower_than_lately_whatever_the_fit_bias(fit_bias):
    """A fit calibrated on a busier (0.66) or quieter (1.3) moment must neither hide a 1.5x slowdown
    nor fire on its own; one that lasts most of the horizon becomes the new normal."""
    from ricllm.engine.slowdown import SlowdownDetector

    detector = SlowdownDetector(window=64, horizon=1000)
    rng = random.Random(4)
    changes = []
    for step in range(2000):
        slow = 1.5 if step >= 400 else 1.0
        if (change := detector.observe(fit_bias * slow * rng.lognormvariate(0, 0.1))) is not None:
            changes.append((step, change))
    assert changes[0][1] is True and 400 <= changes[0][0] <= 440  # past half a window of slowed steps
    assert changes[1][1] is False and 1100 <= changes[1][0] <= 1300  # ~0.8 of the horizon on: the new normal
    assert len(changes) == 2


def test_the_detector_does_not_take_a_changing_mix_of_steps_for_a_slowdown():
    """The fit is off by different factors for different steps (here: decode steps 1.0, mixed steps
    1.2); traffic that swings between them every few hundred steps is not a slowdown."""
    from ricllm.engine.slowdown import SlowdownDetector

    detector = SlowdownDetector()
    rng = random.Random(6)
    changes = []
    for step in range(4000):
        mixed_share = 0.8 if (step // 300) % 2 else 0.1
        bias = 1.2 if rng.random() < mixed_share else 1.0
        if (change := detector.observe(bias * rng.lognormvariate(0, 0.1))) is not None:
            changes.append((step, change))
    assert changes == []


def test_a_promise_takes_the_seat_of_best_effort_when_the_batch_is_full(tiny_gguf):
    """Seats (max_num_seqs) full of best effort: the admitted request takes one (a best-effort
    sequence is preempted, newest first) instead of waiting past its deadline."""
    engine, _ = make_engine(tiny_gguf, max_num_seqs=2)
    bulk = [engine.add_request(prompt(8, 600 + i), SamplingParams(max_tokens=200, ignore_eos=True)) for i in range(2)]
    while not all(s.in_decode for s in bulk):
        engine.step()
    near = engine.add_request(prompt(8, 9), SamplingParams(max_tokens=4, deadline_ms=200, ignore_eos=True))
    assert near.promised
    engine.step()
    assert near in engine.scheduler.running and len(engine.scheduler.running) == 2
    assert engine.scheduler.num_preemptions == 1 and any(s in engine.scheduler.waiting for s in bulk)
    outputs = {o.request_id: o for o in drain(engine)}
    assert outputs[near.request_id].deadline_met
    assert all(outputs[s.request_id].finish_reason == "length" for s in bulk)


# ---------------------------------------------------------------- one stalled step

def stalling_step_time(stalled: list, every: int = 20, stall_s: float = 0.03):
    """The fit's own form, except that one step in ``every`` stalls ``stall_s`` longer (a neighbour's
    burst, a page fault): the correction, a quantile over 32 steps, does not see it. Each stall's
    step number goes to ``stalled``."""
    steps = {"n": 0}

    def step_time(features, slowdown: float = 1.0) -> float:
        steps["n"] += 1
        if steps["n"] % every != every // 2:
            return true_step_time(features, slowdown)
        stalled.append(steps["n"])
        return true_step_time(features, slowdown) + stall_s

    return step_time


def short_requests_with_stalls(tiny_gguf, stall_reserve_steps: int, mean_gap_s: float = 0.01,
                               deadline_ms: float = 80):
    """Near-RT requests of two to four tokens (a few steps each, 80 ms deadlines); returns the
    promised outputs that arrived after the first stall was measured, and the engine."""
    stalled = []
    engine, clock = make_engine(tiny_gguf, step_time=stalling_step_time(stalled), safety_margin=0.1,
                                max_num_seqs=16, stall_reserve_steps=stall_reserve_steps)
    rng = random.Random(3)
    arrivals = poisson_arrivals(rng, 300, mean_gap_s, clock.now, lambda i: (
        prompt(rng.randint(8, 40), 500 + i),
        SamplingParams(max_tokens=rng.randint(2, 4), deadline_ms=deadline_ms, ignore_eos=True)))
    seqs = record_sequences(engine)
    first_stall = {}
    step = engine.step

    def watching_step():
        out = step()
        if stalled and "at" not in first_stall:
            first_stall["at"] = clock.now
        return out

    engine.step = watching_step
    outputs = run_arrivals(engine, clock, arrivals)
    after = [o for o in outputs if seqs[o.request_id].promised and seqs[o.request_id].arrival_time > first_stall["at"]]
    return after, engine


def test_one_stalled_step_breaks_no_promise_once_a_stall_was_seen(tiny_gguf):
    after, engine = short_requests_with_stalls(tiny_gguf, stall_reserve_steps=1024)
    assert len(after) > 30 and all(o.deadline_met for o in after)
    assert engine.admission.latency.stall_reserve == pytest.approx(0.03, rel=0.05)


def test_without_the_stall_reserve_the_same_stalls_break_promises(tiny_gguf):
    after, _ = short_requests_with_stalls(tiny_gguf, stall_reserve_steps=0)
    assert sum(1 for o in after if not o.deadline_met) >= 3


def test_the_bound_holds_the_worst_recent_overrun_once():
    model = LatencyModel([0.01, 0.0, 0.0, 0.0, 0.0])
    work = [Work(deadline=1.0, prefill_left=0, decode_left=3, final_context=10)]
    for measured in (0.01, 0.04, 0.01):  # the second step runs 30 ms past its prediction
        model.observe(StepFeatures(0, 1, 10), measured)
    # one slow step of three is the reserve's, not the multiplier's (which 32 values, the fit's among them, set)
    assert model.multiplier("decode") == 1.0 and model.stall_reserve == pytest.approx(0.03)
    assert finish_bounds(work, model, 64, now=0.0)[0] == pytest.approx(3 * 0.01 + 0.03)
    model.keep_overruns(0, cap_s=0.05)
    assert finish_bounds(work, model, 64, now=0.0)[0] == pytest.approx(3 * 0.01)


def requests_among_slow_steps(tiny_gguf, share: float) -> list:
    """Near-RT requests of two to four tokens on a clock whose every seventh step runs 1.35 times its
    time, from the first step: no stall is ever seen before one comes (the stall reserve is off).
    The promised outputs."""
    steps = {"n": 0}

    def step_time(features, slowdown: float = 1.0) -> float:
        steps["n"] += 1
        return true_step_time(features, slowdown) * (1.35 if steps["n"] % 7 == 3 else 1.0)

    engine, clock = make_engine(tiny_gguf, step_time=step_time, max_num_seqs=16, stall_reserve_steps=0,
                                stall_reserve_share=share)
    rng = random.Random(5)
    arrivals = poisson_arrivals(rng, 300, 0.01, clock.now, lambda i: (
        prompt(rng.randint(8, 40), 700 + i),
        SamplingParams(max_tokens=rng.randint(2, 4), deadline_ms=60, ignore_eos=True)))
    seqs = record_sequences(engine)
    return [o for o in run_arrivals(engine, clock, arrivals) if seqs[o.request_id].promised]


def test_a_step_a_third_slow_breaks_no_promise_though_none_was_seen_before(tiny_gguf):
    """A share of each request's mean step is reserved whatever the steps so far did: the first slow
    step is as covered as the hundredth."""
    promised = requests_among_slow_steps(tiny_gguf, share=0.4)
    assert len(promised) > 60 and all(o.deadline_met for o in promised)
    without = requests_among_slow_steps(tiny_gguf, share=0.0)
    assert sum(1 for o in without if not o.deadline_met) >= 3


def test_the_bound_reserves_a_share_of_its_mean_step():
    model = LatencyModel([0.4, 0.0, 0.0, 0.0, 0.0])  # 400 ms steps, none seen overrunning
    work = [Work(deadline=5.0, prefill_left=0, decode_left=3, final_context=10)]
    model.keep_overruns(1024, cap_s=0.05, share=0.4)
    assert model.stall_reserve == 0.0
    assert finish_bounds(work, model, 64, now=0.0)[0] == pytest.approx(3 * 0.4 + 0.4 * 0.4)
    model.keep_overruns(1024, cap_s=0.05, share=0.0)
    assert finish_bounds(work, model, 64, now=0.0)[0] == pytest.approx(3 * 0.4)


def test_building_an_engine_takes_its_objects_out_of_the_garbage_collectors_walk(tiny_gguf):
    """A full collection between two steps walks every tracked object (93 ms in bench_admission, past
    a 100 ms deadline): the engine freezes what exists once it is built, the model included."""
    gc.unfreeze()
    engine, _ = make_engine(tiny_gguf)
    assert gc.get_freeze_count() > 10_000
    assert all(engine.runtime not in gc.get_objects(generation=g) for g in range(3))  # frozen: no generation holds it


# ---------------------------------------------------------------- a constrained answer's plan

ACTION = {"json": {"type": "object", "properties": {"action": {"enum": ["offload", "hold", "restore", "escalate"]}},
                   "required": ["action"], "additionalProperties": False}}


def test_a_constrained_answer_is_planned_by_its_decisions_not_its_longest_answer(tiny_gguf):
    """One decode step per token the grammar lets the model choose: the forced rest rides along.
    Planned by its longest answer (every token a step) the same request is refused; planned by its
    decisions it is admitted, and the fake clock (which charges forced tokens as prefill) confirms it."""
    engine, _ = make_engine(tiny_gguf)
    compiled = engine.compile_structured(ACTION)
    assert compiled.max_decisions is not None and compiled.max_decisions * 4 <= compiled.max_tokens
    params = SamplingParams(max_tokens=64, deadline_ms=100, structured=ACTION, temperature=1.0, seed=1)
    seq = engine.add_request(prompt(20, 1), params)
    assert seq.promised
    [out] = drain(engine)
    assert out.deadline_met and out.finish_reason == "stop"
    refused = engine.add_request(prompt(20, 2), params, grammar=replace(compiled, max_decisions=None))
    assert refused.rejection.code == "DEADLINE_INFEASIBLE"
    steps = refused.rejection.numbers["decode_steps"]  # every answer token after the forced start
    assert steps >= 3 * compiled.max_decisions and f"{steps} decode steps to run" in refused.rejection.message


def test_a_stall_longer_than_the_cap_is_not_reserved_for_every_request():
    """Five seconds lost once is the machine taken away: reserving it would refuse every request
    for the whole window; the reserve stops at ``stall_reserve_max_ms``."""
    model = LatencyModel([0.01, 0.0, 0.0, 0.0, 0.0])
    model.keep_overruns(1024, cap_s=0.05)
    model.observe(StepFeatures(0, 1, 10), 5.01)
    assert model.stall_reserve == 0.05


def test_the_reserve_forgets_a_stall_once_it_leaves_the_window():
    model = LatencyModel([0.01, 0.0, 0.0, 0.0, 0.0], quantile=0.0)  # the fastest ratio: the fit (1.0) stays put
    model.keep_overruns(4, cap_s=1.0)
    for measured in (0.03, 0.01, 0.015, 0.01):  # 20 ms, then 5 ms past the prediction
        model.observe(StepFeatures(0, 1, 10), measured)
        assert model.multiplier("decode") == 1.0  # only the overruns move
    assert model.stall_reserve == pytest.approx(0.02)
    model.observe(StepFeatures(0, 1, 10), 0.01)  # the 20 ms stall leaves the four-step window
    assert model.stall_reserve == pytest.approx(0.005)


def test_a_promise_seated_by_preempting_best_effort_takes_it_out_of_the_step(tiny_gguf):
    """Three best-effort decodes hold all but one block; a promised request then needs three. The
    step seats the promise by preempting best effort it had already scheduled: that sequence
    leaves the step (its blocks are gone, so its K/V has nowhere to go), the promise is served at
    once and meets its deadline, and every best-effort answer is the one it gives without the promise."""
    def bulk_requests(engine):
        return [engine.add_request(prompt(330, 300 + i), SamplingParams(max_tokens=6, ignore_eos=True))
                for i in range(3)]

    alone, _ = make_engine(tiny_gguf, max_num_batched_tokens=1024)
    bulk_requests(alone)
    expected = sorted(o.token_ids for o in drain(alone))
    engine, _ = make_engine(tiny_gguf, max_num_batched_tokens=1024)  # the three prompts prefill in one step
    assert engine.kv_cache.geometry.num_blocks == 64
    bulk = bulk_requests(engine)
    while not all(s.in_decode for s in bulk):
        engine.step()
    assert engine.cache.pool.num_free <= 1
    promise = engine.add_request(prompt(40, 310), SamplingParams(max_tokens=2, deadline_ms=60_000, ignore_eos=True))
    assert promise.promised
    outputs = engine.step()
    assert promise.num_computed_tokens == 40 and engine.scheduler.num_preemptions >= 1
    outputs += drain(engine)
    done = {o.request_id: o for o in outputs}
    assert done[promise.request_id].deadline_met
    assert sorted(done[s.request_id].token_ids for s in bulk) == expected  # no K/V written where it must not be
