"""The CUDA C++ kernel compiles with plain nvcc (no torch headers), and its loader fails clearly."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ricllm.kernels import cuda_ext
from tests.helpers import require

CSRC = cuda_ext.CSRC
NVCC = shutil.which("nvcc")


def nvcc(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    require(NVCC is not None, "nvcc is not on PATH")
    return subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=timeout)


def test_paged_decode_compiles_for_hopper_with_nvcc_without_spills(tmp_path: Path) -> None:
    """sm_90, the H100 and H200 the GPU checks run on: torch's extension build compiles for the device it
    finds, and a kernel that spills there is slow where it matters."""
    obj = tmp_path / "paged_decode.o"
    proc = nvcc("-c", "-std=c++17", "-O3", "-arch=sm_90", "-Xptxas", "-v",
                str(CSRC / "paged_decode.cu"), "-o", str(obj))
    assert proc.returncode == 0, proc.stderr
    assert obj.stat().st_size > 0
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    assert spills and max(spills) == 0, "a kernel spills registers to local memory:\n" + proc.stderr


def test_header_is_plain_c(tmp_path: Path) -> None:
    """paged_decode.h is the C ABI the binding links against: it must compile as C."""
    source = tmp_path / "use_header.c"
    source.write_text('#include "paged_decode.h"\n'
                      "int call(const RicllmDecodeParams* p) { return ricllm_paged_decode(p, 0, 0); }\n")
    proc = nvcc("-c", "-x", "c", f"-I{CSRC}", str(source), "-o", str(tmp_path / "use_header.o"))
    assert proc.returncode == 0, proc.stderr


def test_build_without_cuda_raises_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the extension can build here")
    cuda_ext.load_extension.cache_clear()
    with pytest.raises(cuda_ext.CudaExtensionUnavailable, match="cannot build the CUDA decode kernel: "):
        cuda_ext.load_extension()
    query = torch.zeros(1, 2, 64)
    cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(cuda_ext.CudaExtensionUnavailable):
        cuda_ext.paged_decode_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                        torch.ones(1, dtype=torch.int32), 0.125)


def _pretend_cuda_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_build_problem_names_missing_nvcc(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    _pretend_cuda_machine(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nvcc was not found" in cuda_ext.cuda_build_problem()


def test_build_problem_names_missing_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    _pretend_cuda_machine(monkeypatch)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert "ninja is not installed" in cuda_ext.cuda_build_problem()


def test_build_problem_on_cpu_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only" in cuda_ext.cuda_build_problem()
