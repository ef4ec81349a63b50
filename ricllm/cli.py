"""``ricllm`` command line: every subcommand is a thin layer over the public API."""

from __future__ import annotations

import argparse
import json
import sys

from ricllm.errors import ConfigError, RicllmError
from ricllm.plan import add_subparser as add_plan_subparser
from ricllm.replay.runner import add_replay_subparser
from ricllm.report import add_report_subparser
from ricllm.serve.keys import add_client_subparser, add_keys_subparser
from ricllm.serve.settings import add_serve_subparser


def _engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="GGUF file or HF checkpoint folder (default: the installed SmolLM2-135M-Instruct GGUF)")
    group.add_argument("--kv-cache-budget", default="256MiB",
                       help="bytes for the whole KV cache, e.g. 256MiB or 1GB (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget per step, prefill chunks included (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: %(default)s)")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    group.add_argument("--attention-backend", default="auto",
                       help="auto (the C kernel on the CPU, Triton on CUDA), torch (reference), cpu, triton or cuda")
    group.add_argument("--weights", default="auto",
                       help="auto, bf16, int8 or int4: weight-only quantized projections on the CPU; auto keeps "
                            "the file's precision (default: %(default)s)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--no-weight-cache", action="store_true",
                       help="always convert the model file at start instead of reusing converted weights on disk")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads (default: one per --engine-cpus CPU, else OMP_NUM_THREADS, else all cores)")
    group.add_argument("--engine-cpus", default=None, metavar="LIST",
                       help="CPUs the engine computes on, e.g. 0-3 (Linux; default: unset, anywhere)")
    group.add_argument("--runtime", default="auto", choices=("auto", "native", "torch"),
                       help="native: numpy and ricllm's C kernels, no torch in the process (about 200 MB less); "
                            "torch: the torch model, every device and format; auto: native where it serves "
                            "the model (CPU, packed weights), else torch (default: %(default)s)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(kv_cache_budget=args.kv_cache_budget, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
                attention_backend=args.attention_backend, weights=args.weights, enable_prefix_caching=not args.no_prefix_caching,
                weight_cache=not args.no_weight_cache, threads=args.threads, engine_cpus=args.engine_cpus,
                runtime=args.runtime)


def cmd_generate(args: argparse.Namespace) -> int:
    from ricllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        outputs = llm.chat(messages + [{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    out = outputs[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_tokens": len(out.prompt_token_ids),
                          "finish_reason": out.finish_reason, "ttft_s": out.ttft_s, "e2e_s": out.e2e_s}))
        return 0
    print(out.text)
    tpot = f", {1 / out.tpot_s:.1f} tok/s decode" if out.tpot_s else ""
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish: {out.finish_reason}; TTFT {out.ttft_s * 1000:.1f} ms, total {out.e2e_s * 1000:.1f} ms{tpot}; "
          f"load {llm.engine.startup_s:.2f} s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from ricllm.model.loader import open_checkpoint
    from ricllm.units import format_bytes

    ckpt = open_checkpoint(args.model)
    spec = ckpt.spec
    rows = [
        ("file", str(ckpt.path)), ("format", ckpt.format), ("name", spec.name),
        ("layers (L)", spec.num_layers), ("hidden size", spec.hidden_size),
        ("query heads", spec.num_heads), ("KV heads (n_kv)", spec.num_kv_heads),
        ("head dim (d_h)", spec.head_dim), ("FFN size", spec.intermediate_size),
        ("vocabulary", spec.vocab_size), ("max context", f"{spec.max_position_embeddings} tokens"),
        ("RoPE theta", spec.rope_theta), ("tied embeddings", spec.tie_word_embeddings),
        ("parameters", f"{spec.num_parameters() / 1e6:.1f} M"),
    ]
    types = sorted(set(ckpt.tensor_types().values()))
    if types:
        rows.append(("tensor types", ", ".join(types)))
    for label, size in (("fp32", 4), ("bf16/fp16", 2)):
        per_token = spec.kv_bytes_per_token(size)
        rows.append((f"KV bytes/token {label}", f"{per_token} B  (2·{spec.num_layers}·{spec.num_kv_heads}·"
                     f"{spec.head_dim}·{size}); full context {format_bytes(per_token * spec.max_position_embeddings)}"))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from ricllm.config import EngineConfig
    from ricllm.engine.llm_engine import LLMEngine

    if args.no_weight_cache:
        raise ConfigError("prepare fills the weight cache: --no-weight-cache contradicts it")
    admission = "deadline" if args.calibrate else "off"
    engine = LLMEngine(EngineConfig(model=args.model, admission=admission, **_engine_kwargs(args)))
    entry = engine.runtime.weight_cache_entry
    if entry is None or not entry.is_file():
        print(f"ricllm: error: could not write the weight cache entry {entry} (see the log above); "
              f"set RICLLM_CACHE_DIR to a writable folder", file=sys.stderr)
        return 1
    for line in _prepared(engine, entry, args.calibrate):
        print(line)
    return 0


def _prepared(engine, entry, calibrated: bool) -> list[str]:
    """What ``prepare`` left on disk, one aligned line each."""
    from ricllm.engine.calibration import fit_cache_path, fit_key
    from ricllm.kernels.cpu_library import cpu_kernels_available
    from ricllm.units import format_bytes

    layers, head = engine.runtime.weight_formats
    what = (f"{engine.spec.name}: layers {layers}, head {head}, dtype {str(engine.runtime.dtype).removeprefix('torch.')}, "
            f"{engine.runtime.name} runtime")
    done = ("already in the weight cache" if engine.runtime.weights_source.startswith("cache")
            else f"converted from {engine.model_path} in {engine.runtime.load_s:.1f} s")
    lines = [f"weights   {what}: {done}", f"          {entry} ({format_bytes(entry.stat().st_size)})"]
    device = str(engine.runtime.device).split(":")[0]
    ok, reason = cpu_kernels_available() if device == "cpu" else (False, f"not used on {device}")
    lines.append(f"kernels   CPU kernels {reason}" if ok else f"kernels   CPU kernels unavailable: {reason}")
    if calibrated:
        lines.append(f"latency   step-latency fit for this machine: {fit_cache_path(fit_key(engine))}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ricllm", description="Deadline-aware LLM inference for the O-RAN near-RT RIC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt and print it with its timings",
                         description="Generate a completion (or a chat reply with --chat) and print the "
                                     "text, then token counts and timings on stderr.")
    gen.add_argument("prompt", help="the prompt text (the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed for a reproducible output")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="print a model's dimensions and KV bytes per token",
                          description="Read a model file's metadata (no weights are loaded).")
    info.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    info.set_defaults(func=cmd_info)
    prepare = sub.add_parser(
        "prepare", help="convert a model's weights into the weight cache and build the CPU kernels now",
        description="Do a model's one-time start-up work ahead of time: convert its weights (dequantize, "
                    "pack) into the weight cache and build the CPU kernels. Later starts with the same "
                    "settings (serve, generate, replay) then map the converted weights in about a second "
                    "instead of converting. Entries are keyed by the file's hash, dtype, device, weight "
                    "format and this CPU, so run it with the flags you serve with, on the machine (or "
                    "image) that serves. The cache is $RICLLM_CACHE_DIR (default ~/.cache/ricllm).")
    prepare.add_argument("--calibrate", action="store_true",
                         help="also measure the step-latency fit that deadline admission uses (about 20 s) and "
                              "cache it; a fit is valid only on the machine that measured it, so do this on the "
                              "serving node, not in an image build")
    _engine_args(prepare)
    prepare.set_defaults(func=cmd_prepare)
    add_plan_subparser(sub)
    add_replay_subparser(sub)
    add_report_subparser(sub)
    add_serve_subparser(sub)
    add_client_subparser(sub)
    add_keys_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RicllmError as exc:
        print(f"ricllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ricllm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
