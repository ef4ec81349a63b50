"""benchmarks/bench_lora.py: its interleaving and its summary on made-up numbers, its adapters read
as PEFT adapters, and a --quick run on the tiny model that prints a table for every configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

import benchmarks.bench_lora as bench
from ricllm.model.loader import open_checkpoint
from ricllm.model.lora import PROJECTIONS, load_lora_adapter
from tests.helpers import cache_with_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_every_configuration_runs_once_a_round_in_a_rotated_order():
    order = bench.interleaved_order(configs=3, rounds=3)
    assert [sorted(c for r, c in order if r == round_index) for round_index in range(3)] == [[0, 1, 2]] * 3
    assert [order[3 * round_index][1] for round_index in range(3)] == [0, 1, 2]


def test_the_table_gives_medians_ranges_and_per_round_ratios_against_no_adapter():
    times = {(1, "none"): [10.0, 20.0, 12.0], (1, "one"): [11.0, 21.0, 15.0],
             (8, "none"): [20.0, 20.0, 20.0], (8, "one"): [22.0, 20.0, 24.0], (8, "four mixed"): [30.0, 30.0, 30.0]}
    lines = bench.table(times, [1, 8]).splitlines()
    assert lines[2] == "| 1 | 12 [10–20] | 15 [11–21] | 1.1 [1.05–1.25] | — | — |"
    assert lines[3] == "| 8 | 20 [20–20] | 22 [20–24] | 1.1 [1–1.2] | 30 [30–30] | 1.5 [1.5–1.5] |"


def test_the_benchmarks_adapters_are_rank_r_on_every_projection(tiny_native_gguf, tmp_path):
    spec = open_checkpoint(tiny_native_gguf).spec
    adapter = load_lora_adapter(bench.write_random_adapter(tmp_path / "a", spec, rank=8, seed=0), spec)
    assert [(layer, name) for layer, name, _ in adapter.projections()] == [
        (layer, name) for layer in range(spec.num_layers) for name in PROJECTIONS]
    assert {update.rank for _, _, update in adapter.projections()} == {8}


def test_quick_runs_on_the_tiny_model_and_prints_every_configuration(tiny_native_gguf, tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/bench_lora.py", "--quick", "--model", str(tiny_native_gguf)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "RICLLM_CACHE_DIR": str(cache_with_kernels(tmp_path))})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Kernel family" in done.stdout and "native runtime:" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 and rows[0].endswith("| — | — |") and "—" not in rows[1]
