"""Builds and loads ricllm's CPU kernels (``kernels/cpu_*.c``) as one shared library.

The C sources are compiled on first use with the system C compiler (``-O3 -fopenmp`` and one
family's explicit instruction-set flags) into ``$RICLLM_CACHE_DIR/kernels/``, keyed by the
sources, the flags and the CPU, so later starts only load the library (milliseconds). It links
no torch headers, so the build takes about two seconds. Where there is no compiler,
``cpu_kernels_available()`` says why and the engine keeps the torch reference path.

Families (``FAMILIES``, ascending): ``avx2`` (x86-64-v3: every AVX2 server), ``avx512``
(x86-64-v4 + BF16 + VNNI: Zen 4, Cooper Lake on), ``amx`` (``avx512`` + AMX tiles: Sapphire
Rapids on). The best family whose flags /proc/cpuinfo lists is built and loaded: explicit flags,
unlike ``-march=native``, are valid on every CPU with those flags. ``RICLLM_CPU_KERNELS`` caps
the family (``RICLLM_NO_AMX=1`` caps it at ``avx512``), so one machine measures the others.

Built ahead (the image does, so its runtime stage needs no compiler): ``python -m
ricllm.kernels.cpu_library DIR`` writes one library per x86 family into DIR, and with
``RICLLM_PREBUILT_KERNELS=DIR`` the family this CPU's flags choose is loaded from there (a CPU
below x86-64-v3, or a library built from other sources, is compiled here where a
compiler exists, else the engine keeps the torch path).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ricllm.errors import ConfigError
from ricllm.paths import cache_dir, shipped_folder

CSRC = shipped_folder("kernels")
IS_BF16_BY_NAME = {"bfloat16": 1, "float32": 0}  # the element types the kernels take: their is_bf16 flag
SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_fused_ops.c", CSRC / "cpu_quant_gemm.c",
           CSRC / "cpu_decoder.c", CSRC / "cpu_prefill_attention.c", CSRC / "cpu_lora.c", CSRC / "cpu_team.c")
HEADERS = (CSRC / "cpu_common.h", CSRC / "cpu_lora.h")
# Reassociation lets the compiler vectorize the dot products; no -ffast-math: the softmax
# relies on -inf behaving as IEEE says.
CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-std=c11"]
IS_X86 = platform.machine() in ("x86_64", "AMD64")
# x86 families, ascending: the compiler flags of each, and the /proc/cpuinfo flags its code needs
_V3_CPU = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # x86-64-v3 (abm: lzcnt)
_AVX512_FLAGS = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni",
                 "-mprefer-vector-width=512"]  # gcc's default of 256 leaves AVX-512 half used
_AVX512_CPU = _V3_CPU | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}
FAMILIES = {
    "avx2": (["-march=x86-64-v3"], _V3_CPU),
    "avx512": (_AVX512_FLAGS, _AVX512_CPU),
    "amx": ([*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8"], _AVX512_CPU | {"amx_tile", "amx_bf16"}),
}
NATIVE_FLAGS = ["-march=native"]  # elsewhere (no x86 family runs): the C library without packed products
FAMILY_CAP_VARIABLE = "RICLLM_CPU_KERNELS"
PREBUILT_VARIABLE = "RICLLM_PREBUILT_KERNELS"  # a folder of libraries built ahead, one per family
PREBUILT_TUNING = ["-mtune=generic"]  # built for CPUs not seen yet: tuned for none (scheduling only, not ISA)
# RICLLM_NO_AMX=1: the avx512 family (a separate cached library) on an AMX machine, how it measures the
# path every CPU without AMX (AMD EPYC, older Xeons) takes
AMX_DISABLED = os.environ.get("RICLLM_NO_AMX", "") not in ("", "0")

# the decoder stack's argument layout (kernels/cpu_decoder.c): pointers per layer (norm, 3 per projection:
# weight, scales, offsets; norm, 3, 3; K and V caches), then the dims array in this order
DECODER_DIM_NAMES = ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "layers", "batch", "table_width",
                     "block_size", "is_bf16", "num_threads", "cache_type")
DECODER_POINTERS_PER_LAYER = 16

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # C entry point -> argument types (every one returns int: 0, or a negative code)
    # ..., scale, is_bf16, cache_type, sinks, windows (NULL: exact), num_threads
    "ricllm_paged_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I, _P, _P, _I],
    "ricllm_prefill_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I, _P, _P, _I],
    "ricllm_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I, _P, _P, _I],
    "ricllm_prefill_attention_uses_amx": [],
    "ricllm_add_rms_norm": [_P] * 4 + [_I, _I, _F, _I, _I],
    "ricllm_rope_store": [_P] * 7 + [_I] * 7,
    "ricllm_silu_mul": [_P, _P] + [_I] * 4,
    "ricllm_add_rms_norm_scaled": [_P] * 4 + [_I, _I, _F, _I, _I],
    # qkv, q_weight, k_weight, rows, heads, kv_heads, head_dim, eps, is_bf16, num_threads
    "ricllm_qk_norm": [_P] * 3 + [_I] * 4 + [_F, _I, _I],
    "ricllm_gelu_tanh_mul": [_P, _P] + [_I] * 4,
    "ricllm_bf16_to_f32": [_P, _P, ctypes.c_int64, _I],
    "ricllm_quant_gemm_supported": [_I],
    "ricllm_quant_gemm_uses_amx": [],
    "ricllm_quant_gemm_int4_path": [_I],
    "ricllm_quant_gemm": [_P] * 4 + [_I, _P, _I, _I, _I, _I, _P, _I],
    # x, w, scales, offsets, bits, out, m, k, n, tiles, count, is_bf16, scratch, num_threads
    "ricllm_quant_gemm_tiles": [_P] * 4 + [_I, _P, _I, _I, _I, _P, _I, _I, _P, _I],
    # x, out, layer pointers, bits, final norm, cos, sin, slots, tables, starts, lens, sinks, windows, lora, dims
    "ricllm_decoder_stack": [_P] * 15 + [_F, _F],
    "ricllm_quant_rows": [_P, _P, _I, _P, _I, _I, _I, _P, _I],
    "ricllm_decoder_stack_dims": [],
    "ricllm_decoder_stack_layer_pointers": [],
    "ricllm_decoder_stack_lora_layout": [_I],
    # x, out, layer pointers, bits, final norm, cos, sin, starts, lens, the Gemma3Step, dims; eps, scale
    "ricllm_gemma3_decoder_stack": [_P] * 11 + [_F, _F],
    "ricllm_gemma3_stack_layout": [_I],
    # x, x_stride, y, y_stride, in, out, segments, starts, ends, ranks, a, b_t, scales, is_bf16, weights_bf16, threads
    "ricllm_lora": [_P, ctypes.c_int64, _P, ctypes.c_int64, _I, _I, _I] + [_P] * 6 + [_I, _I, _I],
    "ricllm_pin_team": [_P, _I],  # cpus (int32), count
}


def _cpu_identity() -> str:
    """The CPU model and flags: ``-march=native`` code is only valid on the CPU it was built on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))


BF16_VARIABLE = "RICLLM_CPU_BF16"  # 0 or 1: answers cpu_bf16() instead of the CPU (a test emulating another CPU)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # either gives bf16 products in hardware


def cpu_bf16() -> tuple[bool, str]:
    """``(has, why)``: whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX-BF16),
    and the flag that says so or the flags it lacks. ``RICLLM_CPU_BF16=0|1`` answers instead of
    the CPU. Elsewhere bf16 is only a storage type: torch then widens it to fp32 per product."""
    forced = os.environ.get(BF16_VARIABLE, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"{BF16_VARIABLE}={forced}"
    if forced:
        raise ConfigError(f"{BF16_VARIABLE}={forced!r}: expected 0 or 1")
    found = [flag for flag in BF16_FLAGS if flag in cpu_flags()]
    return (True, found[0]) if found else (False, f"the CPU has no {' or '.join(BF16_FLAGS)} flag")


def family_cap() -> str | None:
    """The highest family allowed by the environment (``RICLLM_CPU_KERNELS``, else ``RICLLM_NO_AMX``),
    None for no cap; ConfigError naming the choices for a value that is no family."""
    cap = os.environ.get(FAMILY_CAP_VARIABLE, "").strip().lower()
    if cap and cap not in FAMILIES:
        raise ConfigError(f"{FAMILY_CAP_VARIABLE}={cap!r} names no kernel family (one of {', '.join(FAMILIES)})")
    if AMX_DISABLED and cap in ("", "amx"):
        return "avx512"
    return cap or None


@functools.lru_cache(maxsize=1)
def cpu_family() -> str | None:
    """The best family this CPU's flags allow under the cap (None: no x86 family runs here)."""
    if not IS_X86:
        return None
    flags, names = cpu_flags(), list(FAMILIES)
    cap = family_cap()
    allowed = names[:names.index(cap) + 1] if cap else names
    return next((name for name in reversed(allowed) if FAMILIES[name][1] <= flags), None)


def family_flags() -> list[str]:
    """The compiler flags of the chosen family (``-mtune=native`` only tunes: valid everywhere)."""
    family = cpu_family()
    if family is None:
        return list(NATIVE_FLAGS)
    return [*FAMILIES[family][0], "-mtune=native"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_identity(compiler: str | None = None) -> str:
    """A digest of what the library is built from (sources, compiler, flags, CPU): whatever is
    measured with these kernels (a latency fit) is stale once it changes."""
    prebuilt = prebuilt_library()
    if prebuilt is not None:  # its name digests the sources and flags; a fit still belongs to this CPU
        return hashlib.sha256(f"{prebuilt.name}\0{_cpu_identity()}".encode()).hexdigest()[:16]
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    flags = [*CFLAGS, *family_flags()]
    key = hashlib.sha256("\0".join([*texts, compiler or _compiler() or "", *flags, _cpu_identity()]).encode())
    return key.hexdigest()[:16]


def prebuilt_name(family: str) -> str:
    """A library built ahead for ``family``: named by the sources and flags alone (not the compiler's
    path nor the CPU: the family's explicit flags run on every CPU that has them)."""
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256("\0".join([*texts, *CFLAGS, *FAMILIES[family][0], *PREBUILT_TUNING]).encode())
    return f"ricllm_cpu-{family}-{digest.hexdigest()[:16]}.so"


def prebuilt_library() -> Path | None:
    """The library built ahead for this CPU's family under ``$RICLLM_PREBUILT_KERNELS``, if there is one."""
    folder, family = os.environ.get(PREBUILT_VARIABLE, ""), cpu_family()
    if not folder or family is None:
        return None
    path = Path(folder) / prebuilt_name(family)
    return path if path.is_file() else None


def build_prebuilt(folder: Path, families: tuple[str, ...] = tuple(FAMILIES)) -> list[Path]:
    """One library per x86 family into ``folder`` (any x86 build machine can: flags need no CPU to compile)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    built = []
    for family in families:
        built.append(Path(folder) / prebuilt_name(family))
        _build(compiler, built[-1], [*FAMILIES[family][0], *PREBUILT_TUNING])
    return built


def _library_path(compiler: str) -> Path:
    return cache_dir() / "kernels" / f"ricllm_cpu-{cpu_family() or 'native'}-{library_identity(compiler)}.so"


def _build(compiler: str, target: Path, flags: list[str]) -> None:
    """Compile to a temporary name and rename, so concurrent starts never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [compiler, *CFLAGS, *flags, f"-I{CSRC}", *map(str, SOURCES), "-o", str(partial), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build the CPU kernels: {result.stderr.strip()[-800:]}")
        os.replace(partial, target)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded library with its entry points typed: the one built ahead for this CPU's family,
    else the one built here (first if needed; RuntimeError without a compiler)."""
    path = prebuilt_library() or _built_here()
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _built_here() -> Path:
    compiler = _compiler()
    if compiler is None:
        hint = f"; {PREBUILT_VARIABLE} has no library for this CPU" if os.environ.get(PREBUILT_VARIABLE) else ""
        raise RuntimeError(f"no C compiler found (set CC, or install gcc){hint}")
    path = _library_path(compiler)
    if not path.exists():
        _build(compiler, path, family_flags())
    return path


@functools.lru_cache(maxsize=2)
def quant_gemm_available(bits: int) -> bool:
    """Whether this CPU runs the packed-weight products at ``bits`` (every x86 family: avx2 and up)
    and the library builds here."""
    try:
        return bool(library().ricllm_quant_gemm_supported(bits))
    except (RuntimeError, OSError):
        return False


def cpu_kernels_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the kernels build and load here; the reason names what failed."""
    try:
        lib = library()
    except (RuntimeError, OSError) as exc:
        return False, str(exc)
    return True, f"built ahead at {lib._name}" if prebuilt_library() else f"built at {lib._name}"


# the 4-bit paths, in kernels/cpu_quant_gemm.c's order (its ``ricllm_quant_gemm_int4_path`` says which runs)
INT4_PATHS = ("int8 activations on maddubs", "int8 activations on VNNI", "bf16 AMX tiles", "dequantized AMX tiles")
INT4_PATH_SCAN_ROWS = 256  # past every row threshold of the C paths


def int4_path(rows: int) -> str:
    """The 4-bit product's path for ``rows`` activation rows on this CPU (one of ``INT4_PATHS``)."""
    return INT4_PATHS[library().ricllm_quant_gemm_int4_path(rows)]


def int4_paths() -> str:
    """The 4-bit paths by row range, as the C library chooses them: e.g. ``int8 activations on VNNI
    1-13 rows, bf16 AMX tiles 14-63, dequantized AMX tiles 64+``."""
    ranges = []  # [path, first row, last row]
    for rows in range(1, INT4_PATH_SCAN_ROWS + 1):
        path = int4_path(rows)
        if ranges and ranges[-1][0] == path:
            ranges[-1][2] = rows
        else:
            ranges.append([path, rows, rows])
    if len(ranges) == 1:
        return f"{ranges[0][0]}, every row count"
    last = len(ranges) - 1
    return ", ".join(f"{path} {first}+" if i == last else f"{path} {first}-{end} rows" if end > first
                     else f"{path} {first} row{'s' if first > 1 else ''}"
                     for i, (path, first, end) in enumerate(ranges))


def kernel_family() -> str:
    """Which batched weight-only products run on this CPU and the 4-bit path per row range, e.g.
    ``avx512-bf16 (int4: int8 activations on VNNI, every row count)``; ``amx`` (built with AMX and
    granted by the kernel), ``avx512-bf16``, ``avx2``, or ``torch`` (the library's products cannot
    run here)."""
    if not quant_gemm_available(8):
        return "torch"
    family = cpu_family()
    name = "amx" if library().ricllm_quant_gemm_uses_amx() else "avx2" if family == "avx2" else "avx512-bf16"
    return f"{name} (int4: {int4_paths()})"


def main(argv: list[str]) -> int:
    """``python -m ricllm.kernels.cpu_library DIR``: build every x86 family's library into DIR."""
    if len(argv) != 1 or not IS_X86:
        print("usage: python -m ricllm.kernels.cpu_library DIR  (on x86-64: one library per kernel family)",
              file=sys.stderr)
        return 2
    for path in build_prebuilt(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
