"""Weight-only products per kernel family: ricllm's C library against torch's int4/int8 kernels.

For every family this CPU runs (``RICLLM_CPU_KERNELS`` caps the family, so an AMX machine measures
avx512 and avx2 too), each of SmolLM2-135M's shapes and each row count, the C product
(``cpu_quant.quant_gemm``) is timed against what the torch runtime runs without ricllm's library
(``PackedLinear`` in torch's layout: ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``),
bf16 activations. Each family runs in its own process, with torch capped to the same instruction
set (``ATEN_CPU_CAPABILITY``, oneDNN's ISA). The two are timed alternately, ``--repeats`` times;
the table gives the C time and the speedup torch/C as median [min-max] over the repeats.

    python benchmarks/bench_quant_gemm.py [--families amx avx512 avx2] [--rows 1 2 4 8 16 32 64] [--publish]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

# (name, K, N, bits): SmolLM2-135M's projections (Q4_1 layers) and its LM head (int4 and the int8 it ships as)
SHAPES = [("q/o 576->576", 576, 576, 4), ("k/v 576->192", 576, 192, 4), ("gate/up 576->1536", 576, 1536, 4),
          ("down 1536->576", 1536, 576, 4), ("head 576->49152", 576, 49152, 4), ("head 576->49152", 576, 49152, 8)]
TORCH_CAPABILITY = {"avx2": "avx2", "avx512": "avx512", "amx": "avx512"}  # ATen's names for its kernel builds
MARK = "BENCH_QUANT_GEMM "
MEASURE_S = 0.02  # per timing: enough calls for about this long


def per_call_s(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def calls_for(fn) -> int:
    fn()
    return max(1, int(MEASURE_S / max(per_call_s(fn, 1), 1e-7)))


def measure_family(rows_list: list[int], repeats: int, threads: int) -> dict:
    """Runs in the family's own process: ``{shape/bits/rows: [c_us, ...], [speedup, ...]}``."""
    import torch
    from ricllm.kernels import cpu_quant
    from ricllm.kernels.cpu_library import kernel_family

    from ricllm.model.packed_linear import PackedLinear

    torch.set_num_threads(threads)
    results = {}
    for name, k, n, bits in SHAPES:
        fmt = "int4" if bits == 4 else "int8"
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.05
        ours = PackedLinear.pack(weight, fmt, max_packed_rows=None, layout="vnni")
        theirs = PackedLinear.pack(weight, fmt, max_packed_rows=None, layout="torch")
        for rows in rows_list:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            c_product = functools.partial(cpu_quant.quant_gemm, x, ours.packed_weight, ours.packed_scales,
                                          ours.packed_offsets, bits, n)
            torch_product = functools.partial(theirs, x)
            c_calls, torch_calls = calls_for(c_product), calls_for(torch_product)
            c_times, speedups = [], []
            for _ in range(repeats):  # alternated, so a noisy moment hits both
                c_s, torch_s = per_call_s(c_product, c_calls), per_call_s(torch_product, torch_calls)
                c_times.append(c_s * 1e6)
                speedups.append(torch_s / c_s)
            results[f"{name}|{bits}|{rows}"] = [c_times, speedups]
    return {"family": kernel_family(), "results": results}


def run_family(family: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "RICLLM_CPU_KERNELS": family, "ATEN_CPU_CAPABILITY": TORCH_CAPABILITY[family],
           "RICLLM_LOG_LEVEL": "warning"}
    if family != "amx":
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2" if family == "avx2" else "AVX512_CORE_BF16"
    command = [sys.executable, __file__, "--child", "--rows", *map(str, args.rows), "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    line = next((line for line in done.stdout.splitlines() if line.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"family {family} failed: {done.stderr[-2000:]}")
    return json.loads(line[len(MARK):])


def runnable_families() -> list[str]:
    from ricllm.kernels.cpu_library import FAMILIES, cpu_flags

    flags = cpu_flags()
    return [name for name, (_, needs) in FAMILIES.items() if needs <= flags]


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def table(measured: dict[str, dict], rows_list: list[int]) -> str:
    lines = ["| family | shape | bits | " + " | ".join(f"{r} rows" for r in rows_list) + " |",
             "|---|---|---|" + "---|" * len(rows_list)]
    for data in measured.values():
        for name, _, _, bits in SHAPES:
            cells = []
            for rows in rows_list:
                c_times, speedups = data["results"][f"{name}|{bits}|{rows}"]
                cells.append(f"{statistics.median(c_times):.0f} us, {spread(speedups, 2)}x")
            lines.append(f"| {data['family']} | {name} | {bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", choices=["amx", "avx512", "avx2"],
                        help="default: every family this CPU runs")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--publish", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(MARK + json.dumps(measure_family(args.rows, args.repeats, args.threads)))
        return
    from ricllm.kernels.cpu_library import cpu_flags

    from benchmarks.results import publish

    measured = {family: run_family(family, args) for family in args.families or runnable_families()}
    simd = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))))
    details = (f"Per cell: C time (median), speedup torch/C as median [min-max] of {args.repeats} alternated "
               f"repeats, bf16 activations, {args.threads} threads. CPU flags: {simd}.\n")
    publish("Weight-only products per kernel family (bench_quant_gemm)", details, table(measured, args.rows),
            append=args.publish)


if __name__ == "__main__":
    main()
