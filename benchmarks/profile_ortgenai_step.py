"""ORT GenAI's decode step taken apart, beside bench_onnx_step.py (ricllm's ONNX runtime) and
profile_decode.py (the native runtime): the kernel time of its decode runs by operator.

One generator of B streams, each a random --context-token prompt, greedy; after the prefill and two
warm-up steps, --steps decode steps are timed (the median) and ONNX Runtime's profile of their runs
is summed by operator: the layers' int4 products (MatMulNBits), the head's (MatMulNBits over the
vocabulary), GroupQueryAttention (RoPE inside it, over each stream's contiguous fp32 past) and the
rest. ``--cpu-time`` times a step by this process's CPU time (with --threads 1, the work's own time
where others load the machine); the shares are of the profiled kernel time.

The model is the one bench_cpu.py --ortgenai builds (``$RICLLM_CACHE_DIR/ortgenai/int4-cpu-*``),
under an interpreter with onnxruntime-genai (``PYTHONPATH=$RICLLM_CACHE_DIR/ortgenai-0.18.0``):

    python benchmarks/profile_ortgenai_step.py MODEL_DIR [--streams 1 32] [--context 256] [--steps 20]
        [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

WARM_RUNS = 3  # the prefill and two decode steps, not profiled


def measure(model_dir: str, streams: int, context: int, steps: int, threads: int, cpu_time: bool) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    prefix = str(Path(tempfile.mkdtemp()) / "profile")
    config = og.Config(model_dir)
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "enable_profiling": prefix}}}}))
    model = og.Model(config)
    rng = random.Random(streams)
    prompts = np.array([[rng.randrange(100, 49000) for _ in range(context)] for _ in range(streams)], np.int32)
    params = og.GeneratorParams(model)
    length = context + WARM_RUNS + steps
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=streams)
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)
    for _ in range(WARM_RUNS):  # the prefill's pick, then two decode steps
        generator.generate_next_token()
    clock = time.process_time if cpu_time else time.perf_counter
    step_s = []
    while not generator.is_done():
        start = clock()
        generator.generate_next_token()
        step_s.append(clock() - start)
    del generator, params, model, config  # ends the session, which writes its profile
    profile = max(Path(prefix).parent.glob("profile*.json"), key=lambda p: p.stat().st_mtime)
    return {"streams": streams, "step_ms": statistics.median(step_s) * 1e3, **by_operator(json.loads(
        profile.read_text()))}


def by_operator(events: list[dict]) -> dict:
    """Shares of the decode runs' kernel time by operator (the first WARM_RUNS runs left out)."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[WARM_RUNS:]
    windows = [(run["ts"], run["ts"] + run["dur"]) for run in runs]
    seconds: dict[str, float] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and any(
                begin <= event["ts"] <= end for begin, end in windows):
            op = event["args"].get("op_name", "?")
            seconds["head" if op == "MatMulNBits" and "lm_head" in event["name"] else op] += event["dur"] * 1e-6
    total = sum(seconds.values())
    parts = {"products": seconds.pop("MatMulNBits", 0.0), "head": seconds.pop("head", 0.0),
             "attention": seconds.pop("GroupQueryAttention", 0.0)}
    parts["rest"] = sum(seconds.values())
    return {"shares": {name: value / total for name, value in parts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a model folder ORT GenAI's builder wrote")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="time a step by this process's CPU time")
    args = parser.parse_args()
    rows = [measure(args.model_dir, s, args.context, args.steps, args.threads, args.cpu_time) for s in args.streams]
    print(f"ORT GenAI, {args.threads} threads, context {args.context}, {'CPU time' if args.cpu_time else 'wall clock'}")
    print("| streams | step (ms) | tok/s | products | head | attention (GroupQueryAttention) | rest |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        shares = row["shares"]
        print(f"| {row['streams']} | {row['step_ms']:.1f} | {row['streams'] / row['step_ms'] * 1e3:.0f} | "
              + " | ".join(f"{shares[part]:.1%}" for part in ("products", "head", "attention", "rest")) + " |")


if __name__ == "__main__":
    main()
