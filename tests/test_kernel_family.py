"""Kernel families: what runs is chosen from the CPU, said in `ricllm info` and the ready log, and
the AMX family can be turned off (RICLLM_NO_AMX=1) so an AMX machine measures the path other CPUs take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ricllm.kernels.cpu_library import FAMILY_CAP_VARIABLE, cpu_bf16, cpu_family, kernel_family, quant_gemm_available

ROOT = Path(__file__).resolve().parents[1]


def _without_bf16_kernels() -> str | None:
    """Why this process cannot run the avx512-bf16 family (None: it can): the bf16 probe's answer
    names the missing CPU flag (or RICLLM_CPU_BF16=0, an emulated CPU); a cap keeps the family lower."""
    has_bf16, why = cpu_bf16()
    if not has_bf16:
        return f"needs AVX-512 BF16 and VNNI: {why}"
    if not quant_gemm_available(4) or cpu_family() not in ("avx512", "amx"):
        return (f"needs the avx512 or amx kernel family; this process runs {cpu_family() or 'none'} "
                f"({FAMILY_CAP_VARIABLE}={os.environ.get(FAMILY_CAP_VARIABLE, '')!r})")
    return None


WITHOUT_BF16_KERNELS = _without_bf16_kernels()
needs_bf16_kernels = pytest.mark.skipif(WITHOUT_BF16_KERNELS is not None, reason=WITHOUT_BF16_KERNELS or "")


def run_without_amx(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RICLLM_NO_AMX": "1", "RICLLM_LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
                          check=False)


@needs_bf16_kernels
def test_the_family_follows_the_cpu_and_amx_can_be_turned_off():
    assert kernel_family().startswith("amx (int4: " if cpu_family() == "amx" else "avx512-bf16 (int4: ")
    done = run_without_amx("-m", "ricllm.cli", "info")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPU kernels" in done.stdout
    assert "avx512-bf16 (int4: int8 activations on VNNI, every row count), AMX disabled by RICLLM_NO_AMX" in done.stdout


@needs_bf16_kernels
def test_without_amx_the_runtimes_still_compute_the_same_bits():
    """The bit-identity test of the two runtimes, run again on the family every CPU without AMX takes."""
    done = run_without_amx("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_native_runtime.py",
                           "-k", "bit_identical or unchunked")
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
