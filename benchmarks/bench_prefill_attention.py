"""Prefill attention: the C kernels against torch's SDPA, and whole prefills of both runtimes.

Part 1 times one layer's attention of a prompt (SmolLM2-135M's shape: 9 query heads over 3 KV
heads, head_dim 64, bf16 paged cache, block size 16) in the engine's C kernel
(``cpu_paged_attention``: the blocked prefill kernel for such steps), in the decode-shaped paged
kernel it replaced there, in SDPA as the torch runtime runs it (``reference.paged_attention``:
gather the context, masked SDPA) and in SDPA at its best (causal, contiguous K/V, no gather).
A ``q/ctx`` case is a chunk of q tokens whose prompt has ctx tokens so far (the default step
budget of 512 reads a 2,048-token prompt as four such chunks). Times are medians of interleaved
repeats, with their ranges; ratios are SDPA time / C time (above 1: the C kernel is faster).

Part 2 reads whole prompts (max_tokens 1, fresh prompts, prefix caching off, default budget) with
``LLM(runtime="native")`` and ``LLM(runtime="torch")``, each repeat in a fresh process per
runtime, runtimes alternating; it reports prompt tokens per second.

    python benchmarks/bench_prefill_attention.py [--lengths 512 1024 2048] [--repeats 5]
                                                 [--prefill-lengths 512 2048] [--no-prefill] [--publish]
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

THREADS = 2
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, SCALE = 9, 3, 64, 16, 64 ** -0.5
MARK = "BENCH_PREFILL_ATTENTION "


def attention_case(q_len: int, ctx: int):
    """Query rows, a bf16 paged cache with shuffled blocks, and the step's metadata."""
    import torch

    from ricllm.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(q_len * 7919 + ctx)
    blocks = -(-ctx // BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(blocks + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
                        for _ in range(2))
    tables = torch.randperm(blocks + 8, generator=gen)[:blocks].int()[None]
    query = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).bfloat16()
    meta = AttentionMetadata(slot_mapping=torch.zeros(q_len, dtype=torch.int64),
                             query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
                             context_lens=torch.tensor([ctx], dtype=torch.int32), block_tables=tables,
                             max_query_len=q_len, max_context_len=ctx)
    return query, k_cache, v_cache, meta


def contenders(q_len: int, ctx: int) -> dict:
    """name -> a call of one layer's attention for this case."""
    import torch
    import torch.nn.functional as F
    from ricllm.kernels import cpu_attention

    from ricllm.attention import reference

    query, k_cache, v_cache, meta = attention_case(q_len, ctx)
    args = (query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, SCALE)
    keys, values = (torch.randn(1, KV_HEADS, ctx, HEAD_DIM).bfloat16() for _ in range(2))
    q_heads = query.transpose(0, 1)[None]
    # a chunk after a cached prefix: SDPA's is_causal would align the corners wrongly, so the mask
    prefix_mask = None if q_len == ctx else (torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None])
    return {
        "C kernel": lambda: cpu_attention.cpu_paged_attention(*args),
        "paged kernel (before)": lambda: cpu_attention._attend("ricllm_paged_attention", *args),
        "SDPA, torch runtime path": lambda: reference.paged_attention(query, k_cache, v_cache, meta, SCALE),
        "SDPA, contiguous": lambda: F.scaled_dot_product_attention(
            q_heads, keys, values, attn_mask=prefix_mask, is_causal=prefix_mask is None, scale=SCALE,
            enable_gqa=True),
    }


def time_interleaved(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per call, each repeat running every contender once in turn (after one warm-up each)."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return times


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f} ({min(samples) * 1e3:.2f}–{max(samples) * 1e3:.2f})"


def attention_table(cases: list[tuple[int, int]], repeats: int) -> str:
    header = ("| q / ctx | C kernel (ms) | paged kernel, before (ms) | SDPA, torch runtime path (ms) | ratio | "
              "SDPA causal, contiguous K/V (ms) | ratio |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    for q_len, ctx in cases:
        t = time_interleaved(contenders(q_len, ctx), repeats)
        c = statistics.median(t["C kernel"])
        ratio = {name: statistics.median(t[name]) / c for name in t}
        lines.append(f"| {q_len} / {ctx} | {ms(t['C kernel'])} | {ms(t['paged kernel (before)'])} | "
                     f"{ms(t['SDPA, torch runtime path'])} | {ratio['SDPA, torch runtime path']:.2f} | "
                     f"{ms(t['SDPA, contiguous'])} | {ratio['SDPA, contiguous']:.2f} |")
    return "\n".join(lines) + "\n"


def prompt(length: int, seed: int) -> list[int]:
    draw = random.Random(seed)
    return [draw.randrange(100, 49_000) for _ in range(length)]


def child(runtime: str, lengths: list[int], seed: int) -> dict:
    """Prompt tokens per second of one whole prefill per length, after a warm-up prompt."""
    from ricllm import LLM, SamplingParams

    llm = LLM(runtime=runtime, kv_cache_budget="256MiB", enable_prefix_caching=False, threads=THREADS)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([prompt(300, seed=99)], once)
    rates = {}
    for length in lengths:
        started = time.perf_counter()
        llm.generate([prompt(length, seed=seed * 10_000 + length)], once)
        rates[length] = length / (time.perf_counter() - started)
    return rates


def run_child(runtime: str, lengths: list[int], seed: int) -> dict[int, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TQDM_DISABLE="1")
    print(f"[bench_prefill_attention] {runtime} runtime, repeat {seed} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--child", runtime, str(seed), *map(str, lengths)], env=env,
                          cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"bench_prefill_attention: the {runtime} child failed (exit {done.returncode}); its stderr is above")
    line = next(line for line in done.stdout.splitlines() if line.startswith(MARK))
    return {int(k): v for k, v in json.loads(line[len(MARK):]).items()}


def prefill_table(lengths: list[int], repeats: int) -> str:
    rates = {"native": [], "torch": []}
    for seed in range(repeats):
        for runtime, runs in rates.items():
            runs.append(run_child(runtime, lengths, seed))
    lines = ["| prompt tokens | native (tok/s) | torch (tok/s) | native / torch |", "|---:|---:|---:|---:|"]
    for length in lengths:
        native, torch_ = ([r[length] for r in rates[name]] for name in ("native", "torch"))
        lines.append(f"| {length} | {statistics.median(native):.0f} ({min(native):.0f}–{max(native):.0f}) | "
                     f"{statistics.median(torch_):.0f} ({min(torch_):.0f}–{max(torch_):.0f}) | "
                     f"{statistics.median(native) / statistics.median(torch_):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048],
                        help="whole-prompt lengths for the attention table (default: %(default)s)")
    parser.add_argument("--chunks", nargs="*", default=["512/1024", "512/2048"],
                        help="extra q/ctx cases: a chunk after a cached prefix (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats, at least 3 (default: %(default)s)")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[512, 2048],
                        help="prompt lengths of the whole-prefill table (default: %(default)s)")
    parser.add_argument("--no-prefill", action="store_true", help="skip the whole-prefill table (model runs)")
    parser.add_argument("--no-amx", action="store_true", help="measure as on a CPU without AMX (AMD Zen 4, older "
                        "Xeons): ricllm's kernels and torch's MKL/oneDNN (SDPA's products) capped below AMX")
    parser.add_argument("--publish", action="store_true", help="append the result to benchmarks/RESULTS.md")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.no_amx:  # before torch loads MKL; the children inherit it
        from benchmarks.cpu_caps import WITHOUT_AMX

        os.environ.update(WITHOUT_AMX)
    if args.child:
        runtime, seed, *lengths = args.child
        print(MARK + json.dumps(child(runtime, [int(n) for n in lengths], int(seed))), flush=True)
        return
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (medians of interleaved repeats)")
    import torch

    from benchmarks.results import publish

    torch.set_num_threads(THREADS)
    cases = [(n, n) for n in args.lengths] + [tuple(int(x) for x in c.split("/")) for c in args.chunks]
    body = "One layer's attention (9 query heads / 3 KV heads, head_dim 64, bf16), ms: median (range).\n\n"
    body += attention_table(cases, args.repeats)
    if not args.no_prefill:
        body += "\nWhole prefill, prompt tokens per second: median (range).\n\n"
        body += prefill_table(args.prefill_lengths, args.repeats)
    from ricllm.kernels.cpu_library import cpu_family

    caps = " (--no-amx: torch's MKL and oneDNN capped below AMX as well)" if args.no_amx else ""
    publish("Prefill attention: C kernel vs SDPA", f"Kernel family {cpu_family()}{caps}; {THREADS} threads; "
            f"{args.repeats} interleaved repeats.", body, append=args.publish)


if __name__ == "__main__":
    main()
