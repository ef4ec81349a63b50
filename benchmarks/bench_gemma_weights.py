"""Gemma 3 270M's packed weights (``weights="auto"``, bf16 on the CPU) against the file's own weights.

Printed, as a markdown table for benchmarks/RESULTS.md:
  1. each projection kind: the tensor types the file stores it in, and the packed format it takes;
  2. the bytes a one-stream decode step reads (the four projections of every layer, and the head);
  3. the error of the packed weights against the file's dequantized ones (fp32), by source type:
     the largest and the mean absolute difference, and the mean |w| for scale;
  4. teacher-forced greedy agreement with HF transformers fp32 and perplexity, each runtime (torch,
     native), on the test suite's text three times over (past the 512-token window), read in
     prefill steps of 64 rows as tests/test_gemma3.py reads it.

    python benchmarks/bench_gemma_weights.py        # about five minutes on 2 cores

It needs the installed Gemma 3 270M (``bash scripts/setup.sh``) and HF transformers (the oracle).
"""

from __future__ import annotations

import collections
import gc
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ricllm import LLM  # noqa: E402
from ricllm.kernels import cpu_quant  # noqa: E402
from ricllm.model.loader import read_tensor_types, resolve_model_path  # noqa: E402
from tests.test_gemma3 import gemma3_oracle  # noqa: E402
from tests.test_weight_formats import TEXT, native_teacher_forced_logits, teacher_forced_logits  # noqa: E402

PROJECTIONS = {"attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
STEP_ROWS = 64


def progress(text: str) -> None:
    print(f"[bench_gemma_weights] {text}", file=sys.stderr, flush=True)


def module(layer, name: str):
    owner, attr = name.split(".")
    return getattr(getattr(layer, owner), attr)


def packed_bytes(m) -> int:
    """What a product of one row reads: the packed weight and its scales (``Packed.decode_bytes``)."""
    return m.packed_weight.nbytes + m.packed_scales.nbytes


def weight_error(dense_model, packed_model, types: dict[str, str]) -> tuple[list[dict], int, int]:
    """Per (projection kind, source types, bits): count, max/mean |packed - file|, mean |w|; the
    layers' and the head's decode bytes."""
    rows: dict[tuple, dict] = {}
    layer_bytes = 0
    for i, (dense_layer, packed_layer) in enumerate(zip(dense_model.layers, packed_model.layers, strict=True)):
        for name, parts in PROJECTIONS.items():
            m, file_weight = module(packed_layer, name), module(dense_layer, name).weight.float()
            bits = 4 if m.fmt == "int4" else 8
            restored = cpu_quant.unpack(m.packed_weight, m.packed_scales, m.packed_offsets, bits)
            diff = (restored - file_weight).abs()
            source = "+".join(dict.fromkeys(types[f"blk.{i}.{p}.weight"] for p in parts))
            row = rows.setdefault((name, source, bits), {"count": 0, "max": 0.0, "sum": 0.0, "abs": 0.0, "n": 0})
            row["count"] += 1
            row["max"] = max(row["max"], diff.max().item())
            row["sum"] += diff.sum().item()
            row["abs"] += file_weight.abs().sum().item()
            row["n"] += diff.numel()
            layer_bytes += packed_bytes(m)
    table = [{"projection": name, "source": source, "format": f"int{bits}", "count": r["count"], "max": r["max"],
              "mean": r["sum"] / r["n"], "mean_w": r["abs"] / r["n"]}
             for (name, source, bits), r in sorted(rows.items())]
    return table, layer_bytes, packed_bytes(packed_model.packed_head)


def quality(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return agreement, math.exp(F.cross_entropy(logits, targets).item())


def main() -> None:
    path = resolve_model_path("gemma3-270m")
    types = read_tensor_types(path)
    counts = collections.Counter(types.values())
    progress("loading fp32 (the file's weights) and the packed torch runtime")
    dense = LLM("gemma3-270m", dtype="float32", kv_cache_budget="64MiB", enable_prefix_caching=False,
                weight_cache=False)
    packed = LLM("gemma3-270m", runtime="torch", kv_cache_budget="64MiB", enable_prefix_caching=False,
                 weight_cache=False, max_num_batched_tokens=STEP_ROWS)
    table, layer_bytes, head_bytes = weight_error(dense.engine.runtime.model, packed.engine.runtime.model, types)
    formats = packed.engine.runtime.weight_formats
    del dense
    gc.collect()

    progress("HF fp32 oracle")
    ids = packed.tokenizer.encode("\n\n".join([TEXT] * 3))
    targets, positions = torch.tensor(ids[1:]), list(range(len(ids) - 1))
    with torch.no_grad():
        reference = gemma3_oracle(path)(torch.tensor([ids])).logits[0, :-1].float()
    reference_ppl = math.exp(F.cross_entropy(reference, targets).item())
    results = {"torch": quality(teacher_forced_logits(packed, ids, positions), reference, targets)}
    del packed
    gc.collect()
    progress("native runtime")
    native = LLM("gemma3-270m", runtime="native", kv_cache_budget="64MiB", enable_prefix_caching=False,
                 weight_cache=False, max_num_batched_tokens=STEP_ROWS)
    native_bytes = native.engine.runtime.model.weights.weight_bytes()
    results["native"] = quality(native_teacher_forced_logits(native, ids, positions), reference, targets)

    print(f"file: {path.name}; tensor types {dict(sorted(counts.items()))}")
    print(f"weights auto: layers {formats[0]}, head {formats[1]}")
    print(f"decode bytes: layers {layer_bytes / 1e6:.2f} MB + head {head_bytes / 1e6:.2f} MB = "
          f"{(layer_bytes + head_bytes) / 1e6:.2f} MB (native, with the norms: {native_bytes / 1e6:.2f} MB)\n")
    print("| projection | file type | packed | tensors | max abs error | mean abs error | mean abs weight |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['projection']} | {r['source']} | {r['format']} | {r['count']} | {r['max']:.2e} | "
              f"{r['mean']:.2e} | {r['mean_w']:.2e} |")
    print(f"\n{len(ids)} tokens, HF fp32 perplexity {reference_ppl:.4f}\n")
    print("| runtime | greedy agreement with HF fp32 | perplexity | vs HF fp32 |")
    print("|---|---:|---:|---:|")
    for name, (agreement, ppl) in results.items():
        print(f"| {name} | {agreement:.1%} | {ppl:.4f} | {ppl / reference_ppl - 1:+.2%} |")


if __name__ == "__main__":
    main()
