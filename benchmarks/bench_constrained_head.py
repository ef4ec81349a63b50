"""The LM head where the grammar allows: decode step time with the k-wide head against the whole head.

Constrained decoding of a JSON choice (``{"action": one of four}``) on the default model
(SmolLM2-135M-Instruct: its tied Q8_0 embedding is the 8-bit head, about a fifth of the weights
a decode step reads; ``--model gemma3-270m``: a 262,144-token head, most of them), at 1 and 32
streams. Jump-forward is off, so every answer token is a decode
step that samples under the grammar (1 to a few allowed tokens each); only steps in which every
stream decodes are timed (``engine.step``: the allowed tokens, the model, the head, sampling and
the grammar included). The same engine runs both heads (``runner.narrow_head``), interleaved:
``--rounds`` rounds of (streams × head), each measurement the median of its steps; the table gives
the median and range over the rounds, and the whole head's time over the k-wide head's.

Then the head alone (the packed head on random hidden states, 1 and 32 rows): the k-wide head's
time against the whole head's as the allowed tiles' share of the head grows, which places
``narrow_head.MAX_TILE_SHARE``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: no folder of ours shadows an installed package

from benchmarks.engine_steps import full_decode_step_ms
from benchmarks.results import publish
from ricllm import LLM, SamplingParams
from ricllm.engine.runtime.narrow_head import MAX_TILE_SHARE, TILE
from ricllm.kernels.cpu_library import kernel_family

CHOICE = {"json": {"type": "object", "properties": {"action": {"enum": ["handover", "offload", "hold", "escalate"]}},
                   "required": ["action"], "additionalProperties": False}}
STREAMS = (1, 32)
HEADS = ("k-wide", "whole")
SHARES = (1 / 3072, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 3 / 4, 1.0)


def decode_step_ms(llm: LLM, prompts: list[str], runs: int) -> float:
    """Median wall time of the steps in which every stream decodes, over ``runs`` batches."""
    engine, times = llm.engine, []
    for run in range(runs):
        params = SamplingParams(max_tokens=16, temperature=0.8, seed=run, structured=CHOICE)
        seqs = [engine.add_request(p, params) for p in prompts]
        times += full_decode_step_ms(engine, seqs, "bench_constrained_head")
    if not times:
        raise SystemExit(f"bench_constrained_head: no step of {runs} batches had every one of {len(prompts)} "
                         "streams decoding (the grammar forced the rest of each answer); raise --runs")
    return statistics.median(times)


def step_rows(llm: LLM, rounds: int, runs: int) -> list[str]:
    prompts = [f"Cell {i}: PRB usage high, handover failures rising. Action?" for i in range(max(STREAMS))]
    runner = llm.engine.runtime.runner
    for head in HEADS:  # warm-up: the first steps build kernels and compile the grammar
        runner.narrow_head = head == "k-wide"
        decode_step_ms(llm, prompts[:2], 1)
    per_step: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for n in STREAMS:
            for head in HEADS:
                runner.narrow_head = head == "k-wide"
                per_step.setdefault((n, head), []).append(decode_step_ms(llm, prompts[:n], runs))
    runner.narrow_head = True
    rows = []
    for n in STREAMS:
        narrow, whole = per_step[(n, "k-wide")], per_step[(n, "whole")]
        ratios = [w / k for w, k in zip(whole, narrow)]  # per round: the two heads measured side by side
        ratio = statistics.median(whole) / statistics.median(narrow)
        rows.append(f"| {n} | {span(narrow)} | {span(whole)} | {ratio:.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] |")
    return rows


def head_rows(llm: LLM, rounds: int, calls: int = 20) -> list[str]:
    """The packed head alone: whole vs the allowed tiles only, by the tiles' share of the head, the
    two timed back to back in each round."""
    runtime = llm.engine.runtime
    model, spec = runtime.model, runtime.spec
    num_tiles = spec.vocab_size // TILE
    rng = np.random.default_rng(0)
    rows = []
    for m in STREAMS:
        hidden, as_tiles = random_hidden(runtime, m, spec.hidden_size, rng)
        for share in SHARES:
            count = max(1, round(share * num_tiles))
            tiles = as_tiles(np.linspace(0, num_tiles - 1, count).round().astype(np.int32))
            whole, narrow = [], []
            for _ in range(rounds):
                whole.append(timed(lambda: model.compute_logits(hidden), calls))
                narrow.append(timed(lambda: model.compute_logits_on_tiles(hidden, tiles), calls))
            rows.append(f"| {m} | {count} ({count / num_tiles:.1%}) | {span(narrow)} | {span(whole)} | "
                        f"{statistics.median(narrow) / statistics.median(whole):.2f} |")
    return rows


def random_hidden(runtime, rows: int, hidden: int, rng):
    """Hidden states of the runtime's activation type, and how it takes a tile list."""
    values = rng.standard_normal((rows, hidden), dtype=np.float32)
    if runtime.name == "native":
        from ricllm.kernels.aligned import aligned_empty

        bits = aligned_empty((rows, hidden), np.uint16)
        bits[:] = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16: fp32's upper half
        return bits, lambda tiles: tiles
    import torch

    return torch.from_numpy(values).to(runtime.dtype), torch.from_numpy


def timed(fn, calls: int) -> float:
    """Median ms of ``calls`` calls."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def span(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def model_name(model: str | None) -> str:
    return "the default model (SmolLM2-135M-Instruct)" if model is None else model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="batches of answers per measurement (default: %(default)s)")
    parser.add_argument("--runtime", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--model", default=None,
                        help="a path or an installed model's short name, e.g. gemma3-270m (default: SmolLM2-135M)")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    if args.rounds < 3:
        raise SystemExit("bench_constrained_head: --rounds must be at least 3")
    llm = LLM(args.model, max_num_seqs=64, jump_forward=False, runtime=args.runtime)
    runtime = llm.engine.runtime
    narrows = runtime.model.head_narrows(max(STREAMS))
    body = "\n".join([
        (f"Decode step with every stream constrained (ms per step, median [range] of {args.rounds} interleaved "
         f"rounds, each the median of {args.runs} batches' steps; sampled, T=0.8):\n"),
        "| streams | k-wide head ms | whole head ms | whole / k-wide |", "|---:|---:|---:|---:|",
        *step_rows(llm, args.rounds, args.runs),
        (f"\nThe head alone ({runtime.spec.vocab_size:,} rows; ms per call, median [range] of {args.rounds} rounds "
         f"of 20 calls, the two heads back to back in each); the k-wide head is used up to {MAX_TILE_SHARE:.0%} of "
         "the tiles:\n"),
        "| rows | allowed tiles | k-wide ms | whole ms | k-wide / whole |", "|---:|---:|---:|---:|---:|",
        *head_rows(llm, args.rounds),
    ])
    publish("The LM head where the grammar allows",
            f"Kernels {kernel_family()}; {model_name(args.model)} ({runtime.spec.vocab_size:,}-token vocabulary), "
            f"{runtime.name} runtime, {runtime.threads} threads, weights {'/'.join(runtime.weight_formats)} "
            f"(layers/head); the k-wide head {'is exact here' if narrows else 'does not run here'}.",
            body, append=not args.no_append)


if __name__ == "__main__":
    main()
