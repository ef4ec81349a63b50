"""Gemma 3 270M's packed weights (``weights="auto"``, bf16 on the CPU) against the file's own weights.

Printed, as markdown tables for benchmarks/RESULTS.md:
  1. per GGUF tensor kind and type: how many, the format ``auto`` packs them in, and the error of
     the packed weights against the file's dequantized ones (fp32), largest and mean absolute, beside
     the error of packing them int8 (the form one format for every layer gives a mixed file) and the
     mean |w| for scale;
  2. the bytes a one-stream decode step reads (every layer's projections and the head), as packed
     and with every layer int8;
  3. with ``--quality``: teacher-forced greedy agreement with HF transformers fp32 and perplexity of
     the torch runtime's packed path (the native runtime computes the same logits where both attend
     in the same kernel: tests/test_native_gemma.py), on the test suite's text three times over (past
     the 512-token window), read in prefill steps of 64 rows as tests/test_gemma3.py reads it.

    python benchmarks/bench_gemma_weights.py [--quality] [--types Q4_K ...]

``--types`` limits the error table to the tensors stored in those types (the bytes then count them alone).

It needs the installed Gemma 3 270M (``bash scripts/setup.sh``); ``--quality`` HF transformers too.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ricllm import LLM  # noqa: E402
from ricllm.kernels import cpu_quant  # noqa: E402
from ricllm.model.formats import PROJECTION_TENSORS, projection_formats, resolve_formats  # noqa: E402
from ricllm.model.loader import read_tensor_types, resolve_model_path  # noqa: E402

STEP_ROWS = 64
PACKERS = {"int4": (cpu_quant.pack_int4, 4), "int8": (cpu_quant.pack_int8, 8)}


def progress(text: str) -> None:
    print(f"[bench_gemma_weights] {text}", file=sys.stderr, flush=True)


def packed_error(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """|packed − file| per weight, and the bytes a decode step reads of it (weights and scales)."""
    pack, bits = PACKERS[fmt]
    packed, scales, offsets = pack(weight)
    return (cpu_quant.unpack(packed, scales, offsets, bits) - weight).abs(), packed.nbytes + scales.nbytes


def weight_errors(path: Path, only_types: set[str] | None) -> tuple[list[dict], dict[str, int], tuple[str, str]]:
    """Per (tensor kind, file type): count, format, errors as packed and as int8; bytes as packed and all-int8
    (of the tensors of ``only_types``, or every layer tensor)."""
    import gguf
    from gguf import GGUFReader

    types = read_tensor_types(path)
    formats = resolve_formats("auto", types, packable=True)
    fmt_of = {}
    for name in types:
        if match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name):
            layer, part = int(match[1]), match[2]
            for fmt, parts in zip(projection_formats(formats[0], types, layer), PROJECTION_TENSORS.values()):
                if part in parts:
                    fmt_of[name] = fmt
    rows: dict[tuple, dict] = {}
    sizes = collections.Counter()
    for tensor in GGUFReader(path, "r").tensors:
        if tensor.name == "token_embd.weight":  # the tied head: int8 either way, d·q per 32 as the file's Q8_0
            sizes["head"] = int(tensor.n_elements) * 9 // 8  # a byte per weight, fp16 d and c per 32
        if tensor.name not in fmt_of or (only_types and tensor.tensor_type.name not in only_types):
            continue
        weight = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()
        fmt, kind = fmt_of[tensor.name], tensor.name.split(".")[2]
        row = rows.setdefault((kind, tensor.tensor_type.name, fmt), collections.defaultdict(float))
        packed = packed_error(weight, fmt)
        as_int8 = packed if fmt == "int8" else packed_error(weight, "int8")
        for label, (diff, size) in (("packed", packed), ("int8", as_int8)):
            row[f"{label}_max"] = max(row[f"{label}_max"], diff.max().item())
            row[f"{label}_sum"] += diff.sum().item()
            sizes[label] += size
        row["count"] += 1
        row["abs"] += weight.abs().sum().item()
        row["n"] += weight.numel()
    table = [{"kind": kind, "type": kind_type, "format": fmt, "count": int(r["count"]), "mean_w": r["abs"] / r["n"],
              **{f"{label}_{stat}": r[f"{label}_max"] if stat == "max" else r[f"{label}_sum"] / r["n"]
                 for label in ("packed", "int8") for stat in ("max", "mean")}}
             for (kind, kind_type, fmt), r in sorted(rows.items())]
    return table, dict(sizes), formats


def quality(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return agreement, math.exp(F.cross_entropy(logits, targets).item())


def quality_rows(path: Path) -> tuple[int, float, dict[str, tuple[float, float]]]:
    """(tokens, HF fp32 perplexity, the torch runtime's (agreement, perplexity))."""
    from tests.hf_oracle import gemma3_oracle
    from tests.test_weight_formats import TEXT, teacher_forced_logits

    progress("torch runtime")
    llm = LLM("gemma3-270m", runtime="torch", kv_cache_budget="64MiB", enable_prefix_caching=False,
              weight_cache=False, max_num_batched_tokens=STEP_ROWS)
    ids = llm.tokenizer.encode("\n\n".join([TEXT] * 3))
    logits = teacher_forced_logits(llm, ids, list(range(len(ids) - 1)))
    del llm
    gc.collect()
    progress("HF fp32 oracle")
    targets = torch.tensor(ids[1:])
    with torch.no_grad():
        reference = gemma3_oracle(path)(torch.tensor([ids])).logits[0, :-1].float()
    reference_ppl = math.exp(F.cross_entropy(reference, targets).item())
    return len(ids), reference_ppl, {"torch": quality(logits, reference, targets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quality", action="store_true", help="also agreement and perplexity against HF fp32")
    parser.add_argument("--types", nargs="+", default=None, help="only the layer tensors stored in these types")
    args = parser.parse_args()
    path = resolve_model_path("gemma3-270m")
    counts = collections.Counter(read_tensor_types(path).values())
    progress("packing every layer tensor as auto does, and as int8")
    table, sizes, formats = weight_errors(path, set(args.types) if args.types else None)
    print(f"file: {path.name}; tensor types {dict(sorted(counts.items()))}")
    print(f"weights auto: layers {formats[0]}, head {formats[1]}")
    print(f"layer bytes a decode step reads: {sizes['packed'] / 1e6:.2f} MB as packed, "
          f"{sizes['int8'] / 1e6:.2f} MB with every layer int8; the int8 head {sizes['head'] / 1e6:.2f} MB\n")
    print("| tensor | file type | count | packed | max abs error | mean abs error | as int8: max | as int8: mean "
          "| mean abs weight |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['kind']} | {r['type']} | {r['count']} | {r['format']} | {r['packed_max']:.2e} | "
              f"{r['packed_mean']:.2e} | {r['int8_max']:.2e} | {r['int8_mean']:.2e} | {r['mean_w']:.2e} |")
    if not args.quality:
        return
    tokens, reference_ppl, results = quality_rows(path)
    print(f"\n{tokens} tokens, HF fp32 perplexity {reference_ppl:.4f}\n")
    print("| runtime | greedy agreement with HF fp32 | perplexity | vs HF fp32 |")
    print("|---|---:|---:|---:|")
    for name, (agreement, ppl) in results.items():
        print(f"| {name} | {agreement:.1%} | {ppl:.4f} | {ppl / reference_ppl - 1:+.2%} |")


if __name__ == "__main__":
    main()
