#!/usr/bin/env python3
"""The ONNX runtime's CUDA path on one NVIDIA GPU: parity with the torch runtime on CUDA, then tokens/s.

Run from the repository root: ``python benchmarks/gpu_onnx.py [--model GGUF] [--streams 1 8 32] [--out FILE]``.
It needs ONNX Runtime's CUDA build (``pip install 'ricllm[onnx-gpu]'``, which brings NVIDIA's CUDA and
cuDNN wheels) and, for the parity half and the torch rows, torch with CUDA in the same environment
(``pip install torch`` after it: its Linux wheel is the CUDA build). Without torch the ONNX rows still run.

1. Parity: the same greedy requests through ``runtime="onnx", device="cuda"`` (the paged graph: the
   file's int4/int8 MatMulNBits in fp32, each layer's attention one PagedAttention in fp16 over the fp16
   pool, bound in place with IO binding) and ``runtime="torch", device="cuda", dtype="float32"`` with the
   torch reference attention (the reference): the largest logit difference at each request's first
   sampled position (the same context in both), and greedy agreement (the generated tokens before each
   request's first difference, of all).
2. Speed: ``--streams`` requests at once (default 1, 8 and 32) of ``--prompt-len`` random tokens, each
   generating ``--new-tokens`` greedily (ignore_eos), after one warm-up run: decode tokens/s (the tokens
   after the first, over the time after the last first token) and end-to-end tokens/s, for the ONNX
   runtime and the torch runtime at its CUDA default (bfloat16).

The table names the machine (GPU, driver, CPU) and the versions. On a machine without an NVIDIA GPU, or
without ONNX Runtime's CUDA build, it prints why it did not run and exits 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package


def gpu_names() -> list[str]:
    """``name, memory, driver`` of each NVIDIA GPU nvidia-smi lists (none: no driver, or no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    done = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def why_not() -> str | None:
    """Why the CUDA path cannot run here (None: it can)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "ONNX Runtime is not installed: pip install 'ricllm[onnx-gpu]'"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"this ONNX Runtime ({ort.__version__}) is not the CUDA build (it offers "
                f"{', '.join(ort.get_available_providers())}): pip install 'ricllm[onnx-gpu]' in place of "
                "ricllm[onnx] (both install the module onnxruntime)")
    if not gpu_names():
        return "no NVIDIA GPU here (nvidia-smi lists none)"
    return None


def torch_cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA GPU"


def machine() -> str:
    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    torch_version = "absent"
    if torch_cuda_problem() is None:
        import torch

        torch_version = f"{torch.__version__} (CUDA {torch.version.cuda})"
    return (f"{'; '.join(gpu_names())}; {cpu}, {os.cpu_count()} cores; onnxruntime-gpu {ort.__version__}; "
            f"torch {torch_version}")


class FirstLogits:
    """The logits of each request's first sampled position, recorded from the runner's output."""

    def __init__(self, llm):
        import numpy as np

        self.rows: dict[str, np.ndarray] = {}
        runner = llm.engine.runtime.runner
        original = runner.run

        def run(batch, allowed=None):
            logits, rows = original(batch) if allowed is None else original(batch, allowed)
            sampled = [seq for seq, n in batch.items if seq.num_computed_tokens + n == seq.num_tokens]
            for seq, row in zip(sampled, logits):
                if seq.request_id not in self.rows:
                    self.rows[seq.request_id] = np.asarray(row.float().cpu() if hasattr(row, "float") else row,
                                                           dtype=np.float32)
            return logits, rows

        runner.run = run


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(count)]


def parity(onnx_llm, torch_llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
    """(largest |Δlogit| at the first sampled positions, agreeing greedy tokens, generated tokens)."""
    import numpy as np

    from ricllm import SamplingParams

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs, firsts = [], []
    for llm in (onnx_llm, torch_llm):
        recorder = FirstLogits(llm)
        outs = llm.generate(prompts, greedy)
        outputs.append([o.token_ids for o in outs])
        firsts.append([recorder.rows[o.request_id] for o in outs])
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*firsts))
    agree = 0
    for ours, theirs in zip(*outputs):
        agree += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return difference, agree, sum(len(t) for t in outputs[0])


def throughput(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, end-to-end tokens/s) of one run of ``prompts`` together."""
    from ricllm import SamplingParams

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy)
    total = time.perf_counter() - start
    first = max(o.ttft_s for o in outs)
    return len(prompts) * (new_tokens - 1) / max(total - first, 1e-9), len(prompts) * new_tokens / total


def run(args: argparse.Namespace) -> list[str]:
    from ricllm import LLM

    onnx_llm = LLM(args.model, runtime="onnx", device=args.device, kv_cache_budget=args.kv_cache_budget)
    runtime = onnx_llm.engine.runtime
    layers, head = runtime.weight_formats
    lines = [f"Machine: {machine()}.", "",
             f"Model: {runtime.spec.name} ({args.model or 'the installed SmolLM2 GGUF'}); ONNX runtime: layers "
             f"{layers}, head {head}, attention {runtime.attention_backend} in {runtime.dtype}, pool "
             f"{runtime.dtype} on {runtime.device}; {args.prompt_len}-token random prompts, {args.new_tokens} "
             "greedy tokens each.", ""]
    vocab = runtime.spec.vocab_size
    problem = torch_cuda_problem()
    torch_llm = None
    if problem is None:
        reference = LLM(args.model, runtime="torch", device=args.device, dtype="float32",
                        attention_backend="torch", kv_cache_budget=args.kv_cache_budget)
        difference, agree, total = parity(onnx_llm, reference, random_prompts(8, args.prompt_len, vocab, 1),
                                          args.new_tokens)
        lines += [f"Parity against the torch runtime on CUDA in float32 (reference attention): max |Δlogit| "
                  f"{difference:.4g} at the first sampled positions; greedy agreement {agree}/{total} = "
                  f"{agree / total:.1%} tokens.", ""]
        del reference
        torch_llm = LLM(args.model, runtime="torch", device=args.device, kv_cache_budget=args.kv_cache_budget)
    else:
        lines += [f"Parity and torch rows not run: {problem}.", ""]
    lines += ["| streams | onnx decode tok/s | onnx end-to-end tok/s | torch decode tok/s | torch end-to-end tok/s |"
              " onnx / torch (decode) |", "|---:|---:|---:|---:|---:|---:|"]
    for streams in args.streams:
        prompts = random_prompts(streams, args.prompt_len, vocab, 100 + streams)
        row = []
        for llm in (onnx_llm, torch_llm):
            if llm is None:
                row.append(None)
                continue
            throughput(llm, prompts, args.new_tokens)  # warm-up: kernels chosen, memory arenas grown
            row.append(throughput(llm, prompts, args.new_tokens))
        ours, theirs = row
        torch_cells = f"{theirs[0]:.0f} | {theirs[1]:.0f} | {ours[0] / theirs[0]:.2f}×" if theirs else "- | - | -"
        lines.append(f"| {streams} | {ours[0]:.0f} | {ours[1]:.0f} | {torch_cells} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Llama-family GGUF; default: the installed SmolLM2-135M")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (default: cuda)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="requests at once (default 1 8 32)")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per random prompt (default 128)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    parser.add_argument("--kv-cache-budget", default="1GiB", help="each runtime's KV pool (default 1GiB)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    reason = why_not()
    if reason is not None:
        print(f"benchmarks/gpu_onnx.py did not run: {reason}.")
        return 0
    text = "\n".join(run(args))
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
