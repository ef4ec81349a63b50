"""What serving LoRA adapters costs a decode step: no adapter, one adapter, four adapters mixed.

One engine (default: the installed SmolLM2-135M-Instruct Q4_1, int4 weights, 2 threads) holds
four random adapters of rank 8 on all seven projections (q, k, v, o, gate, up, down) of every
layer, written in the PEFT format into a temporary folder and loaded into the runtime's slots.
For each stream count (1, 8 and 32), each configuration prefills the streams' prompts (128
random tokens each, in one step) and then times ``--steps`` decode steps of all of them,
run through the runtime's runner as the engine runs them, the sequences carrying their adapter:

  - none: no sequence has an adapter (the step is what it is without LoRA);
  - one: every sequence under adapter 0;
  - four mixed: sequence i under adapter i mod 4, the step's rows grouped by adapter as the
    scheduler orders them (a step reads each adapter's weights once per block of 4 of its rows).

A configuration's time in a round is the median of its decode steps' times. Configurations are
interleaved: each round runs every stream count and configuration once, the configurations'
order rotated by one each round, so a slow minute of a shared machine lands on different ones.
Tables show the median [min–max] of the rounds; a ratio is the median [min–max] of the
per-round ratios against no adapter in the same round. The details name the CPU, the kernel
family and the load average at the start and the end: a ratio measured while other processes
share the cores says little (each step's threads wait for the slowest of them).

    python benchmarks/bench_lora.py                      # native runtime, 1/8/32 streams, 3 rounds
    python benchmarks/bench_lora.py --runtimes native torch --rounds 5
    python benchmarks/bench_lora.py --quick --model tiny.gguf   # smoke test: small sizes, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

ADAPTERS = 4
CONFIGS = ("none", "one", "four mixed")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Stat:
    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.low:.3g}–{self.high:.3g}]"


def stat(values: list[float]) -> Stat | None:
    return Stat(statistics.median(values), min(values), max(values)) if values else None


def interleaved_order(configs: int, rounds: int) -> list[tuple[int, int]]:
    """``(round, configuration)`` pairs: every configuration once a round, the order rotated by one each round."""
    return [(r, (r + i) % configs) for r in range(rounds) for i in range(configs)]


def write_random_adapter(folder: Path, spec, rank: int, seed: int) -> Path:
    """A PEFT adapter of rank ``rank`` on all seven projections of every layer: A and B random
    (B small, so the model still says something), lora_alpha 2·rank."""
    from safetensors.numpy import save_file

    from ricllm.model.lora import PROJECTION_MODULES, projection_shape

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for name, module in PROJECTION_MODULES.items():
            in_features, out_features = projection_shape(spec, name)
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, in_features)) / np.sqrt(in_features)
                                                  ).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) * 0.01).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(LORA_MODULES), "bias": "none", "lora_dropout": 0.0}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def slots_of(config: str, streams: int) -> list[int | None]:
    if config == "none":
        return [None] * streams
    if config == "one":
        return [0] * streams
    return sorted(i % ADAPTERS for i in range(streams))  # grouped by adapter, as the scheduler orders a step


class StepTimer:
    """Decode steps of ``streams`` sequences through one engine's runner, the sequences under the
    configuration's adapters."""

    def __init__(self, llm, prompt_len: int, steps: int):
        self.llm, self.prompt_len, self.steps = llm, prompt_len, steps

    def decode_step_ms(self, config: str, streams: int, seed: int) -> float:
        """The median time of ``steps`` decode steps of all streams, in ms."""
        from ricllm import SamplingParams
        from ricllm.engine.scheduler import ScheduledBatch
        from ricllm.lora_request import AdapterSlot
        from ricllm.sequence import Sequence

        engine = self.llm.engine
        cache, runner, vocab = engine.cache, engine.runtime.runner, engine.spec.vocab_size
        draw = random.Random(seed)
        seqs = [Sequence(request_id=f"{config}-{i}", num_prompt_tokens=self.prompt_len, arrival_time=0.0,
                         token_ids=[draw.randrange(min(100, vocab // 4), vocab - min(100, vocab // 4))
                                    for _ in range(self.prompt_len)],
                         params=SamplingParams(max_tokens=self.steps + 1),
                         adapter=None if slot is None else AdapterSlot(f"adapter{slot}", slot, f"random{slot}"))
                 for i, slot in enumerate(slots_of(config, streams))]
        try:
            self._step(cache, runner, ScheduledBatch([(seq, self.prompt_len) for seq in seqs]))
            times = []
            for _ in range(self.steps):
                times.append(self._step(cache, runner, ScheduledBatch([(seq, 1) for seq in seqs])))
        finally:
            for seq in seqs:
                cache.free(seq)
        return 1e3 * statistics.median(times)

    @staticmethod
    def _step(cache, runner, batch) -> float:
        for seq, count in batch.items:
            grant = cache.allocate(seq, count)
            if grant is None:
                raise RuntimeError("the KV budget does not hold the streams: raise --kv-budget")
            seq.take_blocks(grant)
        started = time.perf_counter()
        logits, _ = runner.run(batch)
        elapsed = time.perf_counter() - started
        for (seq, count), row in zip(batch.items, np.asarray(logits)):
            seq.num_computed_tokens += count
            seq.token_ids.append(int(row.argmax()))
        return elapsed


def build_engine(args, runtime: str, folders: list[Path]):
    from ricllm import LLM
    from ricllm.model.lora import load_lora_adapter

    llm = LLM(str(args.model), runtime=runtime, weights=args.weights, threads=args.threads,
              kv_cache_budget=args.kv_budget, max_loras=ADAPTERS, weight_cache=True)
    for slot, folder in enumerate(folders):
        llm.engine.runtime.lora.load(slot, load_lora_adapter(folder, llm.engine.spec))
    return llm


def measure(args, runtime: str, folders: list[Path]) -> dict[tuple[int, str], list[float]]:
    """Per (streams, configuration): the round's step time in ms, one per round."""
    timer = StepTimer(build_engine(args, runtime, folders), args.prompt_len, args.steps)
    times: dict[tuple[int, str], list[float]] = {}
    for round_index, config_index in interleaved_order(len(CONFIGS), args.rounds):
        config = CONFIGS[config_index]
        for streams in args.streams:
            if config == "four mixed" and streams < ADAPTERS:
                continue  # fewer streams than adapters: not four mixed
            ms = timer.decode_step_ms(config, streams, seed=round_index)
            times.setdefault((streams, config), []).append(ms)
            print(f"  round {round_index + 1}: {runtime}, {streams} streams, {config}: {ms:.2f} ms/step",
                  file=sys.stderr, flush=True)
    return times


def per_round_ratios(ours: list[float], base: list[float]) -> list[float]:
    return [a / b for a, b in zip(ours, base)]


def table(times: dict[tuple[int, str], list[float]], streams: list[int]) -> str:
    header = ("| streams | no adapter, ms/step | one adapter, ms/step | one / none | four mixed, ms/step | "
              "four mixed / none |")
    lines = [header, "|---|---|---|---|---|---|"]
    for count in streams:
        base = times[(count, "none")]
        cells = [str(count), str(stat(base))]
        for config in CONFIGS[1:]:
            ours = times.get((count, config))
            cells += [str(stat(ours)), str(stat(per_round_ratios(ours, base)))] if ours else ["—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--weights", default="int4", help="weight format (default: int4)")
    parser.add_argument("--runtimes", nargs="+", default=["native"], choices=["native", "torch"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration and round")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-budget", default="256MiB")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 and 4 streams, 4 steps of 16-token prompts")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.steps, args.prompt_len, args.kv_budget = [1, 4], 4, 16, "16MiB"
    if min(args.rounds, args.steps, args.rank, args.threads) < 1:
        parser.error("--rounds, --steps, --rank and --threads must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    from benchmarks.results import machine, publish
    from ricllm.kernels.cpu_library import cpu_family
    from ricllm.model.loader import default_model_path, open_checkpoint

    args.model = args.model or default_model_path()
    spec = open_checkpoint(args.model).spec
    sections = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        folders = [write_random_adapter(Path(tmp) / f"adapter{i}", spec, args.rank, seed=i) for i in range(ADAPTERS)]
        for runtime in args.runtimes:
            times = measure(args, runtime, folders)
            sections.append(f"{runtime} runtime:\n\n{table(times, args.streams)}\n")
    details = (f"Kernel family {cpu_family() or 'none'}, {args.threads} threads, {args.model.name} ({args.weights} "
               f"weights); {ADAPTERS} random adapters of rank {args.rank} on q, k, v, o, gate, up and down of every "
               f"layer; {args.prompt_len}-token prompts, median of {args.steps} decode steps per round, "
               f"{args.rounds} interleaved rounds: median [min–max]. Load average (1 min) {load_start:.2f} at the "
               f"start, {os.getloadavg()[0]:.2f} at the end (the benchmark keeps {args.threads} cores busy).\n")
    body = "\n".join(sections)
    if args.append:
        publish("LoRA decode step cost (bench_lora.py)", details, body, append=True)
    else:
        print(f"Machine: {machine()}. {details}\n{body}")


if __name__ == "__main__":
    main()
