"""The CPU paged-attention kernel (``csrc/cpu_paged_attention.c``): build once, load, call.

The C source is compiled on first use with the system C compiler (``-O3 -march=native
-fopenmp``) into ``$RICLLM_CACHE_DIR/kernels/``, keyed by the source, the flags and the CPU, so
later starts only load it (milliseconds). It links no torch headers, so the build takes about a
second. Where there is no compiler, ``cpu_kernel_available()`` says why and the engine keeps
the torch reference path.
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

import torch

from ricllm.paths import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.c"
# Reassociation lets the compiler vectorize the dot products; no -ffast-math: the softmax
# relies on -inf behaving as IEEE says.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-std=c11"]
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS.append("-mprefer-vector-width=512")  # gcc's default of 256 leaves AVX-512 half used
SUPPORTED_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cpu_identity() -> str:
    """The CPU model and flags: ``-march=native`` code is only valid on the CPU it was built on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *CFLAGS, _cpu_identity()]).encode())
    return cache_dir() / "kernels" / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile to a temporary name and rename, so concurrent starts never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(partial), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to build the CPU attention kernel: {result.stderr.strip()[-800:]}")
        os.replace(partial, target)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    path = _library_path(compiler)
    if not path.exists():
        _build(compiler, path)
    lib = ctypes.CDLL(str(path))
    fn = lib.ricllm_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def cpu_kernel_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the kernel builds and loads here; the reason names what failed."""
    try:
        lib = _library()
    except (RuntimeError, OSError) as exc:
        return False, str(exc)
    return True, f"built at {lib._name}"


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu":
        return t  # the common case, checked without dispatching a copy
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def cpu_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``query [T, n_heads, d] -> [T, n_heads, d]``; each query attends causally within its
    sequence, reading K/V in place through the block table (same contract as
    ``reference.paged_attention``: this step's K/V already stored)."""
    if k_cache.dtype not in SUPPORTED_DTYPES or k_cache.device.type != "cpu":
        raise ValueError(f"the CPU attention kernel takes bf16 or fp32 caches on the CPU, got {k_cache.dtype} on {k_cache.device}")
    tables, starts, lens = _int32(block_tables), _int32(query_start_loc), _int32(context_lens)
    q = query if query.dtype == k_cache.dtype and query.is_contiguous() else query.to(k_cache.dtype).contiguous()
    out = torch.empty_like(q)
    _, block_size, n_kv, head_dim = k_cache.shape
    code = _library().ricllm_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), lens.shape[0], q.shape[1], n_kv, head_dim, block_size,
        tables.shape[1], scale, SUPPORTED_DTYPES[k_cache.dtype], torch.get_num_threads())
    if code != 0:
        raise ValueError(f"the CPU attention kernel does not take {q.shape[1]} heads over {n_kv} KV heads "
                         f"of dim {head_dim} (at most 8 query heads per KV head, head_dim <= 128)")
    return out if out.dtype == query.dtype else out.to(query.dtype)
