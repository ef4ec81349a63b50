"""``ricllm.kernels`` imports without triton or a GPU, and the split heuristic's arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ricllm.kernels as kernels
from ricllm.kernels import splits

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, from the repository root."""
    full_env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_triton_available_returns_a_reason() -> None:
    ok, reason = kernels.triton_available()
    assert isinstance(ok, bool)
    assert isinstance(reason, str) and reason


def test_import_does_not_import_triton() -> None:
    proc = run_python("import sys; import ricllm.kernels as kernels; assert 'triton' not in sys.modules, 'eager triton import'")
    assert proc.returncode == 0, proc.stderr


def test_without_triton_the_kernels_fail_with_the_reason() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch; import ricllm.kernels as kernels\n"
        "ok, why = kernels.triton_available()\n"
        "assert not ok and 'triton is not importable' in why, why\n"
        "try:\n"
        "    kernels.paged_decode_attention(torch.zeros(1, 1, 8), torch.zeros(1, 16, 1, 8),\n"
        "        torch.zeros(1, 16, 1, 8), torch.zeros(1, 1, dtype=torch.int32),\n"
        "        torch.ones(1, dtype=torch.int32), 1.0)\n"
        "except RuntimeError as exc:\n"
        "    assert 'Triton kernels unavailable' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_splits_off_cuda_is_one_pass() -> None:
    assert splits.choose_num_splits(1, 1, 100_000, torch.device("cpu")) == 1


@pytest.mark.parametrize(("batch", "n_kv", "ctx", "expected"), [
    (256, 8, 4096, 1),     # 2048 programs already fill 132 SMs x 4
    (64, 8, 4096, 1),      # 512 programs: at least half of 528, one pass
    (64, 3, 4096, 3),      # 192 programs: three splits reach 528
    (16, 8, 4096, 5),
    (1, 8, 32768, 64),     # capped at MAX_SPLITS
    (1, 8, 512, 2),        # no split shorter than 256 keys
    (16, 3, 100, 1),
])
def test_splits_heuristic_on_a_132_sm_gpu(monkeypatch: pytest.MonkeyPatch, batch: int, n_kv: int,
                                          ctx: int, expected: int) -> None:
    monkeypatch.setattr(splits, "sm_count", lambda index: 132)
    assert splits.choose_num_splits(batch, n_kv, ctx, torch.device("cuda", 0)) == expected
