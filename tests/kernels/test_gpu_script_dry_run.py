"""The GPU check (`benchmarks/gpu_kernels.py`) is run rarely, on a borrowed GPU with minutes to
spare and only torch and Triton installed: its dry run (every step at tiny sizes on the CPU,
Triton interpreted), with ricllm's other dependencies made absent, keeps it working there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import require_module

ROOT = Path(__file__).parents[2]


def test_the_gpu_benchmark_runs_every_section_in_its_dry_run(tmp_path):
    require_module("triton")
    report = tmp_path / "gpu_results.md"
    runner = Path(__file__).with_name("gpu_machine_run.py")
    result = subprocess.run([sys.executable, str(runner), "benchmarks/gpu_kernels.py", "--dry-run", "--tune",
                             "--out", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    for section in ("## Correctness", "## Triton tuning sweep", "## Decode speed", "## End to end"):
        assert section in text, section
    assert "FAILED" not in text, text
    assert "dry run: torch backend on the CPU" in text
