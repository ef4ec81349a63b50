#!/usr/bin/env python3
"""Decode-kernel benchmark for one GPU (sized for an H200, about 4 minutes): correctness, then speed.

Run from the repository root: ``python benchmarks/gpu_kernels.py [--out FILE] [--tune]``.
Imports only torch, triton, ``ricllm.attention.reference`` and ``ricllm.kernels``, so it runs on a
bare GPU machine without the project's other dependencies (or ricllm installed).

1. Correctness on large shapes against the torch reference: Triton one-pass and split-K in fp16
   and bf16, on int8 caches (``kv_cache_dtype="int8"``: the same uint8 pool in both) and with sink +
   window retention (evicted blocks' table entries -1), ``store_kv`` (exact and int8), and the CUDA
   C++ kernel when it builds (a failed build is reported and the run goes on).
2. Speed, fp16 cache, block size 16, SmolLM2 (9 q / 3 kv heads x 64) and Llama-3-8B (32 / 8 x 128)
   head shapes, batch 1..256 x context 512..32768: kernel time (median of CUDA-graph replays timed
   with CUDA events), bytes that must move (K/V of every context token + q + out), and that as a
   fraction of the device-to-device copy bandwidth measured first (bytes read + written by a 1 GiB
   copy), next to Triton on an int8 cache of the same shape (its own bytes: d + 4 per row), the
   torch paged reference and SDPA on contiguous K/V.

``--dry-run`` runs every step on CPU through the Triton interpreter at tiny sizes (no file is
written unless ``--out`` is given): it checks imports, shapes and the report, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@dataclass(frozen=True)
class HeadShape:
    name: str
    n_heads: int
    n_kv: int
    head_dim: int


SMOLLM2 = HeadShape("SmolLM2", 9, 3, 64)
LLAMA3_8B = HeadShape("Llama-3-8B", 32, 8, 128)
GEMMA3_270M = HeadShape("Gemma 3 270M", 4, 1, 256)  # its windowed layers: the window checks below
BLOCK_SIZE = 16


@dataclass
class Settings:
    """Sizes and budgets; ``dry_run`` shrinks everything to what the interpreter can do."""

    device: torch.device
    dry_run: bool
    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (512, 4096, 32768)
    shapes: tuple[HeadShape, ...] = (SMOLLM2, LLAMA3_8B, GEMMA3_270M)
    check_batch: int = 48
    check_max_context: int = 6000
    timing_reps: int = 30
    timing_budget_s: float = 1.5
    copy_bytes: int = 1 << 30
    notes: list[str] = field(default_factory=list)

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Settings:
        if not args.dry_run:
            return cls(torch.device("cuda"), False)
        return cls(torch.device("cpu"), True, batches=(1, 3), contexts=(40,), check_batch=3,
                   check_max_context=70, timing_reps=2, timing_budget_s=0.1, copy_bytes=1 << 20)


# ------------------------------------------------------------------------------------------
# imports
# ------------------------------------------------------------------------------------------


def import_reference() -> types.ModuleType:
    """``ricllm.attention.reference``; if ``ricllm/__init__`` needs packages this machine lacks,
    stand in for the package initialisers (``ricllm``, ``ricllm.attention``) with bare packages, so
    only the torch-only modules this script needs run."""
    try:
        return importlib.import_module("ricllm.attention.reference")
    except ImportError as exc:
        print(f"note: importing ricllm failed ({exc}); loading its kernel and reference modules bare")
    for name, path in (("ricllm", ROOT / "ricllm"), ("ricllm.attention", ROOT / "ricllm" / "attention")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    return importlib.import_module("ricllm.attention.reference")


# ------------------------------------------------------------------------------------------
# problems
# ------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One decode step over a paged cache whose blocks are scattered through the pool."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def bytes_moved(self) -> int:
        """K and V of every context token, plus q read and out written (the decode floor).
        An int8 cache's rows are ``uint8 [d + 4]``: their bytes, scales included."""
        _, _, n_kv, head_dim = self.k_cache.shape
        kv = 2 * int(self.context_lens.sum()) * n_kv * head_dim * self.k_cache.element_size()
        return kv + 2 * self.query.numel() * self.query.element_size()


def make_problem(shape: HeadShape, contexts: list[int], dtype: torch.dtype, device: torch.device,
                 spare_blocks: int = 0) -> Problem:
    """Random problem; block tables are a random permutation of the pool (plus spare blocks)."""
    batch, width = len(contexts), -(-max(contexts) // BLOCK_SIZE)
    num_blocks = batch * width + spare_blocks
    cache_shape = (num_blocks, BLOCK_SIZE, shape.n_kv, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device)[: batch * width].view(batch, width)
    query = torch.randn(batch, shape.n_heads, shape.head_dim, dtype=dtype, device=device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return Problem(query, k_cache, v_cache, tables.to(torch.int32).contiguous(), lens, max(contexts))


def random_int8_cache(like: torch.Tensor) -> torch.Tensor:
    """An int8 pool (``ricllm.cache.kv_format`` rows: d int8 values, then an fp32 scale) shaped like
    ``like``, drawn directly: quantizing a large fp16 pool would need an fp32 copy of it."""
    *rows, head_dim = like.shape
    values = torch.randint(-127, 128, (*rows, head_dim), dtype=torch.int8, device=like.device)
    scales = torch.rand(*rows, 1, device=like.device) * 0.05
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def as_int8(p: Problem, reference: types.ModuleType) -> Problem:
    """The problem with its K/V quantized into int8 pools (the reference's ``quantize_rows``)."""
    k_cache, v_cache = (reference.quantize_rows(cache) for cache in (p.k_cache, p.v_cache))
    return Problem(p.query, k_cache, v_cache, p.block_tables, p.context_lens, p.max_context_len)


def windowed(p: Problem, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (sinks, window) per sequence, a quarter of them exact (window 0), and the block table
    with the blocks that no query sees set to -1, as after eviction (``KVWindow.evictable``)."""
    batch = p.context_lens.shape[0]
    sinks = torch.randint(0, 9, (batch,), generator=gen)
    windows = torch.randint(1, max(2, p.max_context_len // 2), (batch,), generator=gen)
    windows[::4] = 0
    tables = p.block_tables.clone()
    for row, (ctx, s, w) in enumerate(zip(p.context_lens.tolist(), sinks.tolist(), windows.tolist())):
        first, end = -(-s // BLOCK_SIZE), max(ctx - w, 0) // BLOCK_SIZE  # blocks entirely before key ctx - w
        if w and end > first:
            tables[row, first:end] = -1
    device = p.query.device
    return sinks.to(device, torch.int32), windows.to(device, torch.int32), tables


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------


def median_time_us(fn: Callable[[], object], settings: Settings) -> float:
    """Median microseconds of ``fn``: CUDA-graph replays timed with events (eager if capture
    fails), at most ``timing_reps`` runs or about ``timing_budget_s`` seconds."""
    if settings.device.type != "cuda":
        return _wall_clock_us(fn, settings)
    fn()
    torch.cuda.synchronize()
    run = _graphed(fn) or fn
    for _ in range(2):
        run()
    times, spent = [], 0.0
    while len(times) < settings.timing_reps and (len(times) < 3 or spent < settings.timing_budget_s):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        spent += times[-1] * 1e-6
    return statistics.median(times)


def _graphed(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (removes Python launch overhead), or None if it can't be."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except RuntimeError as exc:
        print(f"  note: CUDA graph capture failed ({str(exc).splitlines()[0]}); timing eagerly")
        torch.cuda.synchronize()
        return None


def _wall_clock_us(fn: Callable[[], object], settings: Settings) -> float:
    times = []
    for _ in range(settings.timing_reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def copy_bandwidth(settings: Settings) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(settings.copy_bytes, dtype=torch.uint8, device=settings.device)
    dst = torch.empty_like(src)
    src.random_(0, 256)
    seconds = median_time_us(lambda: dst.copy_(src), settings) * 1e-6
    return 2 * settings.copy_bytes / seconds


# ------------------------------------------------------------------------------------------
# kernels under test
# ------------------------------------------------------------------------------------------


@dataclass
class Kernels:
    """The implementations being compared; ``cuda`` is None when the extension did not build."""

    reference: types.ModuleType
    triton: types.ModuleType
    cuda: Callable[..., torch.Tensor] | None
    cuda_status: str


def load_kernels(settings: Settings) -> Kernels:
    reference = import_reference()
    kernels = importlib.import_module("ricllm.kernels")
    ok, reason = kernels.triton_available()
    print(f"triton: {reason}")
    if not ok:
        raise SystemExit(f"cannot run: {reason}")
    triton_decode = importlib.import_module("ricllm.kernels.triton_decode")
    cuda_ext = importlib.import_module("ricllm.kernels.cuda_ext")
    started = time.perf_counter()
    try:
        cuda_ext.load_extension()
        cuda, status = cuda_ext.paged_decode_attention, f"built in {time.perf_counter() - started:.0f} s"
    except (cuda_ext.CudaExtensionUnavailable, cuda_ext.CudaExtensionBuildError) as exc:
        cuda, status = None, f"unavailable: {str(exc)[-2000:]}"
    print(f"CUDA extension: {status}")
    settings.notes.append(f"CUDA extension: {status.splitlines()[0]}")
    return Kernels(reference, triton_decode, cuda, status)


# ------------------------------------------------------------------------------------------
# (a) correctness
# ------------------------------------------------------------------------------------------


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64; NaN anywhere counts as infinite error."""
    out64, ref64 = out.double(), expected.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm())


def check_correctness(kernels: Kernels, settings: Settings) -> list[str]:
    """Every implementation against the reference on mixed-length batches; returns report lines."""
    dtypes = [torch.float16] if settings.dry_run else [torch.float16, torch.bfloat16]
    limits = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
    gen = torch.Generator().manual_seed(0)
    lines, failures = [], 0
    for shape in settings.shapes:
        for dtype in dtypes:
            contexts = torch.randint(1, settings.check_max_context + 1, (settings.check_batch,),
                                     generator=gen).tolist()
            problem = make_problem(shape, contexts, dtype, settings.device, spare_blocks=1000)
            for name, err in _decode_errors(kernels, problem):
                ok = err < limits[dtype]
                failures += not ok
                lines.append(f"| {shape.name} | {str(dtype)[6:]} | {name} | {err:.2e} | "
                             f"{'PASS' if ok else 'FAIL'} |")
        for cache in ("exact", "int8"):
            store_ok = _check_store_kv(kernels, shape, settings, cache == "int8")
            failures += not store_ok
            lines.append(f"| {shape.name} | float16 | store_kv ({cache}) | - | {'PASS' if store_ok else 'FAIL'} |")
    header = ["| heads | dtype | kernel | rel. error | result |", "|---|---|---|---|---|"]
    print("\n".join(header + lines))
    print(f"correctness: {'all passed' if failures == 0 else f'{failures} FAILED'}")
    return header + lines


def _decode_errors(kernels: Kernels, p: Problem) -> list[tuple[str, float]]:
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    expected = kernels.reference.paged_decode_attention(*args, p.max_context_len)
    runs = {f"triton splits={s}": (kernels.triton.paged_decode_attention, s) for s in (1, 4)}
    runs["triton splits=auto"] = (kernels.triton.paged_decode_attention, None)
    if kernels.cuda is not None:
        runs.update({f"cuda splits={s}": (kernels.cuda, s) for s in (1, 4)})
    results = []
    for name, (fn, splits) in runs.items():
        out = fn(*args, max_context_len=p.max_context_len, num_splits=splits)
        results.append((name, relative_error(out, expected)))
    return results + _triton_variant_errors(kernels, p)


def _triton_variant_errors(kernels: Kernels, p: Problem) -> list[tuple[str, float]]:
    """Triton on int8 caches and with sink + window retention, each against the reference on the
    same pool and mask (so only the kernel's arithmetic is measured, not quantization)."""
    reference, decode = kernels.reference, kernels.triton.paged_decode_attention
    sinks, windows, tables = windowed(p, torch.Generator().manual_seed(1))
    visible = reference.decode_mask(p.context_lens, p.max_context_len, sinks, windows)
    results = []
    for label, q in (("", p), ("int8 ", as_int8(p, reference))):
        for splits in (1, None):
            exact = (q.query, q.k_cache, q.v_cache, q.block_tables, q.context_lens, q.scale)
            cut = (q.query, q.k_cache, q.v_cache, tables, q.context_lens, q.scale)
            name = f"splits={splits or 'auto'}"
            if label:
                out = decode(*exact, max_context_len=q.max_context_len, num_splits=splits)
                expected = reference.paged_decode_attention(*exact, q.max_context_len)
                results.append((f"triton int8 {name}", relative_error(out, expected)))
            out = decode(*cut, max_context_len=q.max_context_len, num_splits=splits, kv_sinks=sinks,
                         kv_windows=windows)
            expected = reference.paged_decode_attention(*cut, q.max_context_len, visible=visible)
            results.append((f"triton {label}window {name}", relative_error(out, expected)))
    return results


def _check_store_kv(kernels: Kernels, shape: HeadShape, settings: Settings, int8: bool = False) -> bool:
    """Triton store_kv equals the reference bit for bit, padding slots (-1) skipped; ``int8``: into
    int8 pools (quantized as ``quantize_rows``, ties to even)."""
    p = make_problem(shape, [BLOCK_SIZE * 4] * 2, torch.float16, settings.device)
    if int8:
        p = as_int8(p, kernels.reference)
    n_tokens = 64 if not settings.dry_run else 8
    slots = torch.randperm(p.k_cache.shape[0] * BLOCK_SIZE, device=settings.device)[:n_tokens]
    slots[::5] = -1
    key = torch.randn(n_tokens, shape.n_kv, shape.head_dim, device=settings.device)
    value = torch.randn_like(key)
    expected_k, expected_v = p.k_cache.clone(), p.v_cache.clone()
    kernels.reference.store_kv(key, value, expected_k, expected_v, slots)
    kernels.triton.store_kv(key, value, p.k_cache, p.v_cache, slots)
    return torch.equal(p.k_cache, expected_k) and torch.equal(p.v_cache, expected_v)


# ------------------------------------------------------------------------------------------
# (b) speed
# ------------------------------------------------------------------------------------------

SPEED_HEADER = [
    "| heads | batch | context | splits | MB moved | triton µs | triton % copy | triton 1-pass µs "
    "| cuda µs | cuda % copy | int8 MB moved | triton int8 µs | int8 % copy | torch paged µs | SDPA contiguous µs |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def benchmark_speed(kernels: Kernels, settings: Settings, copy_bw: float) -> list[str]:
    """One table row per (head shape, batch, context) that fits in memory."""
    lines = list(SPEED_HEADER)
    print("\n".join(lines))
    for shape in settings.shapes:
        for batch in settings.batches:
            for context in settings.contexts:
                row = _speed_row(kernels, settings, copy_bw, shape, batch, context)
                print(row, flush=True)
                lines.append(row)
                _free(settings)
    return lines


def _speed_row(kernels: Kernels, settings: Settings, copy_bw: float, shape: HeadShape,
               batch: int, context: int) -> str:
    kv_bytes = 2 * batch * context * shape.n_kv * shape.head_dim * 2
    if kv_bytes * (1 + (shape.head_dim + 4) / (2 * shape.head_dim)) > 0.4 * _free_bytes(settings):  # + int8
        return f"| {shape.name} | {batch} | {context} | - | {kv_bytes / 1e6:.0f} | skipped: does not fit |"
    p = make_problem(shape, [context] * batch, torch.float16, settings.device)
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    splits = kernels.triton.choose_num_splits(batch, shape.n_kv, context, settings.device)

    def timed(fn: Callable[..., torch.Tensor], num_splits: int) -> float:
        return median_time_us(lambda: fn(*args, max_context_len=context, num_splits=num_splits), settings)

    def pct(us: float) -> str:
        return f"{100 * p.bytes_moved() / (us * 1e-6) / copy_bw:.0f}%"

    t_triton = timed(kernels.triton.paged_decode_attention, splits)
    t_one = timed(kernels.triton.paged_decode_attention, 1) if splits > 1 else t_triton
    cuda = ("-", "-")
    if kernels.cuda is not None:
        t_cuda = timed(kernels.cuda, splits)
        cuda = (f"{t_cuda:.1f}", pct(t_cuda))
    return (f"| {shape.name} | {batch} | {context} | {splits} | {p.bytes_moved() / 1e6:.1f} "
            f"| {t_triton:.1f} | {pct(t_triton)} | {t_one:.1f} | {cuda[0]} | {cuda[1]} "
            f"| {_time_int8(kernels, settings, copy_bw, p, splits)} "
            f"| {_time_reference(kernels, settings, p)} | {_time_sdpa(settings, p)} |")


def _time_int8(kernels: Kernels, settings: Settings, copy_bw: float, p: Problem, splits: int) -> str:
    """Three cells: the int8 pool's bytes moved, Triton's time on it and that as % of copy bandwidth."""
    q = Problem(p.query, random_int8_cache(p.k_cache), random_int8_cache(p.v_cache), p.block_tables,
                p.context_lens, p.max_context_len)
    args = (q.query, q.k_cache, q.v_cache, q.block_tables, q.context_lens, q.scale)
    us = median_time_us(lambda: kernels.triton.paged_decode_attention(
        *args, max_context_len=q.max_context_len, num_splits=splits), settings)
    return f"{q.bytes_moved() / 1e6:.1f} | {us:.1f} | {100 * q.bytes_moved() / (us * 1e-6) / copy_bw:.0f}%"


def _time_reference(kernels: Kernels, settings: Settings, p: Problem) -> str:
    """The torch paged reference, unless its gathered fp32 copies would not fit."""
    batch, n_heads, head_dim = p.query.shape
    n_kv = p.k_cache.shape[2]
    need = batch * p.max_context_len * (n_kv * head_dim * 2 * (2 + 4) + n_heads * 4 * 3)
    if need > 0.4 * _free_bytes(settings):
        return "skip (memory)"
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, p.max_context_len)
    try:
        return f"{median_time_us(lambda: kernels.reference.paged_decode_attention(*args), settings):.1f}"
    except torch.OutOfMemoryError:
        _free(settings)
        return "OOM"


def _time_sdpa(settings: Settings, p: Problem) -> str:
    """``scaled_dot_product_attention`` over contiguous ``[B, n_kv, ctx, d]`` K/V (GQA)."""
    batch, n_heads, head_dim = p.query.shape
    n_kv = p.k_cache.shape[2]
    if 2 * p.k_cache.numel() * 2 > 0.4 * _free_bytes(settings):
        return "skip (memory)"
    try:
        keys = torch.randn(batch, n_kv, p.max_context_len, head_dim, dtype=p.query.dtype,
                           device=settings.device)
        values = torch.randn_like(keys)
        q = p.query.unsqueeze(2)
        us = median_time_us(
            lambda: F.scaled_dot_product_attention(q, keys, values, scale=p.scale, enable_gqa=True),
            settings)
        return f"{us:.1f}"
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        _free(settings)
        return f"failed ({type(exc).__name__})"


def _free_bytes(settings: Settings) -> int:
    if settings.device.type != "cuda":
        return 1 << 33
    free, _ = torch.cuda.mem_get_info()
    return free


def _free(settings: Settings) -> None:
    if settings.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# tuning sweep (optional)
# ------------------------------------------------------------------------------------------


def tune(kernels: Kernels, settings: Settings, copy_bw: float) -> list[str]:
    """Triton launch configurations and split counts on a few memory-bound cases."""
    config_cls = kernels.triton.DecodeConfig
    configs = [config_cls(t, w, 2) for t in (16, 32, 64) for w in (2, 4, 8)]
    configs += [config_cls(32, 4, 1), config_cls(32, 4, 3), config_cls(64, 4, 3), config_cls(64, 8, 3)]
    cases = [(shape, 64, 4096) for shape in settings.shapes] + [(LLAMA3_8B, 16, 4096)]
    if settings.dry_run:
        configs, cases = configs[:2], [(SMOLLM2, 2, 40)]
    lines = ["| heads | batch | context | tile | warps | stages | splits | µs | % copy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, batch, context in cases:
        p = make_problem(shape, [context] * batch, torch.float16, settings.device)
        args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
        auto = kernels.triton.choose_num_splits(batch, shape.n_kv, context, settings.device)
        for config in configs:
            for splits in sorted({1, auto, 2 * auto}):
                us = median_time_us(lambda: kernels.triton.paged_decode_attention(
                    *args, max_context_len=context, num_splits=splits, config=config), settings)
                pct = 100 * p.bytes_moved() / (us * 1e-6) / copy_bw
                lines.append(f"| {shape.name} | {batch} | {context} | {config.tile_tokens} | "
                             f"{config.num_warps} | {config.num_stages} | {splits} | {us:.1f} | {pct:.0f}% |")
        _free(settings)
    print("\n".join(lines))
    return lines


# ------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------


def end_to_end(args: argparse.Namespace) -> list[str]:
    """Markdown lines of the SmolLM2 end-to-end section: decode tok/s, Triton vs torch backend."""
    from benchmarks.gpu_e2e import end_to_end_table

    if args.dry_run:  # the same code path at a tiny size, torch backend on the CPU: no Triton there
        from benchmarks.gpu_e2e import decode_throughput

        tps, logits = decode_throughput("torch", batch=2, prompt_len=8, steps=4, device="cpu")
        assert torch.isfinite(logits).all() and logits.shape == (2, 49152)
        return [f"(dry run: torch backend on the CPU, batch 2, 8-token prompts: {tps:.0f} tok/s; "
                "the Triton comparison needs CUDA)"]
    return end_to_end_table()


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="markdown report (default benchmarks/gpu_results.md; none in --dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on CPU through the Triton interpreter")
    parser.add_argument("--tune", action="store_true", help="also sweep Triton launch configurations")
    parser.add_argument("--skip-speed", action="store_true", help="correctness only")
    args = parser.parse_args(argv)
    if args.out is None and not args.dry_run:
        args.out = ROOT / "benchmarks" / "gpu_results.md"
    return args


def write_report(path: Path, sections: list[tuple[str, list[str]]], settings: Settings,
                 argv: list[str]) -> None:
    device = torch.cuda.get_device_name() if settings.device.type == "cuda" else "CPU (dry run)"
    lines = [
        "# Decode kernel benchmark",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- device: {device}; torch {torch.__version__}; triton {_triton_version()}",
        f"- command: `python {' '.join(['benchmarks/gpu_kernels.py', *argv])}`",
        *(f"- {note}" for note in settings.notes),
    ]
    for title, body in sections:
        if body:
            lines += ["", f"## {title}", "", *body]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def _triton_version() -> str:
    import triton

    return triton.__version__


def run_step(title: str, step: Callable[[], list[str]], settings: Settings) -> list[str]:
    """Run one report section; an exception is printed and reported, and the run goes on."""
    print(f"\n== {title}", flush=True)
    started = time.perf_counter()
    try:
        lines = step()
    except Exception:  # noqa: BLE001 - one broken section must not lose the others' results
        trace = traceback.format_exc()
        print(trace, flush=True)
        lines = ["FAILED:", "", "```", *trace.strip().splitlines()[-12:], "```"]
    _free(settings)
    print(f"== {title}: {time.perf_counter() - started:.0f} s", flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import triton
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on CPU")
    settings = Settings.for_args(args)
    started = time.perf_counter()
    kernels = load_kernels(settings)
    copy_bw = copy_bandwidth(settings)
    settings.notes.append(f"device-to-device copy: {copy_bw / 1e9:.1f} GB/s (read + write, "
                          f"{settings.copy_bytes >> 20} MiB buffer); '% copy' = bytes moved / time / that")
    print(settings.notes[-1])
    steps = [("Correctness (relative L2 error vs torch reference)", lambda: check_correctness(kernels, settings))]
    if args.tune:
        steps.append(("Triton tuning sweep", lambda: tune(kernels, settings, copy_bw)))
    if not args.skip_speed:
        steps.append(("Decode speed (fp16 and int8 caches, block size 16)",
                      lambda: benchmark_speed(kernels, settings, copy_bw)))
    steps.append(("End to end", lambda: end_to_end(args)))
    sections = [(title, run_step(title, step, settings)) for title, step in steps]
    settings.notes.append(f"total run time: {time.perf_counter() - started:.0f} s")
    if args.out is not None:
        write_report(args.out, sections, settings, argv)


if __name__ == "__main__":
    main()
