"""The step's token budget (``max_num_batched_tokens``): prefill speed, decode stall, memory.

A prompt longer than the budget is prefilled in chunks, one per step, and every step carries the
running sequences' decode tokens too. So the budget sets three things a RIC operator plans on:
how fast prompts are read, how long a running decode waits while a prompt joins (the longest
step), and the step's activation memory (the process's peak RSS). Each budget runs in its own
process with the default model and weight formats, a 256 MiB KV budget and 2 threads; the ratios
are against the first budget listed.

    python benchmarks/bench_chunk.py [--budgets 2048 1024 512 256] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

THREADS, REPEATS, DECODING = 2, 3, 8
MARK = "BENCH_CHUNK "


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    draw = random.Random(seed)
    return [[draw.randrange(100, 49_000) for _ in range(length)] for _ in range(count)]


def prefill_rate(llm, count: int, length: int) -> float:
    """Prompt tokens per second, prefill only (max_tokens 1), median of REPEATS fresh prompts."""
    from ricllm import SamplingParams

    times = []
    for seed in range(REPEATS):
        started = time.perf_counter()
        llm.generate(prompts(count, length, seed=1000 * length + seed), SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(time.perf_counter() - started)
    return count * length / statistics.median(times)


def decode_stall(llm, length: int) -> tuple[float, float]:
    """DECODING sequences decode; a ``length``-token prompt joins. Returns the longest step while
    it is read (the worst gap between two of their tokens), and its time to first token, in ms."""
    from ricllm import SamplingParams

    engine = llm.engine
    running = [engine.add_request(p, SamplingParams(max_tokens=4_000, ignore_eos=True))
               for p in prompts(DECODING, 64, seed=7)]
    for _ in range(4):  # their prefill, then decodes
        engine.step()
    engine.step_history.clear()
    joining = engine.add_request(prompts(1, length, seed=8)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    while not joining.is_finished:
        engine.step()
    ttft = time.perf_counter() - started
    longest = max(record.duration_s for record in engine.step_history)
    for seq in running:
        engine.abort(seq)
    return longest * 1000, ttft * 1000


def child(budget: int) -> dict:
    from ricllm import LLM, SamplingParams

    llm = LLM(kv_cache_budget="256MiB", max_num_batched_tokens=budget, enable_prefix_caching=False, threads=THREADS)
    llm.generate(prompts(2, 300, seed=99), SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    stall_ms, ttft_ms = decode_stall(llm, 2048)
    return dict(budget=budget, batch_tps=prefill_rate(llm, 8, 256), long_tps=prefill_rate(llm, 1, 2048),
                stall_ms=stall_ms, ttft_ms=ttft_ms,
                peak_rss_mb=own_peak_rss_mb())


def own_peak_rss_mb() -> float:
    """VmHWM (KiB) in MB: the child's own peak. Its ru_maxrss would include this script's parent's
    peak, which Linux carries into a child across exec."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / 1e6


def run_child(budget: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TQDM_DISABLE="1")
    print(f"[bench_chunk] max_num_batched_tokens {budget} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--child", str(budget)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_chunk: the child for max_num_batched_tokens {budget} failed (exit {done.returncode}); "
                 f"its stderr is above")
    out = done.stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith(MARK))[len(MARK):])


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"| max_num_batched_tokens | prefill 8 × 256 (tok/s) | prefill 1 × 2048 (tok/s) | longest step while "
             f"a 2048-token prompt joins {DECODING} decodes (ms) | its TTFT (ms) | peak RSS (MB) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['batch_tps']:.0f} ({r['batch_tps'] / base['batch_tps']:.2f}×) | "
                     f"{r['long_tps']:.0f} ({r['long_tps'] / base['long_tps']:.2f}×) | "
                     f"{r['stall_ms']:.0f} ({r['stall_ms'] / base['stall_ms']:.2f}×) | {r['ttft_ms']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} ({r['peak_rss_mb'] - base['peak_rss_mb']:+.0f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 1024, 512, 256],
                        help="max_num_batched_tokens values; ratios are against the first (default: %(default)s)")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(MARK + json.dumps(child(args.child)), flush=True)
        return
    from benchmarks.results import publish

    rows = [run_child(budget) for budget in args.budgets]
    publish("Step token budget", f"Default model and weight formats, 256 MiB KV, prefix caching off, {THREADS} "
            f"threads, each budget in its own process; prefill rates are medians of {REPEATS} fresh prompt sets; "
            f"ratios against {args.budgets[0]}, RSS as the difference.", table(rows), append=not args.no_append)


if __name__ == "__main__":
    main()
