"""Builds and loads ricllm's CPU kernels (``csrc/cpu_*.c``) as one shared library.

The C sources are compiled on first use with the system C compiler (``-O3 -march=native
-fopenmp``) into ``$RICLLM_CACHE_DIR/kernels/``, keyed by the sources, the flags and the CPU,
so later starts only load the library (milliseconds). It links no torch headers, so the build
takes about two seconds. Where there is no compiler, ``cpu_kernels_available()`` says why and
the engine keeps the torch reference path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ricllm.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
IS_BF16_BY_NAME = {"bfloat16": 1, "float32": 0}  # the element types the kernels take: their is_bf16 flag
SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_fused_ops.c", CSRC / "cpu_quant_gemm.c",
           CSRC / "cpu_decoder.c", CSRC / "cpu_prefill_attention.c")
HEADERS = (CSRC / "cpu_common.h",)
# Reassociation lets the compiler vectorize the dot products; no -ffast-math: the softmax
# relies on -inf behaving as IEEE says.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-std=c11"]
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS.append("-mprefer-vector-width=512")  # gcc's default of 256 leaves AVX-512 half used
# RICLLM_NO_AMX=1 builds without AMX tiles (a separate cached library): how an AMX machine measures the
# path every CPU without AMX (AMD EPYC, older Xeons) takes
AMX_DISABLED = os.environ.get("RICLLM_NO_AMX", "") not in ("", "0")
if AMX_DISABLED and platform.machine() in ("x86_64", "AMD64"):
    CFLAGS += ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]

# the decoder stack's argument layout (csrc/cpu_decoder.c): pointers per layer (norm, 3 per projection:
# weight, scales, offsets; norm, 3, 3; K and V caches), then the dims array in this order
DECODER_DIM_NAMES = ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "layers", "batch", "table_width",
                     "block_size", "is_bf16", "num_threads")
DECODER_POINTERS_PER_LAYER = 16

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # C entry point -> argument types (every one returns int: 0, or a negative code)
    "ricllm_paged_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I],
    "ricllm_prefill_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I],
    "ricllm_attention": [_P] * 7 + [_I] * 6 + [_F, _I, _I],
    "ricllm_prefill_attention_uses_amx": [],
    "ricllm_add_rms_norm": [_P] * 4 + [_I, _I, _F, _I, _I],
    "ricllm_rope_store": [_P] * 7 + [_I] * 7,
    "ricllm_silu_mul": [_P, _P] + [_I] * 4,
    "ricllm_quant_gemm_supported": [_I],
    "ricllm_quant_gemm_uses_amx": [],
    "ricllm_quant_gemm": [_P] * 4 + [_I, _P, _I, _I, _I, _I, _P, _I],
    "ricllm_decoder_stack": [_P] * 12 + [_F, _F],
    "ricllm_quant_rows": [_P, _P, _I, _P, _I, _I, _I, _P, _I],
    "ricllm_decoder_stack_dims": [],
    "ricllm_decoder_stack_layer_pointers": [],
}


def _cpu_identity() -> str:
    """The CPU model and flags: ``-march=native`` code is only valid on the CPU it was built on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_identity(compiler: str | None = None) -> str:
    """A digest of what the library is built from (sources, compiler, flags, CPU): whatever is
    measured with these kernels (a latency fit) is stale once it changes."""
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, compiler or _compiler() or "", *CFLAGS, _cpu_identity()]).encode())
    return key.hexdigest()[:16]


def _library_path(compiler: str) -> Path:
    return cache_dir() / "kernels" / f"ricllm_cpu-{library_identity(compiler)}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile to a temporary name and rename, so concurrent starts never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [compiler, *CFLAGS, f"-I{CSRC}", *map(str, SOURCES), "-o", str(partial), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build the CPU kernels: {result.stderr.strip()[-800:]}")
        os.replace(partial, target)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded library with its entry points typed; builds it first if needed (RuntimeError)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    path = _library_path(compiler)
    if not path.exists():
        _build(compiler, path)
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


@functools.lru_cache(maxsize=2)
def quant_gemm_available(bits: int) -> bool:
    """Whether this CPU runs the packed-weight products at ``bits`` (8: AVX-512 VNNI; 4: AVX-512
    BF16 too) and the library builds here."""
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
    return True, f"built at {lib._name}"


def kernel_family() -> str:
    """Which batched weight-only products run on this CPU: ``amx`` (tiles), ``avx512-bf16``,
    ``avx512-vnni`` (8-bit only), or ``torch`` (the library's products cannot run here)."""
    if not quant_gemm_available(8):
        return "torch"
    if library().ricllm_quant_gemm_uses_amx():
        return "amx"
    return "avx512-bf16" if quant_gemm_available(4) else "avx512-vnni"
