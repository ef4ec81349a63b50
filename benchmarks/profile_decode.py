"""One decode step of the native runtime taken apart, each part with its bytes and GB/s against the
machine's measured read bandwidth: the decoder stack's weight products, its paged attention, the
rest of the stack (norms, RoPE and the K/V store, SiLU, residuals), the packed head, and Python
(scheduling, the embedding lookup, sampling, outputs).

Per stream count, each round runs that many streams of --prompt-len random tokens through the
engine (``engine.step``; one step prefills them all, and the prompts are the same every round, so
after the first the prefix cache serves them) for --new-tokens tokens, and times every step in
which every stream decodes, the stack's C call and the head inside it (the mean context is prompt + new / 2: 320 tokens by
default, bench_cpu's roofline context). Then it replays the stack's parts on their own, each after
sweeping 64 MB so the last-level cache holds none of what they read: every layer's four products at
the step's row count, and every layer's attention over the step's block tables. The rest of the
stack is the stack's time less those two; Python is the step's less the stack's and the head's.

Bytes: the products read every packed weight with its scales (4-bit ones have no offsets); the
attention each stream's K and V rows of every layer; the head its packed weights and scales.
On a shared machine absolute times move with the load: the shares of the step and the GB/s
against the bandwidth measured in the same run are what carry over; rounds interleave the stream
counts and the tables give medians [min–max]. Where others load the machine, --threads 1
--cpu-time counts only the time this process ran.

    python benchmarks/profile_decode.py --avx2-only        # the avx2 family on any x86 CPU
    python benchmarks/profile_decode.py [--streams 1 32] [--rounds 3] [--threads 1 --cpu-time] [--no-publish]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

from benchmarks.cpu_caps import AVX2_ONLY  # noqa: E402  (stdlib only)

FLUSH_BYTES = 64 << 20  # twice this machine's L3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2 Q4_1)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the stream counts interleaved")
    parser.add_argument("--replays", type=int, default=5, help="replays of each part per round")
    parser.add_argument("--threads", type=int, default=2, help="the engine's and the kernels' threads (default 2)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time every part by this process's CPU time, not the wall clock: on a machine that "
                             "others load, the time it was not running is left out (with --threads 1, where no "
                             "thread waits on another, it is the work's own time)")
    parser.add_argument("--avx2-only", action="store_true",
                        help="as on an AVX2-only CPU: ricllm's avx2 family (cpu_caps.AVX2_ONLY)")
    parser.add_argument("--no-publish", action="store_true", help="print only; do not append to RESULTS.md")
    return parser.parse_args()


clock = time.perf_counter  # or time.process_time (--cpu-time)


class Timed:
    """A callable that adds each call's time to ``seconds``."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, *args, **kwargs):
        started = clock()
        result = self.inner(*args, **kwargs)
        self.seconds += clock() - started
        return result


class StepProfile:
    """The engine's decode steps with the stack's and the head's share of each, and the last
    decode step's batch (its block tables) for the replays."""

    def __init__(self, llm):
        self.engine = llm.engine
        self.model = self.engine.runtime.model
        self.stack, self.head = Timed(self.model._stack), Timed(self.model.compute_logits)
        self.model._stack, self.model.compute_logits = self.stack, self.head
        forward = self.model.forward
        self.last_flat = None

        def keep_flat(input_ids, positions, flat, lora=None):
            self.last_flat = flat
            return forward(input_ids, positions, flat, lora)

        self.model.forward = keep_flat

    def run(self, streams: int, prompt_len: int, new_tokens: int, seed: int) -> list[tuple[float, float, float]]:
        """(step, stack, head) seconds of every step in which every stream decodes."""
        from ricllm import SamplingParams

        vocab, draw = self.engine.spec.vocab_size, random.Random(seed)
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        seqs = [self.engine.add_request([draw.randrange(100, vocab - 100) for _ in range(prompt_len)], params)
                for _ in range(streams)]
        steps, flat = [], None
        while self.engine.has_unfinished():
            every = all(s.in_decode and not s.is_finished for s in seqs)
            self.stack.seconds = self.head.seconds = 0.0
            started = clock()
            self.engine.step()
            elapsed = clock() - started
            if every:
                steps.append((elapsed, self.stack.seconds, self.head.seconds))
                flat = self.last_flat
        self.last_flat = flat
        return steps


def read_bandwidth(threads: int, gib: int = 1, tries: int = 5) -> float:
    """Bytes/s of a read-only sweep over ``gib`` GiB by ``threads`` threads (numpy's reductions release the
    GIL), the best of ``tries``, on the profile's clock: bench_cpu's sweep, timed as the parts are."""
    import threading

    import numpy as np

    data = np.ones((gib << 30) // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(tries):
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        started = clock()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, (clock() - started) / (threads if clock is time.process_time else 1))
    return data.nbytes / best


def flush(buffer) -> None:
    """Read ``buffer`` (bigger than the last-level cache) so what a replay reads comes from memory."""
    import numpy as np

    np.add.reduce(buffer)


class Replays:
    """The stack's products and attention, on their own, at one decode step's shapes."""

    def __init__(self, model, kv_cache, flat, rows: int, threads: int):
        import numpy as np

        from ricllm.kernels.aligned import aligned_empty
        from ricllm.kernels.cpu_library import library

        self.lib, self.model, self.kv_cache, self.rows, self.threads = library(), model, kv_cache, rows, threads
        spec, rng = model.spec, np.random.default_rng(0)
        widest = max(spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim)

        def activations(width: int):
            values = (rng.standard_normal((rows, width)) * 0.5).astype(np.float32)
            out = aligned_empty((rows, width), np.uint16)
            out[:] = values.view(np.uint32) >> 16
            return out

        self.inputs = {width: activations(width) for width in {spec.hidden_size, spec.intermediate_size,
                                                               spec.num_heads * spec.head_dim}}
        self.out = aligned_empty((rows, max(3 * widest, 2 * spec.intermediate_size)), np.uint16)
        self.scratch = aligned_empty(2 * rows * widest + 8 * rows * (widest // 32 + 1), np.uint8)
        self.q = activations(spec.num_heads * spec.head_dim)
        self.attn_out = aligned_empty(self.q.shape, np.uint16)
        as_int32 = lambda values: np.ascontiguousarray(values, dtype=np.int32)  # noqa: E731
        self.tables, self.starts, self.lens = (as_int32(v) for v in (flat.block_tables, flat.query_start_loc,
                                                                     flat.context_lens))

    def product_bytes(self) -> int:
        return sum(p.decode_bytes for layer in self.model.weights.layers for p in layer.projections.values())

    def attention_bytes(self) -> int:
        spec = self.model.spec
        per_token = self.kv_cache.geometry.kv_format.bytes_per_token(spec)  # every layer's K and V
        return int(self.lens.sum()) * per_token

    def products(self) -> float:
        lib, rows = self.lib, self.rows
        started = clock()
        for layer in self.model.weights.layers:
            for p in layer.projections.values():
                k, n = p.scales.shape[1] * 32, p.out_features
                code = lib.ricllm_quant_gemm(self.inputs[k].ctypes.data, p.weight.ctypes.data, p.scales.ctypes.data,
                                             p.offsets.ctypes.data, p.bits, self.out.ctypes.data, rows, k, n, 1,
                                             self.scratch.ctypes.data, self.threads)
                assert code == 0, code
        return clock() - started

    def attention(self) -> float:
        from ricllm.kernels.decoder_stack_call import CACHE_TYPE_CODES

        spec, geometry = self.model.spec, self.kv_cache.geometry
        cache_type = CACHE_TYPE_CODES[geometry.kv_format.name]
        started = clock()
        for k, v in self.kv_cache.layers:
            code = self.lib.ricllm_attention(
                self.q.ctypes.data, k.ctypes.data, v.ctypes.data, self.attn_out.ctypes.data, self.tables.ctypes.data,
                self.starts.ctypes.data, self.lens.ctypes.data, self.lens.shape[0], spec.num_heads,
                spec.num_kv_heads, spec.head_dim, geometry.block_size, self.tables.shape[1], spec.attention_scale,
                1, cache_type, None, None, self.threads)
            assert code == 0, code
        return clock() - started


def measure_round(profile: StepProfile, streams: int, args, seed: int, flush_buffer) -> dict[str, float]:
    """One round at ``streams`` streams: the parts' median seconds per step."""
    steps = profile.run(streams, args.prompt_len, args.new_tokens, seed)
    replays = Replays(profile.model, profile.engine.runtime.kv_cache, profile.last_flat, streams, args.threads)
    products, attention = [], []
    for _ in range(args.replays):
        flush(flush_buffer)
        products.append(replays.products())
        flush(flush_buffer)
        attention.append(replays.attention())
    step, stack, head = (statistics.median(column) for column in zip(*steps))
    parts = {"step": step, "stack": stack, "products": statistics.median(products),
             "attention": statistics.median(attention), "head": head}
    parts["stack, the rest"] = stack - parts["products"] - parts["attention"]
    parts["Python"] = step - stack - head
    parts["bytes products"], parts["bytes attention"] = replays.product_bytes(), replays.attention_bytes()
    parts["bytes head"] = profile.model.weights.head.decode_bytes
    return parts


PARTS = ("products", "attention", "stack, the rest", "head", "Python", "step")
LABELS = {"products": "decoder stack: weight products", "attention": "decoder stack: paged attention",
          "stack, the rest": "decoder stack: the rest (norms, RoPE + K/V store, SiLU; by difference)",
          "head": "packed head (+ widening to fp32)", "Python": "Python (scheduler, embedding, sampling, outputs)",
          "step": "whole decode step"}


def span(values: list[float], scale: float, spec: str) -> str:
    median = statistics.median(values) * scale
    if len(values) == 1:
        return f"{median:{spec}}"
    return f"{median:{spec}} [{min(values) * scale:{spec}}–{max(values) * scale:{spec}}]"


def table(rounds: list[dict[str, float]], streams: int, bandwidth: float) -> str:
    lines = [f"{streams} stream{'s' if streams > 1 else ''}:", "",
             "| part | ms per step | share of the step | MB read | GB/s | of the measured bandwidth |",
             "|---|---:|---:|---:|---:|---:|"]
    for part in PARTS:
        times = [r[part] for r in rounds]
        shares = [r[part] / r["step"] for r in rounds]
        key = f"bytes {part}" if part in ("products", "attention", "head") else None
        if part == "step":
            key = "step bytes"
            for r in rounds:
                r[key] = r["bytes products"] + r["bytes attention"] + r["bytes head"]
        mb = gbs = fraction = "–"
        if key:
            nbytes = rounds[0][key]
            rates = [r[key] / r[part] for r in rounds]
            mb, gbs = f"{nbytes / 1e6:.1f}", span(rates, 1e-9, ".1f")
            fraction = span([rate / bandwidth for rate in rates], 100, ".0f") + "%"
        lines.append(f"| {LABELS[part]} | {span(times, 1e3, '.3f')} | {span(shares, 100, '.0f')}% | {mb} | {gbs} "
                     f"| {fraction} |")
    return "\n".join(lines)


def main() -> None:
    global clock
    args = parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.avx2_only:
        os.environ.update(AVX2_ONLY)
    import numpy as np

    from ricllm import LLM
    from ricllm.kernels.cpu_library import kernel_family
    from ricllm.model.loader import default_model_path

    model = Path(args.model).resolve() if args.model else default_model_path()
    llm = LLM(str(model), runtime="native", weights="auto", threads=args.threads, kv_cache_budget="512MiB",
              max_num_seqs=max(args.streams), max_num_batched_tokens=max(args.streams) * args.prompt_len)
    profile = StepProfile(llm)
    profile.run(1, 16, 4, seed=0)  # warm-up
    flush_buffer = np.ones(FLUSH_BYTES // 8, dtype=np.int64)
    bandwidth = read_bandwidth(threads=args.threads)
    rounds: dict[int, list[dict[str, float]]] = {n: [] for n in args.streams}
    for round_index in range(args.rounds):
        order = args.streams[round_index % len(args.streams):] + args.streams[:round_index % len(args.streams)]
        for streams in order:
            parts = measure_round(profile, streams, args, seed=0, flush_buffer=flush_buffer)
            rounds[streams].append(parts)
            print(f"[profile_decode] round {round_index + 1}, {streams} streams: step {parts['step'] * 1e3:.2f} ms, "
                  f"products {parts['products'] * 1e3:.2f}, attention {parts['attention'] * 1e3:.2f}, "
                  f"head {parts['head'] * 1e3:.2f}", file=sys.stderr, flush=True)
    weights = llm.engine.runtime.weight_formats
    details = (f"ricllm kernel family: {kernel_family()}. Model: {model.name} ({weights[0]} layers, {weights[1]} head), "
               f"native runtime, {args.threads} thread{'s' if args.threads > 1 else ''}, timed by "
               f"{'CPU time' if args.cpu_time else 'the wall clock'}. {args.prompt_len}-token prompts, {args.new_tokens} new tokens "
               f"(mean decode context {args.prompt_len + args.new_tokens / 2:g}); {args.rounds} rounds, stream "
               f"counts interleaved, median [min–max] over the rounds (each round: the median step, and the "
               f"median of {args.replays} replays). Read bandwidth {bandwidth / 1e9:.1f} GB/s (bench_cpu's sweep: "
               f"1 GiB read-only by {args.threads} thread{'s' if args.threads > 1 else ''}, best of 5, on the same "
               f"clock). The parts' times are replays (each after a 64 MB sweep), the rest of the stack the "
               f"difference: negative where the replays, colder and one call per product, take longer than "
               f"the stack.")
    body = "\n\n".join(table(rounds[n], n, bandwidth) for n in args.streams)
    from benchmarks.results import publish

    publish("Decode step profile", details, body, append=not args.no_publish)


if __name__ == "__main__":
    main()
