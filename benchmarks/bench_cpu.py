"""The CPU benchmark: ricllm (int4, int8, bf16 weights; native and torch runtimes) vs llama.cpp vs HF transformers.

One run, peers side by side, on the same GGUF (default: the installed SmolLM2-135M-Instruct
Q4_1) and the same prompts, 2 threads everywhere (ricllm threads=2, llama.cpp
n_threads=2, OMP_NUM_THREADS=2 in every child). Each engine configuration runs in its own
subprocess, which prints one JSON line; this process collects them and prints the tables.

Measured, for every engine:
  1. one stream: a 256-token prompt, 128 new tokens, greedy, EOS ignored: decode tok/s;
  2. aggregate decode tok/s at 8, 16 and 32 streams (each stream its own 256-token prompt,
     128 new tokens). Decode tok/s = streams * (new - 1) / (total - time to the last stream's
     first token): ricllm from one generate() (its TTFTs); HF from two generate() calls (1 and
     128 new tokens); llama.cpp from its own loop: one batch prefills every stream, then each
     step decodes one token of every stream in one llama_decode (one seq_id per stream, as
     llama-batched-bench does), argmax over the logits;
  3. prompt throughput: tokens/s prefilling one 512-token prompt and sampling its first token
     (median of 3 different prompts);
  4. time to ready: wall time from starting a fresh process to a model ready to generate.
     ricllm twice per format: first start (RICLLM_CACHE_DIR is an empty temporary folder, so it
     converts the GGUF and writes the weight cache) and second start (reads that cache);
  5. peak RSS: VmHWM of the measuring child (its own peak), in MB (10^6 bytes). Not ru_maxrss:
     Linux carries the forking parent's peak into a child's ru_maxrss across exec, so every
     child would read at least this script's own peak (it imports torch).

ricllm: LLM(model, dtype="bfloat16", weights=W, kv_cache_budget="256MiB", runtime=R). On a Q4_1
file weights="int4" resolves to int4 layers + int8 head, which is what "auto" gives; with the
native runtime (no torch in the process) it is what LLM() runs by default here (labelled).
llama.cpp runs in a child of the system python (llama-cpp-python is not in the venv).
Prompts are fixed-seed random token ids in [100, vocab - 100), identical for every engine.
The summary and ratios (ricllm / llama.cpp) are appended to benchmarks/RESULTS.md.

    python benchmarks/bench_cpu.py                      # full run (tens of minutes on 2 cores)
    python benchmarks/bench_cpu.py --quick              # smoke test: tiny sizes, prints only
    python benchmarks/bench_cpu.py [--configs int4:native int4:torch int8:native bf16:torch] [--skip-hf] [--skip-llamacpp] [--no-publish]

This file is also the children's program (``--child measure|ready``, spec as JSON on stdin):
its module level imports only the standard library, so the system python can run it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
THREADS = 2
KV_BUDGET = "256MiB"
SYSTEM_PYTHON = "/root/.pyenv/versions/3.11.7/bin/python3"
RESULT_MARK, READY_MARK = "BENCH_RESULT ", "BENCH_READY "
FULL = dict(prompt_len=256, new_tokens=128, streams=[1, 8, 16, 32], prefill_len=512, prefill_repeats=3)
QUICK = dict(prompt_len=32, new_tokens=8, streams=[1, 4], prefill_len=32, prefill_repeats=1)
TARGETS = dict(one_stream=1.0, max_streams=2.0, prompt=3.0, ready_s=3.0, rss_mb=600.0)


def progress(message: str) -> None:
    print(f"[bench_cpu] {message}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    """This process's own peak RSS in MB (10^6 bytes): VmHWM, in KiB."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / 1e6
    except (OSError, StopIteration):  # not Linux: ru_maxrss (which may include the parent's, see above)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


# ================================================================== engines (run in the children)

class RicllmEngine:
    """ricllm's offline API with one weight format."""

    def __init__(self, spec: dict):
        from ricllm import LLM, SamplingParams  # no torch import here: the native runtime runs without it

        self.params = SamplingParams
        self.llm = LLM(spec["model"], dtype="bfloat16", weights=spec["weights"], kv_cache_budget=KV_BUDGET,
                       threads=THREADS, runtime=spec["runtime"])
        assert self.llm.engine.runtime.name == spec["runtime"], self.llm.engine.runtime.why
        self.preemptions: dict[int, int] = {}

    def describe(self) -> dict:
        engine = self.llm.engine
        return dict(formats=list(engine.runtime.weight_formats), weights_from=engine.runtime.weights_source,
                    preemptions=self.preemptions, torch_imported="torch" in sys.modules)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        before = self.llm.kv_cache_stats()["preemptions"]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        total = time.perf_counter() - start
        assert all(len(o.token_ids) == new_tokens for o in outs)
        self.preemptions[len(prompts)] = self.llm.kv_cache_stats()["preemptions"] - before
        self.first_tokens = outs[0].token_ids
        return max(o.ttft_s for o in outs), total

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.llm.generate([prompt], self.params(max_tokens=1, temperature=0, ignore_eos=True))
        return time.perf_counter() - start


class HFEngine:
    """HF transformers, bf16, loading the same GGUF (dequantized)."""

    def __init__(self, spec: dict):
        import torch

        torch.set_num_threads(THREADS)
        from transformers import AutoModelForCausalLM

        self.torch = torch
        model = Path(spec["model"])
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model.parent), gguf_file=model.name, dtype=torch.bfloat16).eval()

    def describe(self) -> dict:
        import transformers

        return dict(version=transformers.__version__)

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = self.torch.tensor(prompts)
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.model.config.eos_token_id)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new_tokens
        self.first_tokens = out[0, ids.shape[1]:].tolist()
        return elapsed

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        first = self._generate(prompts, 1)
        return first, self._generate(prompts, new_tokens)

    def prefill(self, prompt: list[int]) -> float:
        return self._generate([prompt], 1)


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: every stream in one llama_decode per step."""

    def __init__(self, spec: dict):
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(spec["model"].encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['model']}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = 512
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        streams = max(spec["streams"])
        self.decode_ctx = self._context(streams, spec["prompt_len"] + spec["new_tokens"])
        self.context_params = dict(n_ctx=self.lib.llama_n_ctx(self.decode_ctx), n_seq_max=streams, n_batch=self.n_batch)
        self.prefill_ctx = None
        self.prefill_len = spec["prefill_len"]

    def _context(self, n_seq_max: int, tokens_per_seq: int):
        """A context with its own KV stream per sequence, each rounded up to 256 cells as llama.cpp does."""
        params = self.lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_seq_max * -(-tokens_per_seq // 256) * 256, n_seq_max
        params.n_batch, params.n_ubatch = self.n_batch, self.n_batch
        params.n_threads = params.n_threads_batch = THREADS
        params.kv_unified = False  # one KV stream per sequence, as llama-batched-bench by default
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {params.n_ctx}, n_seq_max {n_seq_max})")
        return ctx

    def describe(self) -> dict:
        return dict(version=self.lib.__version__, context=self.context_params)

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (token, position, seq_id, wants_logits) entries; argmax of every requested row."""
        import numpy as np

        chosen = []
        for begin in range(0, len(entries), self.n_batch):
            chunk = entries[begin:begin + self.n_batch]
            self._fill_batch(chunk)
            if self.lib.llama_decode(ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows = sum(1 for *_, wants in chunk if wants)
            if rows:
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(rows, self.n_vocab))
                chosen += logits.argmax(axis=1).tolist()
        return chosen

    def _fill_batch(self, chunk: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (token, position, seq, wants) in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        batch.n_tokens = len(chunk)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        ctx = self.decode_ctx
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        start = time.perf_counter()
        tokens = self._decode(ctx, [(t, pos, seq, pos == len(p) - 1)
                                    for seq, p in enumerate(prompts) for pos, t in enumerate(p)])
        first, self.first_tokens = time.perf_counter() - start, [tokens[0]]
        for step in range(1, new_tokens):
            tokens = self._decode(ctx, [(t, len(prompts[seq]) + step - 1, seq, True) for seq, t in enumerate(tokens)])
            self.first_tokens.append(tokens[0])
        return first, time.perf_counter() - start

    def prefill(self, prompt: list[int]) -> float:
        if self.prefill_ctx is None:
            self.prefill_ctx = self._context(1, self.prefill_len + 1)
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.prefill_ctx), True)
        start = time.perf_counter()
        self._decode(self.prefill_ctx, [(t, pos, 0, pos == len(prompt) - 1) for pos, t in enumerate(prompt)])
        return time.perf_counter() - start


ENGINES = {"ricllm": RicllmEngine, "hf": HFEngine, "llamacpp": LlamaCppEngine}


def measure(spec: dict) -> dict:
    """Every measurement of one configuration, in this process."""
    engine = ENGINES[spec["engine"]](spec)
    engine.generate(spec["warmup"], 4)  # warm-up, not measured
    new, decode = spec["new_tokens"], {}
    for streams, prompts in spec["decode_prompts"].items():
        first, total = engine.generate(prompts, new)
        decode[streams] = int(streams) * (new - 1) / max(total - first, 1e-9)
        progress(f"{spec['label']}: {streams} stream(s): {decode[streams]:.1f} decode tok/s "
                 f"(prefill {first:.2f} s, total {total:.2f} s; stream 0 starts {engine.first_tokens[:4]})")
    prompt_tps = statistics.median(len(p) / engine.prefill(p) for p in spec["prefill_prompts"])
    progress(f"{spec['label']}: prompt {spec['prefill_len']} tokens: {prompt_tps:.0f} tok/s")
    return dict(decode_tps=decode, prompt_tps=prompt_tps, peak_rss_mb=peak_rss_mb(), **engine.describe())


def child_main(mode: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    spec = json.loads(sys.stdin.read())
    if mode == "ready":
        engine = ENGINES[spec["engine"]](spec)
        print(READY_MARK + json.dumps(dict(engine.describe(), rss_at_ready_mb=peak_rss_mb())), flush=True)
    else:
        print(RESULT_MARK + json.dumps(measure(spec)), flush=True)


# ================================================================== the parent: run children

def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Fixed-seed token ids away from both ends of the vocabulary (special tokens sit at the start)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def workload_spec(model: Path, vocab: int, sizes: dict) -> dict:
    """Everything a measuring child needs besides its engine: sizes and the shared prompts."""
    decode = {str(s): random_prompts(s, sizes["prompt_len"], vocab, seed=1000 + s) for s in sizes["streams"]}
    return dict(model=str(model), **sizes, warmup=random_prompts(1, 16, vocab, seed=999), decode_prompts=decode,
                prefill_prompts=random_prompts(sizes["prefill_repeats"], sizes["prefill_len"], vocab, seed=2000))


def child_env(cache_dir: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1",
               TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    if cache_dir is not None:
        env["RICLLM_CACHE_DIR"] = cache_dir
    return env


def run_child(python: str, mode: str, spec: dict, env: dict) -> tuple[float, dict | None]:
    """Start ``python bench_cpu.py --child MODE``; (seconds until its marked line, that line's JSON)."""
    mark = READY_MARK if mode == "ready" else RESULT_MARK
    start = time.perf_counter()
    proc = subprocess.Popen([python, str(THIS), "--child", mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    elapsed, payload = 0.0, None
    for line in proc.stdout:
        if line.startswith(mark) and payload is None:
            elapsed, payload = time.perf_counter() - start, json.loads(line[len(mark):])
    if proc.wait() != 0 or payload is None:
        progress(f"{spec['label']}: child ({mode}) failed with exit status {proc.returncode}; see its stderr above")
        return elapsed, None
    return elapsed, payload


def time_to_ready(python: str, spec: dict, env: dict, which: str) -> tuple[float | None, float | None]:
    """(seconds from process start to a loaded model, peak RSS in MB at that point)."""
    slim = {k: v for k, v in spec.items() if not k.endswith("prompts") and k != "warmup"}
    elapsed, info = run_child(python, "ready", slim, env)
    if info is None:
        return None, None
    progress(f"{spec['label']}: ready ({which}) in {elapsed:.2f} s, RSS {info['rss_at_ready_mb']:.0f} MB "
             f"{info.get('weights_from', '')}")
    return elapsed, info["rss_at_ready_mb"]


def bench_config(python: str, spec: dict, cache_dir: str | None = None) -> dict | None:
    """Time to ready (twice for ricllm: converting, then from the weight cache), then the measurements."""
    env = child_env(cache_dir)
    ready = dict(zip(("ready_s", "rss_first_start_mb"), time_to_ready(python, spec, env, "first start")))
    ready["rss_at_ready_mb"] = ready["rss_first_start_mb"]
    if spec["engine"] == "ricllm":
        ready.update(zip(("ready_cached_s", "rss_at_ready_mb"), time_to_ready(python, spec, env, "weight cache")))
    _, result = run_child(python, "measure", spec, env)
    if result is None:
        return None
    progress(f"{spec['label']}: peak RSS {result['peak_rss_mb']:.0f} MB")
    return dict(label=spec["label"], engine=spec["engine"], **ready, **result)


def bench_ricllm(base: dict, weights: str, runtime: str, auto_formats: tuple[str, str]) -> dict | None:
    spec = dict(base, engine="ricllm", weights=weights, runtime=runtime, label=f"ricllm {weights} {runtime}")
    with tempfile.TemporaryDirectory(prefix="ricllm-bench-cache-") as cache_dir:
        result = bench_config(sys.executable, spec, cache_dir)
    if result is not None:
        layers, head = result["formats"]
        default = (layers, head) == auto_formats and runtime == "native"  # what LLM() runs on this CPU
        result["label"] += f" ({layers} layers, {head} head{'; the default' if default else ''})"
        result["is_default"] = default
    return result


def llamacpp_available(python: str) -> bool:
    try:
        check = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
        reason = (check.stderr.strip().splitlines() or [""])[-1] if check.returncode else None
    except OSError as error:
        reason = str(error)
    if reason is not None:
        progress(f"SKIP llama.cpp: `import llama_cpp` fails under {python} ({reason}); "
                 f"install llama-cpp-python there or pass --llamacpp-python")
    return reason is None


def model_facts(model: Path) -> tuple[int, tuple[str, str]]:
    """(vocabulary size, what weights="auto" resolves to on this file), from its metadata."""
    from ricllm.model.formats import resolve_formats
    from ricllm.model.loader import open_checkpoint

    checkpoint = open_checkpoint(model)
    return checkpoint.spec.vocab_size, resolve_formats("auto", checkpoint.tensor_types(), packable=True)


def run_all(args, model: Path, sizes: dict) -> list[dict]:
    vocab, auto_formats = model_facts(model)
    base = workload_spec(model, vocab, sizes)
    results = [bench_ricllm(base, *config.split(":"), auto_formats) for config in args.configs]
    if not args.skip_llamacpp and llamacpp_available(args.llamacpp_python):
        results.append(bench_config(args.llamacpp_python, dict(base, engine="llamacpp", label="llama.cpp Q4_1")))
    if not args.skip_hf:
        results.append(bench_config(sys.executable, dict(base, engine="hf", label="HF transformers bf16")))
    return [r for r in results if r is not None]


# ================================================================== report

def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def side_by_side(results: list[dict], sizes: dict) -> str:
    lines = ["| measurement | " + " | ".join(r["label"] for r in results) + " |",
             "|---|" + "---:|" * len(results)]

    def add(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    for s in sizes["streams"]:
        name = "decode, 1 stream (tok/s)" if s == 1 else f"decode, {s} streams aggregate (tok/s)"
        add(name, [fmt(r["decode_tps"].get(str(s))) for r in results])
    add(f"prompt, {sizes['prefill_len']}-token prefill (tok/s)", [fmt(r["prompt_tps"], ".0f") for r in results])
    add("time to ready, first start (s)", [fmt(r["ready_s"], ".2f") for r in results])
    add("time to ready, from weight cache (s)", [fmt(r.get("ready_cached_s"), ".2f") for r in results])
    add("peak RSS to ready, first start (MB; ricllm: converting)", [fmt(r.get("rss_first_start_mb"), ".0f")
                                                                    for r in results])
    add("RSS when ready (MB; ricllm: from weight cache)", [fmt(r["rss_at_ready_mb"], ".0f") for r in results])
    add("peak RSS, whole run (MB)", [fmt(r["peak_rss_mb"], ".0f") for r in results])
    return "\n".join(lines)


def ratio_rows(ours: dict, llama: dict, sizes: dict) -> list[tuple[str, float, str]]:
    """(measurement, ricllm / llama.cpp, the issue's target) rows."""
    targets = {1: f"≥ {TARGETS['one_stream']:g}×", 32: f"≥ {TARGETS['max_streams']:g}×"}
    rows = [(f"decode, {s} stream{'s' if s > 1 else ''}", ours["decode_tps"][str(s)] / llama["decode_tps"][str(s)],
             targets.get(s, "–")) for s in sizes["streams"]]
    rows.append((f"prompt ({sizes['prefill_len']} tokens)", ours["prompt_tps"] / llama["prompt_tps"],
                 f"≥ {TARGETS['prompt']:g}×"))
    return rows


def ratio_table(results: list[dict], sizes: dict) -> str:
    llama = next((r for r in results if r["engine"] == "llamacpp"), None)
    ours = [r for r in results if r["engine"] == "ricllm"]
    if llama is None or not ours:
        return "No ratios: llama.cpp was not measured."
    per_config = [ratio_rows(r, llama, sizes) for r in ours]
    lines = ["| ricllm / llama.cpp | " + " | ".join(r["label"] for r in ours) + " | target (default formats) |",
             "|---|" + "---:|" * len(ours) + "---|"]
    for i, (name, _, target) in enumerate(per_config[0]):
        lines.append(f"| {name} | " + " | ".join(f"{rows[i][1]:.2f}×" for rows in per_config) + f" | {target} |")
    return "\n".join(lines)


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "MISSED")


def target_checks(ours: dict, llama: dict | None) -> list[tuple[str, float | None, float, str, bool]]:
    """(name, measured, target, unit, at least?) for the issue's targets; RSS is the whole run's peak."""
    def vs_llama(value: float | None, reference: float | None) -> float | None:
        return None if value is None or reference is None else value / reference

    def decode(r: dict | None, streams: str) -> float | None:
        return None if r is None else r["decode_tps"].get(streams)

    return [
        ("one-stream decode vs llama.cpp", vs_llama(decode(ours, "1"), decode(llama, "1")), TARGETS["one_stream"], "×", True),
        ("32-stream aggregate decode vs llama.cpp", vs_llama(decode(ours, "32"), decode(llama, "32")),
         TARGETS["max_streams"], "×", True),
        ("prompt throughput vs llama.cpp", vs_llama(ours["prompt_tps"], llama and llama["prompt_tps"]),
         TARGETS["prompt"], "×", True),
        ("time to ready (from weight cache)", ours.get("ready_cached_s"), TARGETS["ready_s"], " s", False),
        ("peak RSS", ours["peak_rss_mb"], TARGETS["rss_mb"], " MB", False)]


def target_lines(results: list[dict]) -> str:
    """The issue's targets against the default-format ricllm configuration."""
    ours = next((r for r in results if r.get("is_default")), None)
    if ours is None:
        return "Targets: not checked (the default-format configuration, int4 on a Q4_1 file, was not run)."
    llama = next((r for r in results if r["engine"] == "llamacpp"), None)
    lines = [f"Targets ({ours['label']}, {KV_BUDGET} KV):"]
    for name, value, target, unit, at_least in target_checks(ours, llama):
        ok = None if value is None else (value >= target if at_least else value <= target)
        lines.append(f"- {name}: {fmt(value, '.0f' if unit == ' MB' else '.2f', unit)} (target {'≥' if at_least else '≤'} {target:g}{unit}): "
                     f"{verdict(ok)}")
    return "\n".join(lines)


def notes(results: list[dict]) -> str:
    lines = []
    for r in results:
        preempted = {s: n for s, n in (r.get("preemptions") or {}).items() if n}
        if preempted:
            lines.append(f"{r['label']}: KV preemptions (streams: count) {preempted} under the {KV_BUDGET} budget.")
        if r["engine"] == "ricllm":
            lines.append(f"{r['label']}: torch {'was' if r.get('torch_imported') else 'was not'} imported by the serving process.")
        if r["engine"] == "llamacpp":
            lines.append(f"llama.cpp: llama-cpp-python {r['version']}, decode context {r['context']} (llama.cpp "
                         f"rounds each sequence's KV up to a multiple of 256 cells), one KV stream per sequence, "
                         f"f16 KV, default flash-attention setting.")
        if r["engine"] == "hf":
            lines.append(f"HF: transformers {r['version']}, `generate` with min_new_tokens; its TTFT is a separate "
                         f"1-token `generate`.")
    return "\n".join(lines)


def report(results: list[dict], sizes: dict, model: Path, append: bool) -> None:
    from benchmarks.results import publish

    body = "\n\n".join(part for part in (side_by_side(results, sizes), ratio_table(results, sizes),
                                         target_lines(results), notes(results)) if part)
    details = (f"Model: {model.name}. {sizes['prompt_len']}-token prompts, {sizes['new_tokens']} new tokens, "
               f"greedy, EOS ignored; prompt throughput: one {sizes['prefill_len']}-token prompt "
               f"(median of {sizes['prefill_repeats']}); ricllm KV budget {KV_BUDGET}; "
               f"each configuration in its own process.")
    publish("CPU benchmark: ricllm vs llama.cpp vs HF", details, body, append=append)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2 Q4_1)")
    parser.add_argument("--configs", nargs="+", default=["int4:native", "int4:torch", "int8:native", "bf16:torch"],
                        choices=[f"{w}:{r}" for w in ("auto", "int4", "int8", "bf16") for r in ("native", "torch")],
                        help="ricllm configurations, WEIGHTS:RUNTIME (bf16 runs on torch only; default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (32-token prompts, 8 new "
                        "tokens, streams 1 and 4); never publishes")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--llamacpp-python", default=SYSTEM_PYTHON, help="interpreter with llama-cpp-python")
    parser.add_argument("--no-publish", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", choices=["measure", "ready"], help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(args.child)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(THREADS)  # also what results.machine() reports
    from ricllm.model.loader import default_model_path

    model = Path(args.model).resolve() if args.model else default_model_path()
    sizes = QUICK if args.quick else FULL
    results = run_all(args, model, sizes)
    if not results:
        sys.exit("no configuration produced results")
    report(results, sizes, model, append=not (args.quick or args.no_publish))


if __name__ == "__main__":
    main()
