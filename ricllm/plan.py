"""Capacity planner: which context × batch a model can serve within a node's memory and deadline.

A near-RT RIC node has bounded memory and a hard loop budget, so the question "can this model run
here?" is really "does its KV cache fit, and can it be streamed in time?". Both answers are pure
arithmetic on the model's shape:

* the KV-cache equation ``M_KV = 2·L·n·n_kv·d_h·b·B`` (K and V, layers, context tokens, KV heads,
  head dim, bytes per element, batch), summed over the layer groups of a model with sliding-window
  layers, whose ``n`` is capped at their window: ``M_KV = Σ_g 2·L_g·min(n, w_g)·n_kv·d_h·b·B``;
* the bandwidth roofline of decode: each step streams all weights once (shared by the batch) and
  the whole batch's KV, each layer group's at what it keeps (a sliding-window layer reads its
  window), so one answer of ``tokens`` tokens takes at least ``tokens × (M_weights + M_KV(n, B)) / BW``.
  The LM head is a term of its own within ``M_weights``, ``M_head = V·d·b``: read whole by a step
  with an unconstrained row, only the allowed tokens' tiles by a step whose rows are all
  constrained (``ricllm.engine.runtime.narrow_head``), which the report shows beside it.

Nothing here imports torch or loads weights; ``ricllm plan PATH`` reads a checkpoint's metadata only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ricllm.config import lora_module_paths
from ricllm.errors import ConfigError
from ricllm.model.identity import ServedModel
from ricllm.model.spec import ModelSpec
from ricllm.units import parse_bytes


class PlanError(ConfigError):
    """A planner input is out of range, unparseable or names an unknown model shape."""


KV_DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# integer KV rows carry a scale each: one fp32 per (token, KV head) row of d_h elements, as ricllm's
# int8 cache stores it (ricllm.cache.kv_format); fp8 e4m3 is taken with one scale per tensor
KV_ROW_SCALE_BYTES: dict[str, float] = {"int8": 4, "int4": 4}
WHAT_IF_KV_DTYPES = ("fp16", "fp8", "int8", "int4")
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_REFERENCE_CONTEXT = 4096
NAMED_WEIGHT_BYTES = 2  # named shapes are assumed stored in fp16/bf16
TIME_MODEL = ("answer time = tokens × (M_weights + M_KV(n, B)) / BW ≤ deadline: every decode step streams "
              "all weights once and the whole batch's KV at context n (a sliding-window layer's at its window); prefill, compute and overheads are "
              "ignored, so the time is a lower bound and 'ok' cells are an upper bound on what is admissible")


def _shape(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, ffn: int,
           vocab: int, max_context: int, rope_theta: float, tied: bool = False) -> ModelSpec:
    return ModelSpec(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     max_position_embeddings=max_context, rms_norm_eps=1e-5, rope_theta=rope_theta,
                     tie_word_embeddings=tied, name=name)


NAMED_SHAPES: dict[str, ModelSpec] = {
    "llama-2-70b": _shape("Llama-2-70B", 80, 64, 8, 128, 8192, 28672, 32000, 4096, 10000.0),
    "llama-3-8b": _shape("Llama-3-8B", 32, 32, 8, 128, 4096, 14336, 128256, 8192, 500000.0),
    "smollm2-135m": _shape("SmolLM2-135M", 30, 9, 3, 64, 576, 1536, 49152, 8192, 100000.0, tied=True),
    # five sliding-window layers (512 tokens) to one global layer, as ricllm.model.loader reads the file
    "gemma-3-270m": replace(_shape("Gemma-3-270M", 18, 4, 1, 256, 640, 2048, 262144, 32768, 1_000_000.0, tied=True),
                            architecture="gemma3", layer_windows=((512,) * 5 + (0,)) * 3,
                            rope_local_theta=10_000.0, rms_norm_eps=1e-6),
}


# ---------------------------------------------------------------- the equation


def kv_element_bytes(kv_dtype: str, spec: ModelSpec) -> float:
    """``b`` of the equation for a KV element type: its bytes, plus its row's scale spread over the row
    (int8 with d_h = 64: 1 + 4/64 = 1.0625 B), so that ``2·L·n_kv·d_h·b`` is the real size."""
    return KV_DTYPE_BYTES[kv_dtype] + KV_ROW_SCALE_BYTES.get(kv_dtype, 0) / spec.head_dim


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: float) -> float:
    """``2·L·n_kv·d_h·b``: K and V of one token across all layers (b may be 0.5 for int4)."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_bytes


def kv_product(spec: ModelSpec, kv_bytes: float) -> str:
    """The product written out, so a reader can check it by hand: ``2·32·8·128·2 = 131,072 B``."""
    factors = (2, spec.num_layers, spec.num_kv_heads, spec.head_dim, f"{kv_bytes:g}")
    return "·".join(map(str, factors)) + f" = {kv_bytes_per_token(spec, kv_bytes):,.0f} B"


def layer_groups(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(L_g, w_g)`` per attention type, full-attention layers (``w`` 0) first."""
    counts: dict[int, int] = {}
    for layer in range(spec.num_layers):
        window = spec.layer_window(layer)
        counts[window] = counts.get(window, 0) + 1
    return [(counts[w], w) for w in sorted(counts)]


def kv_cache_bytes(spec: ModelSpec, context: int, batch: int, kv_bytes: float) -> float:
    """``M_KV = Σ_g 2·L_g·min(n, w_g)·n_kv·d_h·b·B`` (``w_g`` 0: ``n``): the cache of ``batch``
    sequences of ``context`` tokens, a sliding-window layer keeping its window's tokens only. One
    group of every layer for a model without sliding windows: ``2·L·n·n_kv·d_h·b·B``."""
    per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * kv_bytes
    return sum(per_layer_token * layers * (min(context, window) if window else context)
               for layers, window in layer_groups(spec)) * batch


def kv_cache_whole_bytes(spec: ModelSpec, context: int, batch: int, kv_bytes: float) -> float:
    """``2·L·n·n_kv·d_h·b·B``: the cache if every layer kept the whole sequence."""
    return kv_bytes_per_token(spec, kv_bytes) * context * batch


def answer_time_s(weights_bytes: float, kv_total_bytes: float, tokens: int, bandwidth_bytes_per_s: float) -> float:
    """Bandwidth roofline of ``tokens`` decode steps: each reads the weights once plus all of the KV."""
    return tokens * (weights_bytes + kv_total_bytes) / bandwidth_bytes_per_s


HEAD_TILE = 16  # output rows per tile of a packed head (ricllm.engine.runtime.narrow_head.TILE)
CONSTRAINED_TOKENS = 16  # the allowed tokens of the constrained step the report prices


def head_share(spec: ModelSpec) -> float:
    """The LM head's share of the parameters, ``V·d / parameters``: of ``M_weights``, the head's."""
    return spec.vocab_size * spec.hidden_size / spec.num_parameters()


def constrained_step_bytes(weights: float, head: float, spec: ModelSpec, allowed: int = CONSTRAINED_TOKENS) -> float:
    """What a step whose every row allows ``allowed`` tokens reads of the weights: the head's
    tiles of 16 rows that hold them (at most ``allowed`` of them), the rest whole."""
    tiles = -(-spec.vocab_size // HEAD_TILE)
    return weights - head + head * min(allowed, tiles) / tiles


def weights_bytes(spec: ModelSpec, bytes_per_parameter: float) -> float:
    """Parameters × bytes per parameter (2 for fp16/bf16, 0.5 for 4-bit, ignoring block scales)."""
    return spec.num_parameters() * bytes_per_parameter


# what ricllm's runtimes hold per LoRA parameter: A and Bᵀ rounded to bf16 (ricllm.kernels.cpu_lora)
LORA_ELEMENT_BYTES = 2
LORA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def lora_bytes(spec: ModelSpec, rank: int) -> float:
    """One adapter of ``rank`` on every projection of every layer: ``rank × Σ(in + out)`` parameters
    a layer, as the runtime holds them. An adapter adds to the weights each step streams when a
    request of the step is under it, and to the memory whether or not one is."""
    from ricllm.model.lora import projection_shape

    per_layer = sum(sum(projection_shape(spec, name)) for name in LORA_PROJECTIONS)
    return float(rank * per_layer * spec.num_layers * LORA_ELEMENT_BYTES)


def adapters_bytes(spec: ModelSpec, modules: Sequence[str], max_loras: int, rank: int) -> tuple[float, str]:
    """The adapters' bytes and what the figure is: each of ``modules`` (``name=path`` folders, read),
    else ``max_loras`` adapters of ``rank`` on every projection (estimate); (0, "") for none."""
    if modules:
        from ricllm.model.lora import load_lora_adapter

        sizes = [load_lora_adapter(path, spec).num_parameters * LORA_ELEMENT_BYTES for path in _lora_paths(modules)]
        return float(sum(sizes)), f"{len(sizes)} LoRA adapter{'s' * (len(sizes) != 1)} read"
    if max_loras <= 0:
        return 0.0, ""
    return max_loras * lora_bytes(spec, rank), f"{max_loras} LoRA adapters of rank {rank} (estimate)"


def _lora_paths(modules: Sequence[str]) -> list[str]:
    """The folders of ``name=path`` entries, read as ``ricllm serve --lora-modules`` reads them."""
    try:
        return list(lora_module_paths(list(modules)).values())
    except ValueError as exc:
        raise PlanError(f"--lora-modules takes name=path: {exc}") from None


def checkpoint_size_bytes(path: Path) -> int:
    """Weights as stored on disk: a GGUF file's size, or an HF folder's ``*.safetensors`` sizes.

    Quantized files keep their quantized size in memory too, so the file size is a better estimate
    than parameters × a nominal width; it slightly overstates (metadata, tokenizer).
    """
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Cell:
    """One context × batch point: its KV bytes, answer time and ``ok`` / ``mem`` / ``time``."""

    context: int
    batch: int
    kv_bytes: float
    time_s: float
    status: str


@dataclass(frozen=True)
class Limit:
    """A largest admissible integer and the constraint that stops it (``mem``, ``time``, ``model max``)."""

    value: int
    bound_by: str


@dataclass(frozen=True)
class WhatIf:
    """The same model with another attention layout or KV width; weights and memory unchanged."""

    label: str
    num_kv_heads: int
    kv_bytes: float
    bytes_per_token: float
    max_tokens: int
    max_batch: Limit


@dataclass(frozen=True)
class Budget:
    """The node: what the KV may occupy and the deadline the weights and KV must be streamed within."""

    available_bytes: float
    weights_bytes: float
    bandwidth_bytes_per_s: float
    deadline_s: float
    tokens: int

    def time_s(self, kv_total_bytes: float) -> float:
        return answer_time_s(self.weights_bytes, kv_total_bytes, self.tokens, self.bandwidth_bytes_per_s)

    def fits_memory(self, kv_total_bytes: float) -> bool:
        return kv_total_bytes <= self.available_bytes

    def fits_time(self, kv_total_bytes: float) -> bool:
        return self.time_s(kv_total_bytes) <= self.deadline_s

    @property
    def step_bytes(self) -> float:
        """Bytes one decode step may read and still meet the deadline: ``deadline × BW / tokens``."""
        return self.deadline_s * self.bandwidth_bytes_per_s / self.tokens

    def status(self, kv_total_bytes: float) -> str:
        """``mem`` wins over ``time`` when both fail: no speed-up makes a cache fit."""
        if not self.fits_memory(kv_total_bytes):
            return "mem"
        return "ok" if self.fits_time(kv_total_bytes) else "time"


@dataclass(frozen=True)
class Plan:
    """Everything the report shows, computed once so text and JSON cannot disagree."""

    spec: ModelSpec
    memory_bytes: float
    reserved_bytes: float
    kv_bytes: float
    weights_source: str
    budget: Budget
    context_cap: int
    reference_context: int
    kv_bytes_per_token: float
    head_bytes: float  # of the weights, the LM head's
    cells: tuple[Cell, ...]
    max_batch_per_context: dict[int, Limit]
    max_context_per_batch: dict[int, Limit]
    what_ifs: tuple[WhatIf, ...]

    @property
    def contexts(self) -> list[int]:
        return sorted({c.context for c in self.cells})

    @property
    def batches(self) -> list[int]:
        return sorted({c.batch for c in self.cells})

    def cell(self, context: int, batch: int) -> Cell:
        return next(c for c in self.cells if c.context == context and c.batch == batch)


def _largest(fits: Callable[[int], bool], guess: float, cap: int | None = None) -> int:
    """Largest k ≥ 0 with ``fits(k)``, starting from the closed-form ``guess`` and correcting float
    rounding against the very predicate the grid uses, so the two can never disagree."""
    k = max(0, math.floor(guess))
    if cap is not None:
        k = min(k, cap)
    while k > 0 and not fits(k):
        k -= 1
    step = 1  # up in doubling steps, back to single ones at a miss: a sliding window's cache grows slower than the guess
    while cap is None or k < cap:
        probe = k + step if cap is None else min(k + step, cap)
        if fits(probe):
            k, step = probe, step * 2
        elif step == 1:
            break
        else:
            step = 1
    return k


def _limit(kv_of: Callable[[int], float], budget: Budget, cap: int | None = None) -> Limit:
    """Largest k (batch or context) whose KV ``kv_of(k)`` fits memory and deadline, and what binds."""
    unit = kv_of(1)
    by_memory = _largest(lambda k: budget.fits_memory(kv_of(k)), budget.available_bytes / unit, cap)
    by_time = _largest(lambda k: budget.fits_time(kv_of(k)), (budget.step_bytes - budget.weights_bytes) / unit, cap)
    value = min(by_memory, by_time)
    if value == by_memory and (cap is None or by_memory < cap):
        return Limit(value, "mem")
    if value == by_time and (cap is None or by_time < cap):
        return Limit(value, "time")
    return Limit(value, "model max")


def _grid_contexts(contexts: Sequence[int], cap: int) -> list[int]:
    """The requested contexts up to the model's max, plus the max itself when it falls inside the grid."""
    kept = {c for c in contexts if c <= cap}
    if cap < max(contexts):
        kept.add(cap)
    return sorted(kept)


def _what_ifs(spec: ModelSpec, kv_bytes: float, budget: Budget, reference_context: int) -> tuple[WhatIf, ...]:
    """MHA / as-is / MQA at the chosen KV width, then the as-is layout at each KV width."""
    kind = "MHA" if spec.num_kv_heads == spec.num_heads else "MQA" if spec.num_kv_heads == 1 else "GQA"
    variants = [("MHA (n_kv = heads)", spec.num_heads, kv_bytes),
                (f"{kind} (as is)", spec.num_kv_heads, kv_bytes),
                ("MQA (n_kv = 1)", 1, kv_bytes)]
    variants += [(f"KV {name}", spec.num_kv_heads, kv_element_bytes(name, spec)) for name in WHAT_IF_KV_DTYPES]
    rows = []
    for label, kv_heads, b in variants:
        variant = replace(spec, num_kv_heads=kv_heads)
        per_token = kv_bytes_per_token(variant, b)
        max_batch = _limit(lambda k, v=variant, b=b: kv_cache_bytes(v, reference_context, k, b), budget)
        rows.append(WhatIf(label, kv_heads, b, per_token, int(budget.available_bytes // per_token), max_batch))
    return tuple(rows)


def _check_inputs(memory_bytes: float, reserved_bytes: float, bandwidth_bytes_per_s: float, deadline_s: float,
                  tokens: int, kv_bytes: float, weights: float) -> None:
    numbers = (memory_bytes, reserved_bytes, bandwidth_bytes_per_s, deadline_s, kv_bytes, weights)
    checks = [
        (all(map(math.isfinite, numbers)), f"planner inputs must be finite numbers, got {numbers}"),
        (memory_bytes >= 0, f"memory (--memory) cannot be negative: {memory_bytes:,.0f} B"),
        (reserved_bytes >= 0, f"reserved memory (--reserved) cannot be negative: {reserved_bytes:,.0f} B"),
        (reserved_bytes <= memory_bytes,
         f"reserved memory (--reserved) {format_size(reserved_bytes)} exceeds the memory (--memory) "
         f"{format_size(memory_bytes)}"),
        (bandwidth_bytes_per_s > 0, f"bandwidth (--bandwidth) must be positive, got {bandwidth_bytes_per_s:g} B/s"),
        (deadline_s > 0, f"deadline (--deadline-ms) must be positive, got {deadline_s * 1e3:g} ms"),
        (isinstance(tokens, int) and tokens >= 1, f"tokens per answer (--tokens) must be at least 1, got {tokens}"),
        (kv_bytes > 0, f"KV bytes per element (--kv-dtype) must be positive, got {kv_bytes:g}"),
        (weights >= 0, f"weights bytes (--weight-bytes) cannot be negative: {weights:,.0f} B"),
    ]
    for ok, message in checks:
        if not ok:
            raise PlanError(message)
    available = memory_bytes - reserved_bytes - weights
    if available < 0:
        raise PlanError(
            f"the weights do not fit: memory {format_size(memory_bytes)} − reserved {format_size(reserved_bytes)} "
            f"− weights {format_size(weights)} = {format_size(available)} left for the KV cache; "
            "give more --memory, less --reserved or a smaller --weight-bytes")


def plan(spec: ModelSpec, memory_bytes: float, reserved_bytes: float, bandwidth_bytes_per_s: float,
         deadline_s: float, tokens: int, kv_bytes: float, weights: float, *, weights_source: str = "",
         contexts: Sequence[int] = CONTEXTS, batches: Sequence[int] = BATCHES, max_context: int | None = None,
         reference_context: int | None = None, head_bytes: float | None = None) -> Plan:
    """Evaluate the KV equation and the roofline over a context × batch grid, plus the what-ifs.

    ``weights`` is M_weights in bytes; ``kv_bytes`` the bytes per KV element (2 for fp16).
    ``max_context`` overrides the model's own maximum (e.g. a RoPE-scaled deployment).
    ``head_bytes``: the LM head's part of ``weights`` (None: its share of the parameters).
    """
    _check_inputs(memory_bytes, reserved_bytes, bandwidth_bytes_per_s, deadline_s, tokens, kv_bytes, weights)
    cap = max_context or spec.max_position_embeddings
    if cap < 1 or not contexts or not batches or min(*contexts, *batches) < 1:
        raise PlanError("contexts, batches and the maximum context must be positive integers")
    reference = min(reference_context or DEFAULT_REFERENCE_CONTEXT, cap)
    budget = Budget(memory_bytes - reserved_bytes - weights, weights, bandwidth_bytes_per_s, deadline_s, tokens)
    grid_contexts, grid_batches = _grid_contexts(contexts, cap), sorted(set(batches))
    cells = tuple(_cell(spec, n, b, kv_bytes, budget) for n in grid_contexts for b in grid_batches)
    per_context = {n: _limit(lambda k, n=n: kv_cache_bytes(spec, n, k, kv_bytes), budget) for n in grid_contexts}
    per_batch = {b: _limit(lambda k, b=b: kv_cache_bytes(spec, k, b, kv_bytes), budget, cap) for b in grid_batches}
    head = weights * head_share(spec) if head_bytes is None else head_bytes
    return Plan(spec, memory_bytes, reserved_bytes, kv_bytes, weights_source, budget, cap, reference,
                kv_bytes_per_token(spec, kv_bytes), head, cells, per_context, per_batch,
                _what_ifs(spec, kv_bytes, budget, reference))


def _cell(spec: ModelSpec, context: int, batch: int, kv_bytes: float, budget: Budget) -> Cell:
    kv = kv_cache_bytes(spec, context, batch, kv_bytes)
    return Cell(context, batch, kv, budget.time_s(kv), budget.status(kv))


# ---------------------------------------------------------------- text and JSON


def format_size(num_bytes: float) -> str:
    """Both unit systems, so nobody mistakes one for the other: ``13.11 GB (12.21 GiB)``."""
    for power, decimal, binary in ((4, "TB", "TiB"), (3, "GB", "GiB"), (2, "MB", "MiB"), (1, "KB", "KiB")):
        if abs(num_bytes) >= 1000**power:
            return f"{num_bytes / 1000**power:.2f} {decimal} ({num_bytes / 1024**power:.2f} {binary})"
    return f"{num_bytes:,.0f} B"


def format_context(tokens: int) -> str:
    """``131072`` -> ``128K`` (K = 1024 tokens, as context lengths are quoted); others stay exact."""
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _header(p: Plan) -> list[str]:
    s, b = p.spec, p.budget
    return [
        f"model        {s.name or 'unnamed'}: L={s.num_layers}, heads {s.num_heads}, n_kv={s.num_kv_heads}, "
        f"d_h={s.head_dim}, {s.num_parameters():,} parameters, max context {p.context_cap:,} tokens",
        f"node         memory {format_size(p.memory_bytes)}, reserved {format_size(p.reserved_bytes)}, "
        f"bandwidth {b.bandwidth_bytes_per_s / 1e9:,.6g} GB/s, deadline {_ms(b.deadline_s)} for {b.tokens} tokens",
        f"KV/token     2·L·n_kv·d_h·b = {kv_product(s, p.kv_bytes)} = {format_size(p.kv_bytes_per_token)}",
        *_groups_text(p),
        f"weights      {b.weights_bytes:,.0f} B = {format_size(b.weights_bytes)}  ({p.weights_source})",
        *_head_text(p),
        f"KV memory    memory − reserved − weights = {b.available_bytes:,.0f} B = {format_size(b.available_bytes)}",
        *textwrap.wrap(TIME_MODEL, 100, initial_indent="time model   ", subsequent_indent=" " * 13),
        f"             weights alone: {_ms(b.time_s(0))}; per-step read budget deadline × BW / tokens = "
        f"{format_size(b.step_bytes)}",
    ]


def _head_text(p: Plan) -> list[str]:
    """The head as a term of its own: its bytes, and what a step whose rows are all constrained
    reads of the weights."""
    s, b = p.spec, p.budget
    constrained = constrained_step_bytes(b.weights_bytes, p.head_bytes, s)
    text = (f"V·d = {s.vocab_size:,}·{s.hidden_size:,} parameters ({head_share(s):.1%}): {format_size(p.head_bytes)} "
            f"of the weights, read whole by a step with an unconstrained row; a step whose rows all allow "
            f"{CONSTRAINED_TOKENS} tokens reads at most {CONSTRAINED_TOKENS} of its "
            f"{-(-s.vocab_size // HEAD_TILE):,} tiles: weights {format_size(constrained)}, alone "
            f"{_ms(b.tokens * constrained / b.bandwidth_bytes_per_s)} for {b.tokens} tokens")
    return textwrap.wrap(text, 100, initial_indent="head         ", subsequent_indent=" " * 13)


def _groups_text(p: Plan) -> list[str]:
    """For a model with sliding-window layers: the per-group equation at the reference context, and
    what it saves against a cache that keeps every layer whole."""
    groups = layer_groups(p.spec)
    if len(groups) == 1:
        return []
    n, s = p.reference_context, p.spec
    terms = " + ".join(f"2·{layers}·{min(n, w) if w else n}·{s.num_kv_heads}·{s.head_dim}·{p.kv_bytes:g}"
                       for layers, w in groups)
    kinds = ", ".join(f"{layers} layers keep {'every token' if not w else f'{w} tokens'}" for layers, w in groups)
    grouped, whole = kv_cache_bytes(s, n, 1, p.kv_bytes), kv_cache_whole_bytes(s, n, 1, p.kv_bytes)
    return [f"KV groups    {kinds}",
            f"             one {format_context(n)} sequence: Σ_g 2·L_g·min(n, w_g)·n_kv·d_h·b = {terms} = "
            f"{format_size(grouped)}",
            f"             every layer whole: {kv_product(s, p.kv_bytes)} × {n:,} = {format_size(whole)}; "
            f"saved {1 - grouped / whole:.1%}"]


def _grid_text(p: Plan) -> list[str]:
    width = max(6, *(len(f"{b}") + 2 for b in p.batches))
    lines = ["", "admissible grid (ok: fits memory and deadline; mem: KV does not fit; time: KV fits, answer too slow)",
             f"{'context':>8} \\ batch" + "".join(f"{b:>{width}}" for b in p.batches)]
    for n in p.contexts:
        lines.append(f"{format_context(n):>16}" + "".join(f"{p.cell(n, b).status:>{width}}" for b in p.batches))
    return lines


def _limits_text(p: Plan) -> list[str]:
    lines = ["", "largest batch per context (any integer, not only grid values)",
             f"{'context':>10}{'max batch':>12}  {'bound by':<10}{'KV at that batch':>26}{'answer time':>14}"]
    for n, limit in p.max_batch_per_context.items():
        kv = kv_cache_bytes(p.spec, n, limit.value, p.kv_bytes)
        lines.append(f"{format_context(n):>10}{limit.value:>12,}  {limit.bound_by:<10}{format_size(kv):>26}"
                     f"{_ms(p.budget.time_s(kv)):>14}")
    lines += ["", "largest context per batch", f"{'batch':>10}{'max context':>14}  bound by"]
    lines += [f"{b:>10}{limit.value:>14,}  {limit.bound_by}" for b, limit in p.max_context_per_batch.items()]
    return lines


def _what_ifs_text(p: Plan) -> list[str]:
    ref = format_context(p.reference_context)
    lines = ["", f"what-ifs (same weights and KV memory; max tokens: all sequences together; "
                 f"max batch at reference context {ref})",
             f"{'variant':<20}{'n_kv':>5}{'b':>8}  {'bytes/token':<36}{'max tokens':>14}{f'max batch @{ref}':>20}"]
    for w in p.what_ifs:
        per_token = f"{w.bytes_per_token:,.0f} B = {format_size(w.bytes_per_token)}"
        batch = f"{w.max_batch.value:,} ({w.max_batch.bound_by})"
        lines.append(f"{w.label:<20}{w.num_kv_heads:>5}{w.kv_bytes:>8g}  {per_token:<36}{w.max_tokens:>14,}"
                     f"{batch:>20}")
    return lines


def render_text(p: Plan) -> str:
    """The plan as a report a reader can check by hand: inputs, equation, grid, limits, what-ifs."""
    return "\n".join(_header(p) + _grid_text(p) + _limits_text(p) + _what_ifs_text(p))


def _num(x: float) -> int | float:
    """Whole numbers as JSON integers: byte counts read better without a trailing ``.0``."""
    return int(x) if float(x).is_integer() else x


def plan_to_json(p: Plan) -> dict:
    """Every number of the report, machine-readable."""
    s, b = p.spec, p.budget
    return {
        "model": {"name": s.name, "num_layers": s.num_layers, "num_heads": s.num_heads,
                  "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "hidden_size": s.hidden_size,
                  "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size,
                  "parameters": s.num_parameters(), "max_context": p.context_cap},
        "inputs": {"memory_bytes": _num(p.memory_bytes), "reserved_bytes": _num(p.reserved_bytes),
                   "bandwidth_bytes_per_s": _num(b.bandwidth_bytes_per_s), "deadline_s": b.deadline_s,
                   "tokens": b.tokens, "kv_bytes_per_element": _num(p.kv_bytes),
                   "reference_context": p.reference_context},
        "kv_bytes_per_token": _num(p.kv_bytes_per_token), "kv_product": kv_product(s, p.kv_bytes),
        "kv_groups": [{"num_layers": layers, "window": window} for layers, window in layer_groups(s)],
        "kv_bytes_at_reference_context": _num(kv_cache_bytes(s, p.reference_context, 1, p.kv_bytes)),
        "kv_bytes_at_reference_context_every_layer_whole":
            _num(kv_cache_whole_bytes(s, p.reference_context, 1, p.kv_bytes)),
        "weights_bytes": _num(b.weights_bytes), "weights_source": p.weights_source,
        "head_bytes": _num(p.head_bytes),
        "constrained_step_weights_bytes": _num(constrained_step_bytes(b.weights_bytes, p.head_bytes, s)),
        "constrained_step_allowed_tokens": CONSTRAINED_TOKENS,
        "available_kv_bytes": _num(b.available_bytes), "step_budget_bytes": b.step_bytes,
        "weights_only_time_s": b.time_s(0), "time_model": TIME_MODEL,
        "grid": [{"context": c.context, "batch": c.batch, "kv_bytes": _num(c.kv_bytes), "time_s": c.time_s,
                  "status": c.status} for c in p.cells],
        "max_batch_per_context": [{"context": n, "max_batch": lim.value, "bound_by": lim.bound_by}
                                  for n, lim in p.max_batch_per_context.items()],
        "max_context_per_batch": [{"batch": n, "max_context": lim.value, "bound_by": lim.bound_by}
                                  for n, lim in p.max_context_per_batch.items()],
        "what_ifs": [{"label": w.label, "num_kv_heads": w.num_kv_heads, "kv_bytes_per_element": _num(w.kv_bytes),
                      "bytes_per_token": _num(w.bytes_per_token), "max_tokens": w.max_tokens,
                      "reference_context": p.reference_context, "max_batch": w.max_batch.value,
                      "bound_by": w.max_batch.bound_by} for w in p.what_ifs],
    }


# ---------------------------------------------------------------- command line

_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)\s*(?:/\s*s)?\s*$", re.IGNORECASE)
_RATE_SCALE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """``900GB/s`` -> 9e11 B/s. GB/TB are decimal, as vendors quote bandwidth; GiB/s is accepted too."""
    match = _RATE.match(text)
    if match is None:
        raise PlanError(f"{flag}: cannot parse {text!r}: use a number with a unit per second, "
                        "e.g. 900GB/s, 3.35TB/s or 31GB/s (GB = 10^9 bytes)")
    rate = float(match.group(1)) * _RATE_SCALE[match.group(2).lower()]
    if rate <= 0:
        raise PlanError(f"{flag} must be positive, got {text!r}")
    return rate


def _parse_size(text: str, flag: str) -> int:
    if text.strip().startswith("-"):
        raise PlanError(f"{flag} cannot be negative: {text!r}")
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise PlanError(f"{flag}: {exc}") from exc


def _parse_per_parameter(text: str) -> float:
    """``--weight-bytes`` takes bytes per parameter: a number (2, 0.5625) or a dtype name (fp16, int4)."""
    if text.lower() in KV_DTYPE_BYTES:
        return KV_DTYPE_BYTES[text.lower()]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise PlanError(f"--weight-bytes: expected bytes per parameter (e.g. 2, 1, 0.5) or one of "
                        f"{', '.join(KV_DTYPE_BYTES)}, got {text!r}")
    return value


def _parse_counts(text: str | None, flag: str) -> list[int] | None:
    """``512,4K,128K`` -> [512, 4096, 131072] (K = 1024 tokens)."""
    if text is None:
        return None
    counts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)([kK]?)", item)
        if match is None or int(match.group(1)) < 1:
            raise PlanError(f"{flag}: expected positive integers like 512,4K,128K, got {item!r}")
        counts.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    if not counts:
        raise PlanError(f"{flag}: the list is empty")
    return counts


def resolve_model(model: str | None, bytes_per_parameter: float | None) -> tuple[ModelSpec, float, str]:
    """A named shape, or a checkpoint's metadata: its spec, M_weights and where that figure comes from."""
    if model is not None and model.lower() in NAMED_SHAPES:
        spec = NAMED_SHAPES[model.lower()]
        per_param = bytes_per_parameter or NAMED_WEIGHT_BYTES
        return spec, weights_bytes(spec, per_param), f"{spec.num_parameters():,} parameters × {per_param:g} B"
    if model is not None and not Path(model).expanduser().exists():
        raise PlanError(f"{model!r} is neither a named shape nor an existing model path; "
                        f"known shapes: {', '.join(NAMED_SHAPES)}")
    from ricllm.model.loader import open_checkpoint  # imports torch: only when a file is planned

    ckpt = open_checkpoint(model)
    spec = replace(ckpt.spec, name=ServedModel.of(ckpt.path, ckpt.spec.name).name)
    if bytes_per_parameter:
        return spec, weights_bytes(spec, bytes_per_parameter), \
            f"{spec.num_parameters():,} parameters × {bytes_per_parameter:g} B"
    return spec, float(checkpoint_size_bytes(ckpt.path)), f"size on disk of {ckpt.path.name} (estimate)"


def cmd_plan(args: argparse.Namespace) -> int:
    per_param = _parse_per_parameter(args.weight_bytes) if args.weight_bytes else None
    memory, reserved = _parse_size(args.memory, "--memory"), _parse_size(args.reserved, "--reserved")
    bandwidth = parse_bandwidth(args.bandwidth)
    contexts, batches = _parse_counts(args.contexts, "--contexts"), _parse_counts(args.batches, "--batches")
    spec, weights, source = resolve_model(args.model, per_param)
    if args.max_loras < 0 or args.lora_rank < 1:
        raise PlanError(f"--max-loras must be ≥ 0 and --lora-rank ≥ 1, got {args.max_loras} and {args.lora_rank}")
    head = weights * head_share(spec)
    adapters, what = adapters_bytes(spec, args.lora_modules or (), args.max_loras, args.lora_rank)
    if adapters:
        weights, source = weights + adapters, f"{source} + {what}: {format_size(adapters)}"
    result = plan(spec, memory, reserved, bandwidth, args.deadline_ms / 1e3, args.tokens,
                  kv_element_bytes(args.kv_dtype, spec), weights, weights_source=source,
                  contexts=contexts or CONTEXTS, batches=batches or BATCHES,
                  max_context=args.max_context, reference_context=args.ref_context, head_bytes=head)
    print(json.dumps(plan_to_json(result), indent=2) if args.json else render_text(result))
    return 0


def add_subparser(subparsers) -> None:
    """Register ``ricllm plan`` on an argparse subparsers object (``func`` = :func:`cmd_plan`)."""
    p = subparsers.add_parser(
        "plan", help="which context × batch fits a node's memory and deadline (KV equation + roofline)",
        description="Capacity plan from the KV-cache equation M_KV = 2·L·n·n_kv·d_h·b·B and the decode "
                    "roofline: " + TIME_MODEL + ". Sizes accept B, KB/MB/GB (10^n) and KiB/MiB/GiB (2^n).")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_OR_SHAPE",
                   help=f"GGUF file, HF folder or a named shape ({', '.join(NAMED_SHAPES)}); "
                        "default: the installed SmolLM2 GGUF")
    p.add_argument("--memory", default="16GiB", help="accelerator memory (default: %(default)s)")
    p.add_argument("--reserved", default="4GiB",
                   help="memory kept for other xApps, activations, runtime (default: %(default)s)")
    p.add_argument("--bandwidth", default="900GB/s", help="memory bandwidth, e.g. 3.35TB/s (default: %(default)s)")
    p.add_argument("--deadline-ms", type=float, default=500.0, help="time for one answer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per answer (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPE_BYTES), default="fp16",
                   help="KV cache element type; int8 and int4 include a 4-byte scale per row of d_h elements, "
                        "as ricllm's int8 cache stores it (default: %(default)s)")
    p.add_argument("--weight-bytes", default=None,
                   help="bytes per parameter (e.g. 2, 0.5 or fp16, int4); default: 2 for named shapes, "
                        "the file size on disk for a checkpoint")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) the node will hold: their bytes add to the weights")
    p.add_argument("--max-loras", type=int, default=0,
                   help="without --lora-modules: this many adapters of --lora-rank on every projection add to the "
                        "weights (default: %(default)s)")
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the --max-loras estimate (default: %(default)s)")
    p.add_argument("--max-context", type=int, default=None, help="override the model's maximum context")
    p.add_argument("--ref-context", type=int, default=None,
                   help=f"context of the what-ifs' max batch (default: {DEFAULT_REFERENCE_CONTEXT}, capped)")
    p.add_argument("--contexts", default=None, help="grid contexts, e.g. 512,4K,32K (default: 512 … 128K)")
    p.add_argument("--batches", default=None, help="grid batches, e.g. 1,8,64 (default: 1 … 256)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_plan)
