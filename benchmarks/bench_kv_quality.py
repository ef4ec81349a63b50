"""What each KV cache mode costs in quality, and what it buys in memory.

Modes: the exact cache (bf16), the int8 cache (``kv_cache_dtype="int8"``), and sink + window
caches (``kv_window=W``, ``kv_sinks=4``) for several W. Every mode runs the same model (default:
the installed SmolLM2-135M-Instruct, int4 weights) on the torch runtime with the reference
attention (``attention_backend="torch"``), so the cache is the only thing that differs.

1. Passkey retrieval: a five-digit key hidden at depths 0-100% of a filler text of each length,
   greedy completion of "The pass key is"; retrieved when the answer starts with the key. Lengths
   where the exact cache itself retrieves under 80% say so and are not judged.
2. Teacher-forced agreement and perplexity against the exact cache: the repository's own docs
   (English technical prose) as one long text, read in chunks of 256 tokens (windows evict between
   them, exactly as in serving); agreement = the share of positions whose most likely next token
   is the exact cache's; perplexity of the text itself.
3. Decision change rate: the bundled scenario's decision templates (with their worked examples,
   constrained answers) over KPI rows of its trace, request by request against the exact cache
   in one batch; the noise floor is the exact cache again, one request at a time (the packed
   products are not batch-invariant), and the policy accuracy of each mode beside it.
4. Memory: bytes per token, tokens per MiB, and concurrent sequences at several contexts in the
   default 256 MiB budget (the engine's own geometry and admission bound).

    python benchmarks/bench_kv_quality.py [--lengths 512 1024 2048 4096] [--windows 256 1024] [--no-append]
    python benchmarks/bench_kv_quality.py --quick --no-append     # smoke run: tiny sizes
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.bench_decisions import judge, template_cases
from benchmarks.results import publish
from ricllm import LLM, SamplingParams
from ricllm.cache.kv_cache import plan_cache
from ricllm.cache.kv_format import kv_format
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.kv_window import KVWindow, most_blocks
from ricllm.replay.loading import load_scenario, load_scenario_trace
from ricllm.replay.templates import answer_check, scenario_policies, scenario_templates
from ricllm.sequence import Sequence

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SINKS = 4
TF_CHUNK = 256
BUDGET = "256MiB"


@dataclass(frozen=True)
class Mode:
    label: str
    settings: dict

    def engine(self, model: str | None, **extra) -> LLM:
        return LLM(model, runtime="torch", attention_backend="torch", kv_cache_budget=BUDGET, **self.settings,
                   **extra)


def modes(windows: list[int]) -> list[Mode]:
    return [Mode("bf16 (exact)", {}), Mode("int8", {"kv_cache_dtype": "int8"}),
            *(Mode(f"window {w} + {SINKS} sinks", {"kv_window": w, "kv_sinks": SINKS}) for w in windows)]


def progress(text: str) -> None:
    print(f"[bench_kv_quality] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ 1. passkey retrieval

def passkey_prompt(llm: LLM, length: int, depth: float, key: int) -> list[int]:
    """Filler, the needle at ``depth`` of it, then the question: within one filler sentence of
    ``length`` tokens in all (the filler count is corrected on the tokens it actually gives)."""
    encode = llm.engine.tokenizer.encode
    per_filler = len(encode(FILLER))

    def build(fillers: int) -> list[int]:
        before = round(fillers * depth)
        return encode(FILLER * before + NEEDLE.format(key=key) + FILLER * (fillers - before) + QUESTION)

    fillers = max(length // per_filler, 1)
    for _ in range(4):
        tokens = build(fillers)
        step = round((length - len(tokens)) / per_filler)
        if step == 0 or fillers + step < 1:
            break
        fillers += step
    return tokens


def passkey(mode: Mode, model: str | None, lengths: list[int], keys: list[int]) -> dict[int, float]:
    llm = mode.engine(model)
    params = SamplingParams(max_tokens=8, temperature=0)
    accuracy = {}
    for length in lengths:
        cases = [(passkey_prompt(llm, length, d, k), k) for d in DEPTHS for k in keys]
        outs = llm.generate([p for p, _ in cases], params)
        accuracy[length] = sum(o.text.strip().startswith(str(k)) for o, (_, k) in zip(outs, cases)) / len(cases)
        progress(f"passkey {mode.label}, {length} tokens: {accuracy[length]:.0%}")
    return accuracy


# ------------------------------------------------------------------ 2. teacher-forced agreement

def long_text(llm: LLM, tokens: int) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    return llm.engine.tokenizer.encode(text)[:tokens]


@torch.inference_mode()
def teacher_forced(llm: LLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the most likely next token and the log-probability of the text's next token,
    computed in chunks through the engine's own cache (a window evicts between chunks)."""
    engine, runtime = llm.engine, llm.engine.runtime
    seq = Sequence(request_id="teacher-forced", token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                   params=SamplingParams(max_tokens=1), kv_window=engine.checks.kv_window_of(SamplingParams()),
                   arrival_time=engine.clock())
    best, logprobs = [], []
    for start in range(0, len(token_ids) - 1, TF_CHUNK):
        count = min(TF_CHUNK, len(token_ids) - 1 - start)
        grant = engine.cache.allocate(seq, count)
        if grant is None:
            raise RuntimeError("the KV budget does not hold the text: raise BUDGET")
        seq.take_blocks(grant)
        input_ids, positions, meta, _, _ = runtime.runner.prepare(ScheduledBatch([(seq, count)]))
        logits = runtime.model.compute_logits(runtime.model(input_ids, positions, runtime.kv_cache.layers, meta))
        targets = torch.tensor(token_ids[start + 1:start + 1 + count])
        best.append(logits.argmax(-1))
        logprobs.append(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0])
        seq.num_computed_tokens += count
        seq.block_hashes += engine.cache.cache_full_blocks(seq)
        seq.evict_blocks(engine.cache.evict_outside_window(seq))
    engine.cache.free(seq)
    seq.drop_blocks()
    return torch.cat(best), torch.cat(logprobs)


# ------------------------------------------------------------------ 3. decisions

def decision_answers(llm: LLM, scenario, cases_by_template: dict, one_by_one: bool = False) -> dict:
    answers = {}
    for name, cases in cases_by_template.items():
        template = scenario_templates(scenario)[name]
        params = SamplingParams(max_tokens=32, structured=template.structured)
        chats = [template.message_list + [{"role": "user", "content": c.user}] for c in cases]
        outs = [llm.chat([c], params)[0] for c in chats] if one_by_one else llm.chat(chats, params)
        answers[name] = outs
    return answers


def changed(a: dict, b: dict) -> tuple[int, int]:
    pairs = [(x.text, y.text) for name in a for x, y in zip(a[name], b[name])]
    return sum(x != y for x, y in pairs), len(pairs)


def accuracy(scenario, answers: dict, cases_by_template: dict) -> float:
    right = total = 0
    for name, outs in answers.items():
        _, correct = judge(outs, cases_by_template[name], answer_check(scenario.prompts.templates[name]))
        right += correct * len(outs)
        total += len(outs)
    return right / total


# ------------------------------------------------------------------ 4. memory

def memory_rows(llm: LLM, mode: Mode, contexts: list[int], chunk: int) -> str:
    spec, block = llm.engine.spec, llm.engine.config.block_size
    fmt = kv_format(mode.settings.get("kv_cache_dtype", "auto"), "bfloat16")
    geometry = plan_cache(spec, llm.engine.config.kv_cache_budget, block, fmt)
    window = KVWindow(SINKS, mode.settings["kv_window"]) if "kv_window" in mode.settings else None
    seats = [geometry.num_blocks // most_blocks(n, window, block, chunk) for n in contexts]
    return (f"| {mode.label} | {fmt.bytes_per_token(spec):,} | {2**20 / fmt.bytes_per_token(spec):,.1f} | "
            f"{geometry.num_tokens:,} | " + " | ".join(f"{s:,}" for s in seats) + " |")


# ------------------------------------------------------------------ main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--keys", type=int, default=3, help="keys per (length, depth) (default: %(default)s)")
    parser.add_argument("--text-tokens", type=int, default=4096, help="teacher-forced text length")
    parser.add_argument("--scenario", default="default")
    parser.add_argument("--rows", type=int, default=40, help="KPI rows per decision template")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.windows, args.keys, args.text_tokens, args.rows = [128], [32], 1, 300, 3
    started = time.perf_counter()
    all_modes = modes(args.windows)
    keys = [random.Random(7 + i).randrange(10000, 99999) for i in range(args.keys)]
    scenario = load_scenario(args.scenario)
    rows = load_scenario_trace(scenario).rows
    cases = {name: template_cases(scenario, name, rows, args.rows, seed=i)
             for i, name in enumerate(scenario_policies(scenario))}

    retrieval, forced, decisions, memory = {}, {}, {}, []
    for mode in all_modes:
        retrieval[mode.label] = passkey(mode, args.model, args.lengths, keys)
        llm = mode.engine(args.model)
        forced[mode.label] = teacher_forced(llm, long_text(llm, args.text_tokens))
        decisions[mode.label] = decision_answers(llm, scenario, cases)
        memory.append(memory_rows(llm, mode, [1024, 4096, 8192], llm.engine.config.max_num_batched_tokens))
        progress(f"{mode.label}: done after {time.perf_counter() - started:.0f} s")
    exact = all_modes[0].label
    floor = decision_answers(all_modes[0].engine(args.model), scenario, cases, one_by_one=True)
    body = render(args, all_modes, retrieval, forced, decisions, floor, memory, scenario, cases, exact)
    publish("KV cache quality: int8 and sink + window against the exact cache",
            f"{args.scenario} scenario decisions; default model on the torch runtime, reference attention, "
            f"int4 weights; {time.perf_counter() - started:.0f} s.", body, append=not args.no_append)


def render(args, all_modes, retrieval, forced, decisions, floor, memory, scenario, cases, exact) -> str:
    judged = [n for n in args.lengths if retrieval[exact][n] >= 0.8]
    unjudged = [n for n in args.lengths if n not in judged]
    lines = [f"Passkey retrieval ({len(DEPTHS)} depths × {args.keys} keys per length; greedy):\n",
             "| mode | " + " | ".join(f"{n} tokens" for n in args.lengths) + " |",
             "|---|" + "---:|" * len(args.lengths)]
    lines += [f"| {m.label} | " + " | ".join(f"{retrieval[m.label][n]:.0%}" + ("" if n in judged else " (not judged)")
                                             for n in args.lengths) + " |" for m in all_modes]
    if unjudged:
        lines.append(f"\nThe exact cache retrieves under 80% at {', '.join(map(str, unjudged))} tokens: the model "
                     "itself cannot, so those lengths say nothing about the cache.")
    best, logprob = forced[exact]
    lines += [f"\nTeacher-forced over {len(best) + 1:,} tokens of docs/*.md (chunks of {TF_CHUNK}):\n",
              "| mode | greedy agreement with exact | perplexity | vs exact |", "|---|---:|---:|---:|"]
    base = math.exp(-logprob.mean().item())
    for m in all_modes:
        b, lp = forced[m.label]
        ppl = math.exp(-lp.mean().item())
        lines.append(f"| {m.label} | {(b == best).float().mean().item():.2%} | {ppl:.3f} | {ppl / base - 1:+.2%} |")
    moved, total = changed(floor, decisions[exact])
    lines += [(f"\nDecisions ({args.scenario}: {', '.join(cases)}; {total} requests, constrained, with the "
               "worked examples):\n"), "| mode | answers changed vs exact (batched) | policy accuracy |",
              "|---|---:|---:|",
              (f"| noise floor: exact, one request at a time | {moved} of {total} ({moved / total:.1%}) | "
               f"{accuracy(scenario, floor, cases):.1%} |")]
    for m in all_modes:
        moved, total = changed(decisions[m.label], decisions[exact])
        lines.append(f"| {m.label} | {moved} of {total} ({moved / total:.1%}) | "
                     f"{accuracy(scenario, decisions[m.label], cases):.1%} |")
    lines += [(f"\nMemory ({BUDGET} KV budget; concurrent sequences = blocks / the most a sequence holds, "
               "windows at the engine's chunk):\n"),
              "| mode | bytes per token | tokens per MiB | tokens in the budget | seqs @1K | seqs @4K | seqs @8K |",
              "|---|---:|---:|---:|---:|---:|---:|", *memory]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
