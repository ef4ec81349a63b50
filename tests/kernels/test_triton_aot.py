"""The Triton kernels compile for Hopper (sm_90) on this CPU machine, with the intended code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ricllm.kernels import triton_available
from tests.helpers import require

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def variants() -> list[dict]:
    require(*triton_available())
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90_without_spills(variants: list[dict]) -> None:
    assert {v["kernel"] for v in variants} == {"decode", "merge", "store_kv"}
    for variant in variants:
        assert variant["local"] == 0 and variant["stack"] == 0, variant


def test_decode_pipelines_16_byte_loads(variants: list[dict]) -> None:
    """Exact caches only: an int8 row of ``head_dim + 4`` bytes is 4-byte aligned, not 16."""
    exact = [v for v in variants if v["kernel"] == "decode" and v["cache"] != "int8"]
    assert any(v["windowed"] for v in exact)
    for variant in exact:
        assert variant["cp_async_16"] > 0, variant


def test_half_precision_decode_uses_tensor_cores(variants: list[dict]) -> None:
    """fp16/bf16 queries, on exact caches and on int8 rows dequantized to the query's type."""
    half = [v for v in variants if v["kernel"] == "decode" and v["dtype"] != "fp32"]
    assert any(v["cache"] == "int8" for v in half)
    for variant in half:
        assert variant["mma"] > 0, variant
