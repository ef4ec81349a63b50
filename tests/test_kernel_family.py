"""Kernel families: what runs is chosen from the CPU, said in `ricllm info` and the ready log, and
the AMX family can be turned off (RICLLM_NO_AMX=1) so an AMX machine measures the path other CPUs take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ricllm.kernels.cpu_library import kernel_family, quant_gemm_available

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), []))
needs_bf16_kernels = pytest.mark.skipif(not (quant_gemm_available(4) and {"avx512_bf16", "avx512_vnni"} <= CPU_FLAGS),
                                        reason="needs AVX-512 BF16 and VNNI")


def run_without_amx(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RICLLM_NO_AMX": "1", "RICLLM_LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
                          check=False)


@needs_bf16_kernels
def test_the_family_follows_the_cpu_and_amx_can_be_turned_off():
    assert kernel_family().startswith("amx (int4: " if "amx_tile" in CPU_FLAGS else "avx512-bf16 (int4: ")
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
