"""``ricllm generate``, ``info``, ``prepare`` and ``export-onnx``: the offline API and the model file, from the shell.

Their engine flags are generated from :class:`ricllm.config.EngineSettings` (:mod:`ricllm.cli.flags`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ricllm.cli.flags import add_settings_flags, add_structured_flags, given_settings, structured_from_args
from ricllm.config import EngineSettings
from ricllm.errors import ConfigError


def add_model_subparsers(sub: argparse._SubParsersAction) -> None:
    _add_generate(sub)
    _add_info(sub)
    _add_prepare(sub)
    _add_export_onnx(sub)


def cmd_export_onnx(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ricllm.engine.runtime.onnx_export import OnnxExportUnsupported, write
    from ricllm.engine.runtime.onnx_paged_attention import ATTENTION_GRAPHS
    from ricllm.model.loader import resolve_model_path
    from ricllm.units import format_bytes

    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"{str(out)!r} is a folder: name the .onnx file to write")
    try:
        meta = write(resolve_model_path(args.model), out, ATTENTION_GRAPHS[args.attention])
    except OnnxExportUnsupported as exc:
        raise ConfigError(f"cannot export {args.model} to ONNX: {exc}") from exc
    layers, head = meta["weight_formats"]
    print(f"wrote {out} ({format_bytes(out.stat().st_size)}; layers {layers}, head {head}) and {out}.json")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ricllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
                            structured=structured_from_args(args))
    llm = LLM(**given_settings(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        outputs = llm.chat(messages + [{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    out = outputs[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_tokens": len(out.prompt_token_ids),
                          "finish_reason": out.finish_reason, "ttft_s": out.ttft_s, "e2e_s": out.e2e_s,
                          "num_forced_tokens": out.num_forced_tokens,
                          "rejection": str(out.rejection) if out.rejection else None}))
        return 0 if out.rejection is None else 1
    if out.rejection is not None:
        print(f"ricllm: refused: {out.rejection}", file=sys.stderr)
        return 1
    print(out.text)
    tpot = f", {1 / out.tpot_s:.1f} tok/s decode" if out.tpot_s else ""
    forced = f" ({out.num_forced_tokens} forced by the constraint)" if out.num_forced_tokens else ""
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated{forced}, "
          f"finish: {out.finish_reason}; TTFT {out.ttft_s * 1000:.1f} ms, total {out.e2e_s * 1000:.1f} ms{tpot}; "
          f"load {llm.engine.startup_s:.2f} s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from ricllm.model.identity import ServedModel
    from ricllm.model.loader import open_checkpoint
    from ricllm.units import format_bytes

    ckpt = open_checkpoint(args.model)
    spec = ckpt.spec
    rows = [
        ("file", str(ckpt.path)), ("format", ckpt.format), ("name", ServedModel.of(ckpt.path, spec.name).name),
        ("layers (L)", spec.num_layers), ("hidden size", spec.hidden_size),
        ("query heads", spec.num_heads), ("KV heads (n_kv)", spec.num_kv_heads),
        ("head dim (d_h)", spec.head_dim), ("FFN size", spec.intermediate_size),
        ("vocabulary", spec.vocab_size), ("max context", f"{spec.max_position_embeddings} tokens"),
        ("RoPE theta", spec.rope_theta), *_sliding_window_rows(spec), ("tied embeddings", spec.tie_word_embeddings),
        ("parameters", f"{spec.num_parameters() / 1e6:.1f} M"),
    ]
    types = sorted(set(ckpt.tensor_types().values()))
    if types:
        rows.append(("tensor types", ", ".join(types)))
    for label, size in (("fp32", 4), ("bf16/fp16", 2)):
        per_token = spec.kv_bytes_per_token(size)
        rows.append((f"KV bytes/token {label}", f"{per_token} B  (2·{spec.num_layers}·{spec.num_kv_heads}·"
                     f"{spec.head_dim}·{size}); full context {format_bytes(per_token * spec.max_position_embeddings)}"))
    rows += _kv_group_rows(spec)
    rows.append(("CPU kernels", _cpu_kernels()))
    rows += _auto_choices(ckpt.tensor_types())
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _sliding_window_rows(spec) -> list[tuple[str, str]]:
    """Gemma 3's windowed layers (none for a model whose layers all see the whole sequence)."""
    windowed = [w for w in spec.layer_windows if w]
    if not windowed:
        return []
    return [("sliding window", f"{max(windowed)} tokens in {len(windowed)} of {spec.num_layers} layers "
                               f"(their RoPE theta {spec.rope_local_theta})")]


def _kv_group_rows(spec) -> list[tuple[str, str]]:
    """A hybrid KV cache's groups (none for a model whose layers all attend alike)."""
    from ricllm.cache.kv_groups import kv_cache_groups
    from ricllm.plan import kv_cache_bytes
    from ricllm.units import format_bytes

    groups = kv_cache_groups(spec)
    if len(groups) == 1:
        return []
    full = sum(1 for g in groups if not g.sliding)
    windows = sorted({g.window for g in groups if g.sliding})
    grouped = int(kv_cache_bytes(spec, spec.max_position_embeddings, 1, 2))
    return [("KV cache groups", f"{len(groups)} of {len(groups[0].layers)} layers each: {full} keeping every token, "
                                f"{len(groups) - full} keeping the last {', '.join(map(str, windows))} "
                                f"(one pool of blocks, a block table per group); full context bf16 "
                                f"{format_bytes(grouped)}")]


def _auto_choices(tensor_types: dict[str, str]) -> list[tuple[str, str]]:
    """What ``dtype="auto"`` and ``weights="auto"`` resolve to on this CPU for this file."""
    from ricllm.config import EngineConfig
    from ricllm.kernels.cpu_library import cpu_bf16
    from ricllm.model.formats import resolve_formats

    has_bf16, why = cpu_bf16()
    dtype, dtype_why = EngineConfig().auto_cpu_dtype()
    layers, head = resolve_formats("auto", tensor_types, packable=dtype == "bfloat16")
    return [("bf16 products", f"{'yes' if has_bf16 else 'no'} ({why})"),
            ("dtype auto (CPU)", f"{dtype} ({dtype_why})"),
            ("weights auto (CPU)", f"layers {layers}, LM head {head}")]


def _cpu_kernels() -> str:
    """The batched products this CPU runs (building the C library once if needed)."""
    from ricllm.kernels.cpu_library import AMX_DISABLED, FAMILY_CAP_VARIABLE, family_cap, kernel_family

    family = kernel_family()
    if os.environ.get(FAMILY_CAP_VARIABLE, "").strip():
        return f"{family}, capped at {family_cap()} by {FAMILY_CAP_VARIABLE}"
    return f"{family}, AMX disabled by RICLLM_NO_AMX" if AMX_DISABLED else family


def cmd_prepare(args: argparse.Namespace) -> int:
    from ricllm.config import EngineConfig
    from ricllm.engine.llm_engine import LLMEngine

    settings = given_settings(args)
    if settings.get("weight_cache") is False:
        raise ConfigError("prepare fills the weight cache: --no-weight-cache contradicts it")
    if args.calibrate:  # the fit is measured only where admission needs one
        settings["admission"] = {"policy": "deadline", **settings.get("admission", {})}
    engine = LLMEngine(EngineConfig(**settings))
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
    dtype = str(engine.runtime.dtype).removeprefix("torch.")
    what = (f"{engine.spec.name}: layers {layers}, head {head}, dtype {dtype}, "
            f"{engine.runtime.name} runtime")
    done = ("already in the weight cache" if engine.runtime.weights_source.startswith("cache")
            else f"converted from {engine.model_path} in {engine.runtime.load_s:.1f} s")
    lines = [f"weights   {what}: {done}", f"          {entry} ({format_bytes(entry.stat().st_size)})"]
    device = str(engine.runtime.device).split(":")[0]
    if engine.runtime.runs_ricllm_kernels:
        ok, reason = cpu_kernels_available()
        lines.append(f"kernels   CPU kernels {reason}" if ok else f"kernels   CPU kernels unavailable: {reason}")
    else:
        lines.append(f"kernels   CPU kernels not used by the {engine.runtime.name} runtime on {device}")
    if calibrated:
        lines.append(f"latency   step-latency fit for this machine: {fit_cache_path(fit_key(engine))}")
    return lines




def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt and print it with its timings",
                         description="Generate a completion (or a chat reply with --chat) and print the "
                                     "text, then token counts and timings on stderr.")
    gen.add_argument("prompt", help="the prompt text (the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (a base model without one, "
                     "e.g. Gemma 3 270M: the plain form, the system message and the prompt on lines of their own)")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="this request's sampling seed, for a reproducible "
                                                            "output (the engine's seed is not a flag here)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_structured_flags(gen)
    add_settings_flags(gen, EngineSettings, "engine", exclude=frozenset({"seed"}))
    gen.set_defaults(func=cmd_generate)


def _add_info(sub: argparse._SubParsersAction) -> None:
    info = sub.add_parser("info", help="print a model's dimensions and KV bytes per token",
                          description="Read a model file's metadata (no weights are loaded).")
    info.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    info.set_defaults(func=cmd_info)


def _add_export_onnx(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export-onnx", help="write a Llama-family or Gemma 3 GGUF as an ONNX graph for ONNX Runtime (the onnx runtime's model)",
        description="Write the model as the ONNX graph that --runtime onnx runs (com.microsoft MatMulNBits from "
                    "the file's 4- and 8-bit blocks, attention over the paged KV pool's gathered rows), and "
                    "beside it OUT.json: the model's shape and tokenizer. --runtime onnx writes the same graph "
                    "into the weight cache by itself; this command is for inspecting or shipping it. Needs "
                    "ricllm[onnx].")
    export.add_argument("model", help="GGUF file, or an installed model's short name (smollm2-135m, gemma3-270m)")
    export.add_argument("out", help="the .onnx file to write")
    export.add_argument("--attention", choices=("gather", "paged"), default="gather",
                        help="gather: standard ops over the pool's gathered rows, the graph --runtime onnx runs on "
                             "the CPU; paged: one com.microsoft PagedAttention per layer over an fp16 pool, the "
                             "graph it runs with --device cuda (default: gather)")
    export.set_defaults(func=cmd_export_onnx)


def _add_prepare(sub: argparse._SubParsersAction) -> None:
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
    add_settings_flags(prepare, EngineSettings, "engine")
    prepare.set_defaults(func=cmd_prepare)
