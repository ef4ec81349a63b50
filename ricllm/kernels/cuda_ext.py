"""Build-on-first-use loader of the CUDA C++ decode kernel (``kernels/paged_decode.cu``).

``load_extension()`` compiles ``kernels/paged_decode.cu`` and ``kernels/binding.cpp`` with
``torch.utils.cpp_extension.load`` (ninja + nvcc) the first time it is called in a process and
caches the module (torch also caches the build on disk). On a machine without a CUDA device, a
CUDA build of torch, nvcc or ninja it raises ``CudaExtensionUnavailable`` naming what is
missing; a failed compile raises ``CudaExtensionBuildError`` carrying the compiler's message.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from types import ModuleType

import torch

from ricllm.paths import shipped_folder

from .splits import choose_num_splits

CSRC = shipped_folder("kernels")
SOURCES = (CSRC / "paged_decode.cu", CSRC / "binding.cpp")
EXTENSION_NAME = "ricllm_paged_decode"


class CudaExtensionUnavailable(RuntimeError):
    """This machine cannot build the CUDA extension (no GPU, CPU-only torch, nvcc or ninja)."""


class CudaExtensionBuildError(RuntimeError):
    """nvcc or the C++ compiler rejected the extension's sources."""


def cuda_build_problem() -> str | None:
    """Why the extension cannot be built here, or ``None`` when everything it needs is present."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        if shutil.which("nvcc") is None:
            return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@functools.lru_cache(maxsize=1)
def load_extension(verbose: bool = False) -> ModuleType:
    """The compiled extension module; builds it on the first call in this process."""
    problem = cuda_build_problem()
    if problem is not None:
        raise CudaExtensionUnavailable(f"cannot build the CUDA decode kernel: {problem}")
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(path) for path in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],  # torch adds -gencode for the visible GPUs' arch
            verbose=verbose,
        )
    except (RuntimeError, OSError) as exc:
        raise CudaExtensionBuildError(f"building {EXTENSION_NAME} failed: {exc}") from exc


def paged_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    max_context_len: int | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """CUDA kernel with the reference's semantics: ``query [B, H, d] -> [B, H, d]`` (query dtype).

    The query is rounded to the cache dtype before the dot products (fp32 accumulation).
    ``head_dim`` must be 32, 64, 128 or 256. ``num_splits`` as in the Triton kernel.
    """
    ext = load_extension()
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_num_splits(query.shape[0], k_cache.shape[2], max_context_len, query.device)
    return ext.paged_decode_attention(
        query, k_cache, v_cache, block_tables.to(torch.int32), context_lens.to(torch.int32),
        float(scale), int(num_splits))


__all__ = ["CudaExtensionBuildError", "CudaExtensionUnavailable", "cuda_build_problem",
           "load_extension", "paged_decode_attention"]
