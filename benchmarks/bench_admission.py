"""Deadline admission vs first-come-first-served under Poisson load (SmolLM2 on this machine).

Two classes, half each: near-RT (500 ms deadline, 8-16 new tokens) and non-RT (4 s, 32-64).
Loads of 0.5x, 1x, 2x and 4x the measured capacity; for each, the same arrivals go to the engine
with admission ("deadline", prefill paced for running decodes), with admission but unpaced
prefill ("unpaced"), optionally with the degrade policy ("degrade"), and without admission
("fcfs": every request queues). Reports the share of admitted requests that meet their deadline,
goodput (requests meeting their deadline per second, as `vllm bench serve --goodput` counts it),
rejections by reason, how late the latest missed request was, the p99 time per output token of
admitted requests, the latency model's error and the admission decision time.

    python benchmarks/bench_admission.py [--seconds 20] [--loads 0.5 1 2 4] [--policies deadline unpaced fcfs]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import publish  # noqa: E402
from ricllm.config import EngineConfig  # noqa: E402
from ricllm.engine.async_engine import EngineThread  # noqa: E402
from ricllm.engine.llm_engine import LLMEngine  # noqa: E402
from ricllm.sampling_params import SamplingParams  # noqa: E402

CLASSES = {"near_rt": (500.0, (8, 16)), "non_rt": (4000.0, (32, 64))}


def make_request(rng: random.Random, vocab: int) -> tuple[list[int], SamplingParams, str]:
    name = rng.choice(list(CLASSES))
    deadline_ms, (low, high) = CLASSES[name]
    prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(48, 96))]
    return prompt, SamplingParams(max_tokens=rng.randint(low, high), deadline_ms=deadline_ms, ignore_eos=True), name


def measure_capacity(engine: LLMEngine, min_done: int = 96, max_seconds: float = 120.0, seed: int = 0) -> float:
    """Requests per second finished with the batch kept full (no deadlines): the saturation rate."""
    rng = random.Random(seed)

    def top_up() -> None:
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < engine.config.max_num_seqs:
            prompt, params, _ = make_request(rng, engine.spec.vocab_size)
            engine.add_request(prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True))

    top_up()
    done, start = 0, time.perf_counter()
    while done < min_done and time.perf_counter() - start < max_seconds:
        done += len(engine.step())
        top_up()
    rate = done / (time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    if done == 0:
        raise SystemExit(f"no request finished in {max_seconds:.0f} s: is another process using the CPU?")
    return rate


def run_load(policy: str, rate: float, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    worker = engine_thread(policy)
    engine = worker.engine
    arrivals, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append((t, *make_request(rng, engine.spec.vocab_size)))
    decision_times = timed_decisions(engine)
    futures, start = [], time.perf_counter()
    for at, prompt, params, name in arrivals:
        time.sleep(max(0.0, start + at - time.perf_counter()))
        futures.append((name, worker.submit(prompt, params)))
    outputs = [(name, f.result()) for name, f in futures]
    duration = time.perf_counter() - start
    worker.stop()
    return summarize(outputs, duration, engine, decision_times)


def timed_decisions(engine: LLMEngine) -> list[float]:
    """Wrap admission.decide to record how long each decision takes."""
    times: list[float] = []
    if engine.admission is None:
        return times
    decide = engine.admission.decide

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = decide(*args, **kwargs)
        times.append(time.perf_counter() - started)
        return result

    engine.admission.decide = timed
    return times


def summarize(outputs, duration: float, engine: LLMEngine, decision_times: list[float]) -> dict:
    admitted = [o for _, o in outputs if o.admitted]
    met = [o for o in admitted if o.deadline_met]
    reasons: dict[str, int] = {}
    for _, o in outputs:
        if not o.admitted:
            reasons[o.rejection.code] = reasons.get(o.rejection.code, 0) + 1
    errors = engine.admission.latency.error_summary() if engine.admission else {}
    decisions = sorted(decision_times)
    tpots = sorted(o.tpot_s for o in admitted if o.tpot_s is not None)
    late_ms = [o.e2e_s * 1000 - o.deadline_ms for o in admitted if o.deadline_met is False]
    return {
        "sent": len(outputs), "admitted": len(admitted), "met": len(met),
        "degraded": sum(1 for o in admitted if o.degradation is not None),
        "worst_late_ms": max(late_ms) if late_ms else None,
        "tpot_p99_ms": tpots[int(0.99 * (len(tpots) - 1))] * 1000 if tpots else None,
        "met_of_admitted": len(met) / len(admitted) if admitted else float("nan"),
        "goodput": len(met) / duration, "rejected": reasons,
        "model_median_err": errors.get("median_abs_error"), "model_p95_err": errors.get("p95_abs_error"),
        "decision_p99_ms": decisions[int(0.99 * (len(decisions) - 1))] * 1000 if decisions else None,
    }


def decision_p99_at_full_batch(engine: LLMEngine, trials: int = 400, seed: int = 5) -> tuple[int, float]:
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
    times.sort()
    return admitted, times[int(0.99 * (len(times) - 1))] * 1000


POLICIES = {  # name -> EngineConfig's admission section
    "deadline": dict(policy="deadline", max_queue=256),
    "unpaced": dict(policy="deadline", max_queue=256, pace_prefill=False),
    "degrade": dict(policy="deadline", max_queue=256, degrade=True),
    "fcfs": dict(policy="fcfs", max_queue=10**9),  # unbounded queue: a plain serving loop
}


def engine_thread(policy: str) -> EngineThread:
    """The engine is built and run on one thread (two OpenMP pools would slow every step)."""
    return EngineThread(EngineConfig(kv_cache_budget="256MiB", max_num_seqs=64, admission=POLICIES[policy]))


def on_engine_thread(policy: str, task):
    """``task(engine)`` on a fresh engine's own thread."""
    worker = engine_thread(policy)
    try:
        return worker.call(task).result()
    finally:
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="arrival window per load (s)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1, 2, 4])
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["deadline", "unpaced", "fcfs"],
                        help="engines run on the same arrivals (default: deadline unpaced fcfs)")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    capacity = on_engine_thread("deadline", measure_capacity)  # calibrates once (cached on disk)
    rows = []
    for load in args.loads:
        for policy in args.policies:  # a fresh engine each run: fresh counters, same cached fit
            result = run_load(policy, capacity * load, args.seconds, seed=int(load * 100))
            rows.append({"load": load, "policy": policy, **result})
    lines = [f"capacity (saturated, mixed classes): {capacity:.2f} requests/s", "",
             "| load | policy | sent | admitted | degraded | met / admitted | goodput (req/s) | rejected | "
             "worst miss (ms late) | TPOT p99 (ms) | model err p50 / p95 | decision p99 (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        err = (f"{r['model_median_err']:.1%} / {r['model_p95_err']:.1%}"
               if r["model_median_err"] is not None else "-")
        decision = f"{r['decision_p99_ms']:.3f}" if r["decision_p99_ms"] is not None else "-"
        tpot = f"{r['tpot_p99_ms']:.1f}" if r["tpot_p99_ms"] is not None else "-"
        late = f"{r['worst_late_ms']:.0f}" if r["worst_late_ms"] is not None else "-"
        lines.append(f"| {r['load']}x | {r['policy']} | {r['sent']} | {r['admitted']} | {r['degraded']} | "
                     f"{r['met_of_admitted']:.1%} | {r['goodput']:.2f} | {r['rejected'] or '-'} | {late} | {tpot} | {err} | "
                     f"{decision} |")
    admitted, p99 = on_engine_thread("deadline", decision_p99_at_full_batch)
    lines.append(f"\ndecision p99 with {admitted} requests admitted (and a 64-seat batch): {p99:.3f} ms")
    by = {(r["load"], r["policy"]): r for r in rows}
    if (2, "deadline") in by and (2, "fcfs") in by and by[(2, "fcfs")]["goodput"] > 0:
        lines.append(f"\ngoodput at 2x load, admission / FCFS: {by[(2, 'deadline')]['goodput'] / by[(2, 'fcfs')]['goodput']:.2f}x")
    publish("Admission benchmark", f"Classes: near-RT 500 ms / 8-16 tokens, non-RT 4 s / 32-64 tokens, half each; "
            f"prompts 48-96 tokens; {args.seconds:.0f} s of Poisson arrivals per load.", "\n".join(lines),
            append=not args.no_append)

if __name__ == "__main__":
    main()
