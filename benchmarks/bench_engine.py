"""ricllm vs HF transformers (bf16, fp32) vs llama.cpp on the same GGUF and prompts.

One run, peers side by side, 2 threads: batch 1, 8 and 32 with 256-token prompts and 128 new
tokens (TTFT, aggregate decode tok/s, total), plus a prefix-cache case (16 requests sharing a
1,024-token system prompt, each with its own 32-token question: TTFT cold vs warm).
Prints a markdown table and appends it to benchmarks/RESULTS.md.

    python benchmarks/bench_engine.py [--batches 1 8 32] [--skip-hf] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.results import publish  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 256, 128


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=gen).tolist() for _ in range(batch)]


def row(engine: str, batch: int, ttft_s: float, total_s: float) -> dict:
    decode = batch * (NEW_TOKENS - 1) / max(total_s - ttft_s, 1e-9)
    return dict(engine=engine, batch=batch, ttft_ms=ttft_s * 1000, decode_tps=decode, total_s=total_s)


# ------------------------------------------------------------------ ricllm

def bench_ricllm(model_path: Path, batches: list[int], dtype: str) -> list[dict]:
    from ricllm import LLM, SamplingParams

    llm = LLM(str(model_path), dtype=dtype, kv_cache_budget="1GiB", max_num_batched_tokens=2048)
    vocab = llm.engine.spec.vocab_size
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(random_prompts(2, 32, vocab, 99), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows = []
    for batch in batches:
        prompts = random_prompts(batch, PROMPT_LEN, vocab, seed=batch)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        total = time.perf_counter() - start
        rows.append(row(f"ricllm {dtype}", batch, max(o.ttft_s for o in outs), total))
    return rows


def bench_ricllm_prefix(model_path: Path) -> dict:
    from ricllm import LLM, SamplingParams

    llm = LLM(str(model_path), kv_cache_budget="1GiB")
    vocab = llm.engine.spec.vocab_size
    system = random_prompts(1, 1024, vocab, 7)[0]
    questions = random_prompts(16, 32, vocab, 8)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(1, 64, vocab, 9), params)  # warm-up, unrelated tokens
    cold = [llm.generate([system + q], params)[0].ttft_s for q in questions[:1]]
    warm = [llm.generate([system + q], params)[0] for q in questions[1:]]
    cold_nocache = LLM(str(model_path), kv_cache_budget="1GiB", enable_prefix_caching=False)
    cold += [cold_nocache.generate([system + q], params)[0].ttft_s for q in questions[1:4]]
    return dict(cold_ms=statistics.median(cold) * 1000,
                warm_ms=statistics.median(o.ttft_s for o in warm) * 1000,
                cached_tokens=warm[0].num_cached_tokens)


# ------------------------------------------------------------------ HF transformers

def bench_hf(model_path: Path, batches: list[int], dtype: torch.dtype) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype).eval()
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        model.generate(torch.tensor(random_prompts(1, 16, vocab, 99)), max_new_tokens=2, do_sample=False)
        for batch in batches:
            ids = torch.tensor(random_prompts(batch, PROMPT_LEN, vocab, seed=batch))
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            rows.append(row(f"HF transformers {str(dtype).removeprefix('torch.')}", batch, ttft,
                            time.perf_counter() - start))
    del model
    gc.collect()
    return rows


# ------------------------------------------------------------------ llama.cpp

def bench_llamacpp(model_path: Path) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), n_ctx=1024, n_threads=2, n_batch=512, verbose=False)
    prompt = random_prompts(1, PROMPT_LEN, llm.n_vocab(), seed=1)[0]
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    ttft_prefill = time.perf_counter() - start
    llm.reset()
    start = time.perf_counter()
    generated = 0
    first = None
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        generated += 1
        if first is None:
            first = time.perf_counter() - start
        if generated == NEW_TOKENS:
            break
    total = time.perf_counter() - start
    return [row("llama.cpp (llama-cpp-python, Q4_1)", 1, first or ttft_prefill, total)]


# ------------------------------------------------------------------ report

def table(rows: list[dict], baseline: dict[int, float]) -> str:
    lines = ["| engine | batch | TTFT (ms) | decode (tok/s, aggregate) | × HF bf16 decode | total (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["decode_tps"] / baseline[r["batch"]] if r["batch"] in baseline else float("nan")
        lines.append(f"| {r['engine']} | {r['batch']} | {r['ttft_ms']:.0f} | {r['decode_tps']:.1f} | "
                     f"{ratio:.2f}× | {r['total_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from ricllm.model.loader import default_model_path

    model_path = Path(args.model) if args.model else default_model_path()
    rows = bench_ricllm(model_path, args.batches, "bfloat16")
    if not args.skip_hf:
        rows += bench_hf(model_path, args.batches, torch.bfloat16)
        rows += bench_hf(model_path, args.batches, torch.float32)
    if not args.skip_llamacpp:
        try:
            rows += bench_llamacpp(model_path)
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp row skipped (pip install llama-cpp-python)")
    prefix = bench_ricllm_prefix(model_path)
    baseline = {r["batch"]: r["decode_tps"] for r in rows if r["engine"] == "HF transformers bfloat16"}
    text = table(rows, baseline)
    text += (f"\n\nPrefix cache (16 requests, shared 1,024-token system prompt + 32-token question, ricllm bf16): "
             f"TTFT cold {prefix['cold_ms']:.0f} ms, warm {prefix['warm_ms']:.1f} ms "
             f"({prefix['cold_ms'] / prefix['warm_ms']:.1f}× lower; {prefix['cached_tokens']} tokens from cache)")
    llama_rows = [r for r in rows if r["engine"].startswith("llama.cpp")]
    ours_b1 = [r for r in rows if r["engine"].startswith("ricllm") and r["batch"] == 1]
    if llama_rows and ours_b1:
        text += f"\nricllm / llama.cpp one-stream decode: {ours_b1[0]['decode_tps'] / llama_rows[0]['decode_tps']:.2f}×"
    publish("Engine benchmark", f"Model: {model_path.name}. {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, greedy.",
            text, append=not args.no_append)

if __name__ == "__main__":
    main()
