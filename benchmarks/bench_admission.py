"""Deadline admission (ricllm) against the baselines a careful operator runs, under Poisson load.

Policies, each on its own fresh engine (same settings: 256 MiB KV, max_num_seqs 64; ricllm's steps
take up to 512 tokens and pace prefill by the deadlines, the baselines' up to ``--baseline-chunk``,
128 by default, the smaller chunk an operator picks for a 100 ms class):

- ``ricllm``: ``admission.policy: deadline``. A deadline request is admitted only if every promise
  still holds with it, else rejected at arrival; best effort waits in a queue of ``--queue``.
- ``fcfs``: first come first served in arrival order, at most ``--queue`` requests waiting
  (``QUEUE_FULL`` beyond), a request whose deadline has passed is dropped, waiting or running
  (``on_late: abort``): what a careful vLLM or llama.cpp-server operator runs.
- ``edf``: the same bounded queue and drop-late, earliest deadline first, no admission test.

The queue bound is what the engine serves within the longest deadline: the measured capacity
(requests/s, see below) x 1 s, rounded (``--queue`` sets it). A longer queue only holds requests
that will be dropped late; ricllm's best-effort queue gets the same bound.

Traffic: Poisson arrivals at 0.5, 1, 2 and 4 x the measured capacity, a fixed mix of classes:

    class   deadline   share   prompt tokens   new tokens
    rt100     100 ms     30%      16-32           2-4
    rt300     300 ms     30%      32-64           8-16
    rt1000   1000 ms     30%      64-128          24-48
    bulk     none        10%     256-512          64-128   (best effort: ~40% of generated tokens)

The 100 ms class is kept to 2-4 new tokens and short prompts: alone on an idle engine (2 cores,
SmolLM2-135M) a 16-token prompt with 4 new tokens takes ~22 ms, 8 tokens after 32 ~45 ms; the
idle times of each class are measured and printed with the results. Capacity is the request rate
the engine finishes with its batch kept full of this mix, no deadlines (the saturation rate).

Each load runs without and with a 1.5x slowdown from the middle of the arrival window on
(``ricllm.faults.slow_steps``: a deterministic step-time multiplier, reproducible; a real noisy
neighbour is ``ricllm.faults.CpuHog``). The same arrivals (seeded per load and repeat) go to every
policy, with and without the slowdown; the policy order is rotated each repeat. Each run: a fresh
engine on its own thread (fresh counters and step errors; only one engine lives at a time: two
OpenMP pools on 2 cores slow every step), ~40 warm-up steps, ``--seconds`` of arrivals, then 1.5 s
(past the longest deadline) for the deadline requests to end; what still runs then (best effort)
is cancelled. Every engine uses one latency fit, calibrated at the start of the benchmark (~20 s)
on an engine without admission, as an engine's build does: the detector compares steps with the
fit, so a fit cached on a busier (or quieter) day would move its threshold (``--cached-fit``
uses the disk cache instead). The idle latencies are measured again at the end: if they differ
much from the start, the machine was not quiet.

Reported per (load, slowdown, policy), medians over repeats with [min-max]:

- deadline goodput: deadline requests that met their deadline, per second of arrivals (as
  ``vllm bench serve --goodput`` counts it); vs best baseline: that over the best baseline's
  goodput in the same repeat (paired: same arrivals, same slowdown).
- served: deadline requests admitted (ricllm) or queued and not refused (baselines).
- the detector window (slowdown runs): from the slowdown's start to the engine's slowdown
  detector's first ``slow`` verdict after it (``engine.snapshot().slowdowns``; the run's end if it never
  fires). A request is in the window if it arrived before the verdict and was unfinished when the
  slowdown began: it was served on the speed before. Misses inside the window are counted apart
  with how late; misses outside it (every miss without slowdown) must be 0 for ricllm. A miss is
  a served deadline request that did not meet its deadline: late, or dropped late by the
  baselines (how late is then when it was dropped).
- best effort: generated tokens/s of the bulk class over the run (arrivals + 1.5 s), and bulk
  requests served / sent: what the deadline classes cost best effort.
- detector reaction: ms from the slowdown's start to the verdict (0: it already said slow), and
  the typical step time over the fit's prediction (the detector's median ratio, which must reach
  1.25) as the slowdown began and at the end of the run.

The verdict per load: ricllm's goodput >= 0.97 x the best baseline at loads <= 1x (the median of
the paired ratios), above every baseline's from 2x (medians), and no served request missed outside
the detector window.

Runtime: about (seconds + 3.5 s) per run, runs = loads x slowdowns x policies x repeats; the
defaults (15 s, 4 loads, 2 slowdowns, 3 policies, 3 repeats: 72 runs) take ~23 minutes on 2 cores,
including ~1 minute of calibration, capacity and idle-latency measurements.

    python benchmarks/bench_admission.py                       # the full benchmark, appended to RESULTS.md
    python benchmarks/bench_admission.py --seconds 4 --loads 1 --repeats 1 --no-append   # a smoke
    python benchmarks/bench_admission.py --decision-only        # decision p99, 64 in flight, 3 engines
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.results import publish
from ricllm.config import EngineConfig
from ricllm.engine.async_engine import EngineThread
from ricllm.faults import slow_steps
from ricllm.logging import configure_logging
from ricllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestClass:
    deadline_ms: float | None  # None: best effort
    prompt: tuple[int, int]  # prompt tokens, inclusive range
    tokens: tuple[int, int]  # new tokens, inclusive range
    share: float


CLASSES = {
    "rt100": RequestClass(100.0, (16, 32), (2, 4), 0.30),
    "rt300": RequestClass(300.0, (32, 64), (8, 16), 0.30),
    "rt1000": RequestClass(1000.0, (64, 128), (24, 48), 0.30),
    "bulk": RequestClass(None, (256, 512), (64, 128), 0.10),
}
LONGEST_DEADLINE_S = max(c.deadline_ms for c in CLASSES.values() if c.deadline_ms is not None) / 1000
TAIL_S = LONGEST_DEADLINE_S + 0.5  # after the arrivals: every deadline request has ended by then
SLOWDOWN_AT = 0.5  # of the arrival window
BASELINES = ("fcfs", "edf")
POLICIES = ("ricllm", *BASELINES)
PER_RUN_OVERHEAD_S = 3.5  # build, warm-up, tail, stop (for the runtime estimate)


def admission_section(policy: str, queue: int) -> dict:
    """EngineConfig's admission section for a policy with a queue bound of ``queue`` requests."""
    tightest = {"tightest_deadline_ms": 100.0, "tightest_deadline_tokens": 4}  # the caps logged at start
    if policy == "ricllm":
        return dict(policy="deadline", max_queue=queue, **tightest)
    if policy in BASELINES:
        return dict(policy=policy, max_queue=queue, on_late="abort", **tightest)
    if policy == "off":  # no admission, no latency model: for calibrating and measuring capacity
        return {"policy": "off"}
    raise ValueError(f"unknown policy {policy!r}")


# A careful operator serving a 100 ms class caps the step's prefill chunk (vLLM's advice for inter-token
# latency: a smaller max_num_batched_tokens): a 512-token prefill step alone takes ~170 ms on 2 cores.
# ricllm keeps its default 512 and paces prefill by the deadlines instead. --baseline-chunk changes it.
BASELINE_CHUNK = {"tokens": 128}


def engine_config(policy: str, queue: int, latency_fit: str | None = None) -> EngineConfig:
    chunk = BASELINE_CHUNK["tokens"] if policy in BASELINES else 512
    return EngineConfig(kv_cache_budget="256MiB", max_num_seqs=64, max_num_batched_tokens=chunk,
                        admission=admission_section(policy, queue), latency_fit=latency_fit)


# ------------------------------------------------------------------ traffic

def pick_class(rng: random.Random) -> str:
    return rng.choices(list(CLASSES), weights=[c.share for c in CLASSES.values()])[0]


def make_request(rng: random.Random, vocab: int, name: str | None = None,
                 deadlines: bool = True) -> tuple[str, list[int], SamplingParams]:
    name = name or pick_class(rng)
    c = CLASSES[name]
    prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*c.prompt))]
    params = SamplingParams(max_tokens=rng.randint(*c.tokens), ignore_eos=True,
                            deadline_ms=c.deadline_ms if deadlines else None)
    return name, prompt, params


def poisson_arrivals(rate: float, seconds: float, seed: int, vocab: int) -> list[tuple[float, str, list[int],
                                                                                       SamplingParams]]:
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < seconds:
        arrivals.append((t, *make_request(rng, vocab)))
        t += rng.expovariate(rate)
    return arrivals


# ------------------------------------------------------------------ measurements on an engine

def measure_capacity(engine, min_done: int = 96, max_seconds: float = 30.0, seed: int = 0) -> float:
    """Requests per second finished with the batch kept full of the mix, no deadlines: the saturation rate."""
    rng = random.Random(seed)

    def top_up() -> None:
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < engine.config.max_num_seqs:
            _, prompt, params = make_request(rng, engine.spec.vocab_size, deadlines=False)
            engine.add_request(prompt, params)

    top_up()
    for _ in range(8):  # the first steps (thread pool, allocations) are not the saturation rate
        engine.step()
    done, start = 0, time.perf_counter()
    while done < min_done and time.perf_counter() - start < max_seconds:
        done += len(engine.step())
        top_up()
    rate = done / (time.perf_counter() - start)
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        engine.abort(seq)
    if done == 0:
        raise SystemExit(f"no request finished in {max_seconds:.0f} s: is another process using the CPU?")
    return rate


def idle_latency_ms(engine, trials: int = 5, seed: int = 1) -> dict[str, float]:
    """Median end-to-end ms of one request of each class alone on the idle engine (no deadline)."""
    rng = random.Random(seed)
    result = {}
    for name in CLASSES:
        times = []
        for _ in range(trials):
            _, prompt, params = make_request(rng, engine.spec.vocab_size, name, deadlines=False)
            seq = engine.add_request(prompt, params)
            while not seq.is_finished:
                engine.step()
            times.append((seq.finish_time - seq.arrival_time) * 1000)
        result[name] = statistics.median(times)
    return result


def warm_up(engine, seed: int = 2) -> None:
    """~40 steps at a small batch: the thread pool starts and the step multipliers see this engine's steps."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(8):
        _, prompt, _ = make_request(rng, engine.spec.vocab_size, "rt300")
        seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()


def timed_decisions(engine) -> list[float]:
    """Wrap admission.decide to record how long each decision takes (s)."""
    times: list[float] = []
    decide = engine.admission.decide

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = decide(*args, **kwargs)
        times.append(time.perf_counter() - started)
        return result

    engine.admission.decide = timed
    return times


def decision_p99_at_full_batch(engine, trials: int = 400, seed: int = 5) -> tuple[int, float]:
    """(requests admitted, p99 decision ms) with every seat of the batch but one promised: each
    trial's request is decided against all of them, then aborted (which releases it)."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    generous = SamplingParams(max_tokens=32, deadline_ms=600_000.0, ignore_eos=True)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(64)]

    for _ in range(engine.config.max_num_seqs - 1):
        engine.add_request(prompt(), generous)
    admitted = len(engine.admission.admitted)
    times = timed_decisions(engine)
    for _ in range(trials):
        seq = engine.add_request(prompt(), generous)
        if seq.rejection is None:
            engine.abort(seq)
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        engine.abort(seq)
    return admitted, percentile(times, 0.99) * 1000


def on_engine_thread(policy: str, queue: int, task, latency_fit: str | None = None):
    """``task(engine)`` on a fresh engine's own thread."""
    worker = EngineThread(engine_config(policy, queue, latency_fit))
    try:
        return worker.call(task).result()
    finally:
        worker.stop()


# ------------------------------------------------------------------ one run

@dataclass(frozen=True)
class Outcome:
    """One request as the benchmark sees it; times in seconds on the engine clock (perf_counter)."""

    cls: str
    arrival: float
    deadline_ms: float | None
    admitted: bool
    met: bool | None
    finish: float | None  # None if rejected
    finish_reason: str
    tokens: int
    rejection: str | None = None

    @property
    def late_ms(self) -> float | None:
        if self.deadline_ms is None or self.finish is None:
            return None
        return (self.finish - self.arrival) * 1000 - self.deadline_ms


@dataclass
class Run:
    """One policy on one arrival sequence; ``start`` is the first arrival's time zero, ``slow_start``
    when the slowdown began (None without one), ``end`` when outcomes were cut."""

    outcomes: list[Outcome]
    start: float
    end: float
    seconds: float
    slow_start: float | None
    events: list[tuple[float, bool]]  # the slowdown detector's verdicts (time, slow)
    decision_ms: list[float] = field(default_factory=list)
    threads: int | None = None
    ratio_before: float | None = None  # typical measured / predicted step time as the slowdown began
    ratio_end: float | None = None  # and at the end of the run


def run_once(policy: str, queue: int, arrivals, seconds: float, slowdown: float | None,
             latency_fit: str | None = None) -> Run:
    worker = EngineThread(engine_config(policy, queue, latency_fit))
    try:
        return drive(worker, policy, arrivals, seconds, slowdown)
    finally:
        worker.stop()


def drive(worker: EngineThread, policy: str, arrivals, seconds: float, slowdown: float | None) -> Run:
    clock = time.perf_counter  # the engine's clock
    worker.call(warm_up).result()
    decisions = worker.call(timed_decisions).result() if policy == "ricllm" else []
    slowed_from = [math.inf]  # set below, once the arrivals' time zero is known
    if slowdown:
        worker.call(lambda e: slow_steps(e, lambda: slowdown if clock() >= slowed_from[0] else 1.0)).result()
    start = clock() + 0.05
    slow_start = start + SLOWDOWN_AT * seconds if slowdown else None
    slowed_from[0] = slow_start or math.inf

    def typical_ratio(engine) -> float:
        return engine.admission.latency.typical_ratio()

    sent, before = [], None
    for i, (at, name, prompt, params) in enumerate(arrivals):
        delay = start + at - clock()
        if delay > 0:
            time.sleep(delay)
        stamp = clock()
        if slow_start is not None and before is None and stamp >= slow_start:
            before = worker.call(typical_ratio)  # read between the engine's next steps
        sent.append((name, stamp, worker.submit(prompt, params, request_id=f"r{i}")))
    end = start + seconds + TAIL_S
    wait([f for _, _, f in sent], timeout=max(0.0, end - clock()))

    def cut(engine) -> tuple:  # on the engine thread: cancel what still runs
        now = clock()
        left = [engine.abort(s, "cancelled") for s in [*engine.scheduler.running, *engine.scheduler.waiting]]
        worker.requests.on_outputs(left)  # their futures get these outputs
        events = [(e.time, e.slow) for e in engine.snapshot().slowdowns]
        return now, events, engine.runtime.threads, typical_ratio(engine)

    now, events, threads, ratio_end = worker.call(cut).result()
    end = max(end, now)
    outcomes = []
    for name, stamp, future in sent:
        o = future.result()
        outcomes.append(Outcome(name, stamp, o.deadline_ms, o.admitted, o.deadline_met,
                                None if o.e2e_s is None or not o.admitted else stamp + o.e2e_s,
                                o.finish_reason, len(o.token_ids), o.rejection.code if o.rejection else None))
    return Run(outcomes, start, end, seconds, slow_start, events, [t * 1000 for t in decisions], threads,
               before.result() if before is not None else None, ratio_end)


# ------------------------------------------------------------------ the summary math (pure)

def detector_reaction(slow_start: float, events: list[tuple[float, bool]]) -> float | None:
    """When the detector said slow after the slowdown began (``slow_start`` if it already said so
    then); None if it never did."""
    before = [slow for t, slow in events if t < slow_start]
    if before and before[-1]:
        return slow_start
    return next((t for t, slow in events if slow and t >= slow_start), None)


def in_window(o: Outcome, slow_start: float, window_end: float) -> bool:
    """Arrived before the detector's verdict, still unfinished when the slowdown began."""
    return o.arrival < window_end and (o.finish is None or o.finish > slow_start)


def summarize(run: Run) -> dict:
    """Counts and rates of one run (see the module docstring for what each means)."""
    deadline = [o for o in run.outcomes if o.deadline_ms is not None]
    bulk = [o for o in run.outcomes if o.deadline_ms is None]
    served = [o for o in deadline if o.admitted]
    reaction = detector_reaction(run.slow_start, run.events) if run.slow_start is not None else None
    window_end = (reaction if reaction is not None else run.end) if run.slow_start is not None else None

    def inside(o: Outcome) -> bool:
        return window_end is not None and in_window(o, run.slow_start, window_end)

    outside = [o for o in served if not inside(o)]
    missed_in = [o for o in served if inside(o) and not o.met]
    missed_out = [o for o in outside if not o.met]
    rejected: dict[str, int] = {}
    for o in run.outcomes:
        if o.rejection:
            rejected[o.rejection] = rejected.get(o.rejection, 0) + 1
    span = run.end - run.start
    return {
        "sent": len(deadline), "served": len(served), "met": sum(1 for o in served if o.met),
        "goodput": sum(1 for o in served if o.met) / run.seconds,
        "met_outside": sum(1 for o in outside if o.met), "served_outside": len(outside),
        "missed_outside": len(missed_out),
        "misses_outside": [(o.cls, round(o.arrival - run.start, 2), round(o.late_ms, 1)) for o in missed_out],
        "worst_late_outside_ms": max((o.late_ms for o in missed_out), default=None),
        "in_window": sum(1 for o in served if inside(o)), "missed_inside": len(missed_in),
        "worst_late_inside_ms": max((o.late_ms for o in missed_in), default=None),
        "dropped": sum(1 for o in served if o.finish_reason == "deadline"),
        "bulk_sent": len(bulk), "bulk_served": sum(1 for o in bulk if o.admitted),
        "bulk_tokens_per_s": sum(o.tokens for o in bulk) / span if span > 0 else 0.0,
        "reaction_ms": (reaction - run.slow_start) * 1000 if reaction is not None else None,
        "detector_fired": reaction is not None, "rejected": rejected,
        "decision_p99_ms": percentile(run.decision_ms, 0.99) if run.decision_ms else None,
        "ratio_before": run.ratio_before, "ratio_end": run.ratio_end,
    }


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def goodput_ratios(by_policy: dict[str, float]) -> dict[str, float | None]:
    """Each policy's goodput over the best baseline's (one repeat, one configuration): None without
    a baseline; when the best baseline met nothing, inf for a policy that met some, 1 for one that did not."""
    best = max((g for p, g in by_policy.items() if p in BASELINES), default=None)
    if best is None:
        return {p: None for p in by_policy}
    if best == 0:
        return {p: math.inf if g > 0 else 1.0 for p, g in by_policy.items()}
    return {p: g / best for p, g in by_policy.items()}


def spread(values) -> tuple[float, float, float] | None:
    """(median, min, max), None if no values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def aggregate(summaries: list[dict], ratios: list[float | None]) -> dict:
    """One configuration over its repeats."""
    def med(key):
        return spread(s[key] for s in summaries)

    worst_in = [s["worst_late_inside_ms"] for s in summaries if s["worst_late_inside_ms"] is not None]
    worst_out = [s["worst_late_outside_ms"] for s in summaries if s["worst_late_outside_ms"] is not None]
    served_out = sum(s["served_outside"] for s in summaries)
    return {
        "repeats": len(summaries), "sent": med("sent"), "served": med("served"), "goodput": med("goodput"),
        "ratio": spread(ratios), "dropped": med("dropped"),
        "met_of_served_outside": sum(s["met_outside"] for s in summaries) / served_out if served_out else None,
        "missed_outside": sum(s["missed_outside"] for s in summaries),
        "misses_outside": [(f"repeat {i + 1}", *m) for i, s in enumerate(summaries) for m in s["misses_outside"]],
        "worst_late_outside_ms": max(worst_out, default=None),
        "in_window": sum(s["in_window"] for s in summaries),
        "missed_inside": sum(s["missed_inside"] for s in summaries),
        "worst_late_inside_ms": max(worst_in, default=None),
        "bulk_tokens_per_s": med("bulk_tokens_per_s"),
        "bulk_served_share": spread(100 * s["bulk_served"] / s["bulk_sent"] if s["bulk_sent"] else None
                                    for s in summaries),
        "reaction_ms": med("reaction_ms"),
        "detector_missing": sum(1 for s in summaries if not s["detector_fired"]),
        "ratio_before": med("ratio_before"), "ratio_end": med("ratio_end"),
        "decision_p99_ms": max((s["decision_p99_ms"] for s in summaries if s["decision_p99_ms"] is not None),
                               default=None),
    }


def verdict(load: float, rows: dict[str, dict]) -> tuple[bool, str]:
    """(pass, line) for ricllm at one load and slowdown setting, from ``aggregate`` rows by policy."""
    ours = rows.get("ricllm")
    if ours is None:
        return False, "ricllm not run"
    parts, ok = [], True
    ratio = ours["ratio"][0] if ours["ratio"] else None  # median over repeats of the paired ratio
    baselines = {p: r["goodput"][0] for p, r in rows.items() if p in BASELINES}
    if baselines and load <= 1:
        good = ratio >= 0.97
        parts.append(f"goodput {ratio:.2f}x best baseline (need >= 0.97): {'ok' if good else 'FAIL'}")
        ok &= good
    elif baselines and load >= 2:
        good = all(ours["goodput"][0] > g for g in baselines.values())
        against = ", ".join(f"{p} {g:.2f}" for p, g in baselines.items())
        parts.append(f"goodput {ours['goodput'][0]:.2f} req/s vs {against} (need above every baseline): "
                     f"{'ok' if good else 'FAIL'}")
        ok &= good
    elif baselines:
        parts.append(f"goodput {ratio:.2f}x best baseline")
    misses = ours["missed_outside"]
    parts.append(f"{misses} admitted misses outside the window (need 0): {'ok' if misses == 0 else 'FAIL'}")
    if misses:
        parts.append("each (repeat, class, arrival s into its run, ms late): "
                     + ", ".join(f"({r}, {c}, {t:g}, {late:g})" for r, c, t, late in ours["misses_outside"]))
    ok &= misses == 0
    return ok, "; ".join(parts)


# ------------------------------------------------------------------ the table

def fmt_spread(s: tuple[float, float, float] | None, digits: int = 2, unit: str = "") -> str:
    if s is None:
        return "-"
    median, low, high = s
    if low == high:
        return f"{median:.{digits}f}{unit}"
    return f"{median:.{digits}f}{unit} [{low:.{digits}f}-{high:.{digits}f}]"


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(rows: list[tuple[float, str, str, dict]]) -> list[str]:
    lines = [("| load | slowdown | policy | sent | served | deadline goodput (req/s) | vs best baseline | "
              "met / served outside window | misses outside window (max ms late) | "
              "in window: served, missed (max ms late) | dropped late | best effort tokens/s | "
              "best effort served | detector reaction (ms) |"),
             "|---:|---|---|---:|---:|---|---|---:|---|---|---:|---|---|---|"]
    for load, slow, policy, a in rows:
        met = f"{a['met_of_served_outside']:.1%}" if a["met_of_served_outside"] is not None else "-"
        window = ("-" if slow == "none" else
                  f"{a['in_window']}, {a['missed_inside']} ({fmt_ms(a['worst_late_inside_ms'])})")
        reaction = "-" if slow == "none" else (
            fmt_spread(a["reaction_ms"], 0) + (f", never in {a['detector_missing']}" if a["detector_missing"] else "")
            + f" (step/fit {fmt_spread(a['ratio_before'])} -> {fmt_spread(a['ratio_end'])})")
        lines.append(
            f"| {load:g}x | {slow} | {policy} | {fmt_spread(a['sent'], 0)} | {fmt_spread(a['served'], 0)} | "
            f"{fmt_spread(a['goodput'])} | {fmt_spread(a['ratio'])} | {met} | "
            f"{a['missed_outside']} ({fmt_ms(a['worst_late_outside_ms'])}) | {window} | "
            f"{fmt_spread(a['dropped'], 0)} | {fmt_spread(a['bulk_tokens_per_s'], 0)} | "
            f"{fmt_spread(a['bulk_served_share'], 0, '%')} | {reaction} |")
    return lines


def machine_details(threads: int | None) -> str:
    flags, model = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line
            if line.startswith(("cpu family", "model\t")) and len(model) < 40:
                model += line.split(":", 1)[1].strip() + "/"
    except OSError:
        pass
    amx = "AMX (amx_bf16, amx_int8)" if "amx_bf16" in flags else "no AMX"
    return f"{amx}; family/model {model.rstrip('/') or '?'}; engine threads {threads}"


# ------------------------------------------------------------------ main

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="arrival window per run (s); default 15")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1, 2, 4],
                        help="arrival rates as multiples of the measured capacity; default 0.5 1 2 4")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every configuration; default 3")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="default: ricllm fcfs edf")
    parser.add_argument("--slowdowns", nargs="+", choices=["none", "1.5"], default=["none", "1.5"],
                        help="none, and/or 1.5 (1.5x step time from the middle of the arrivals); default both")
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s to scale loads by, instead of measuring it (for quick checks)")
    parser.add_argument("--baseline-chunk", type=int, default=BASELINE_CHUNK["tokens"],
                        help="max_num_batched_tokens of the fcfs and edf baselines (ricllm: 512, paced)")
    parser.add_argument("--queue", type=int, default=None,
                        help="queue bound (every policy); default: capacity x the longest deadline (1 s)")
    parser.add_argument("--cached-fit", action="store_true",
                        help="use the latency fit cached on disk (default: calibrate afresh at the start, so the "
                             "fit, and the slowdown detector's reference, is this machine as it is now)")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--decision-only", action="store_true",
                        help="only the admission decision's p99 with 63 of the 64 seats promised (64 requests in "
                             "flight at each decision), on three fresh engines with the cached fit; appends nothing")
    return parser.parse_args(argv)


def decision_only(engines: int = 3) -> None:
    """``decision_p99_at_full_batch`` alone, each on a fresh engine: the issue's "decision p99 <= 1 ms with
    64 requests in flight", in a minute instead of the whole benchmark."""
    def task(engine):
        warm_up(engine)
        return decision_p99_at_full_batch(engine)

    for _ in range(engines):
        admitted, p99 = on_engine_thread("ricllm", 64, task)
        print(f"admission decision p99: {p99:.3f} ms with {admitted} requests admitted (64-seat batch)")


def main() -> None:
    args = parse_args()
    if args.decision_only:
        configure_logging(level=os.environ.get("RICLLM_LOG_LEVEL", "ERROR"))
        return decision_only()
    BASELINE_CHUNK["tokens"] = args.baseline_chunk
    from tqdm import tqdm

    configure_logging(level=os.environ.get("RICLLM_LOG_LEVEL", "ERROR"))  # the detector's warnings would flood
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average {load_before:.2f}: other work on this machine will move every number",
              file=sys.stderr)
    runs = len(args.loads) * len(args.slowdowns) * len(args.policies) * args.repeats
    estimate = runs * (args.seconds + PER_RUN_OVERHEAD_S) / 60
    print(f"{runs} runs, ~{estimate:.0f} min (plus capacity measurement)", file=sys.stderr)

    fit_dir = tempfile.TemporaryDirectory(prefix="bench_admission_")
    latency_fit = None if args.cached_fit else str(Path(fit_dir.name) / "latency_fit.json")

    def setup(engine):  # an engine without admission: it loads no fit
        if latency_fit is not None:  # every engine of this run gets a fit measured now (as at an engine's build)
            from ricllm.engine.calibration import calibrate, fit_key

            calibrate(engine).save(Path(latency_fit), fit_key(engine))
        warm_up(engine)
        idle = idle_latency_ms(engine)
        capacity = args.capacity or measure_capacity(engine)
        return idle, capacity, engine.spec.vocab_size

    idle, capacity, vocab = on_engine_thread("off", 64, setup)
    queue = args.queue or max(1, round(capacity * LONGEST_DEADLINE_S))
    print(f"capacity {capacity:.1f} requests/s, queue bound {queue}; idle latency (ms): "
          + ", ".join(f"{k} {v:.0f}" for k, v in idle.items()), file=sys.stderr)

    results: dict[tuple[float, str, str], list[dict]] = {}
    ratios: dict[tuple[float, str, str], list[float | None]] = {}
    threads = None
    progress = tqdm(total=runs, file=sys.stderr, unit="run", dynamic_ncols=True)
    for repeat in range(args.repeats):
        for load in args.loads:
            arrivals = poisson_arrivals(capacity * load, args.seconds, seed=1000 * repeat + int(load * 100),
                                        vocab=vocab)
            for slow in args.slowdowns:
                k = repeat % len(args.policies)
                order = args.policies[k:] + args.policies[:k]
                goodputs = {}
                for policy in order:
                    progress.set_postfix_str(f"repeat {repeat + 1}, {load:g}x, slowdown {slow}, {policy}")
                    run = run_once(policy, queue, arrivals, args.seconds, None if slow == "none" else float(slow),
                                   latency_fit)
                    threads = run.threads
                    summary = summarize(run)
                    results.setdefault((load, slow, policy), []).append(summary)
                    goodputs[policy] = summary["goodput"]
                    progress.update()
                for policy, ratio in goodput_ratios(goodputs).items():
                    ratios.setdefault((load, slow, policy), []).append(ratio)
    progress.close()

    rows = [(load, slow, policy, aggregate(results[(load, slow, policy)], ratios[(load, slow, policy)]))
            for load in args.loads for slow in args.slowdowns for policy in args.policies]
    lines = [f"Capacity (batch kept full of the mix, no deadlines): {capacity:.2f} requests/s; queue bound "
             f"{queue} (capacity x 1 s, every policy). Idle latency of one request alone (median ms): "
             + ", ".join(f"{k} {v:.0f}" for k, v in idle.items()) + ".", "", *table(rows), ""]
    verdicts = []
    for load in args.loads:
        for slow in args.slowdowns:
            ok, line = verdict(load, {p: a for ld, s, p, a in rows if ld == load and s == slow})
            verdicts.append(ok)
            lines.append(f"- {load:g}x, slowdown {slow}: {'PASS' if ok else 'FAIL'}: {line}")
    p99 = [a["decision_p99_ms"] for _, _, p, a in rows if p == "ricllm" and a["decision_p99_ms"] is not None]
    def finish(engine):
        warm_up(engine)
        return idle_latency_ms(engine), decision_p99_at_full_batch(engine)

    idle_after, (admitted, full) = on_engine_thread("ricllm", queue, finish, latency_fit)
    load_after = os.getloadavg()[0]
    drift = max(max(idle_after[k], idle[k]) / min(idle_after[k], idle[k]) for k in idle)
    lines.insert(1, "Idle latency again at the end (median ms): " + ", ".join(f"{k} {v:.0f}" for k, v in idle_after.items())
                 + f"; load average {load_before:.2f} at the start, {load_after:.2f} at the end."
                 + (f" WARNING: idle latency moved {drift:.1f}x between start and end: the machine was not quiet, "
                    "the fit, the capacity and every run may be off." if drift > 1.5 else ""))
    lines.append(f"\nricllm admission decision p99: {max(p99, default=math.nan):.3f} ms under load "
                 f"(worst run); {full:.3f} ms with {admitted} requests admitted (64-seat batch).")
    lines.append(f"\nOverall: {'PASS' if all(verdicts) else 'FAIL'} ({sum(verdicts)} of {len(verdicts)} "
                 f"load/slowdown settings pass).")
    details = (f"{machine_details(threads)}. Classes: 100 ms (16-32 prompt, 2-4 new tokens), 300 ms (32-64, "
               f"8-16), 1 s (64-128, 24-48), 30% each, and 10% best-effort bulk (256-512, 64-128); "
               f"{args.seconds:g} s of Poisson arrivals per run, {args.repeats} repeats, medians [min-max]; "
               f"slowdown 1.5x: every step 1.5x as long from the middle of the arrivals (slow_steps). "
               f"Baselines: fcfs and edf with the queue bound, on_late: abort (drop late) and "
               f"{BASELINE_CHUNK['tokens']}-token steps; ricllm: 512-token steps, prefill paced.")
    publish("Admission benchmark: honest baselines", details, "\n".join(lines),
            append=not args.no_append)


if __name__ == "__main__":
    main()
