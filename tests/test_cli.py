"""The command line: --help explains, generate prints text and timings, info prints the shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import cache_with_kernels


def ricllm(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "ricllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_lists_commands():
    result = ricllm("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout and "info" in result.stdout
    assert "--kv-cache-budget" in ricllm("generate", "--help").stdout


def test_adapt_help_states_each_default_once_and_only_where_there_is_one():
    helped = ricllm("adapt", "--help").stdout
    options = " ".join(helped.split()).split(" --")[1:]
    assert "(default: None)" not in helped and "(default: [])" not in helped
    assert all(option.count("(default:") <= 1 for option in options), options
    assert "--steps STEPS optimizer steps (default: 100)" in " ".join(helped.split())


def test_generate_prints_text_and_timings(tiny_gguf):
    result = ricllm("generate", "hello world", "--model", str(tiny_gguf), "--max-tokens", "5", "--ignore-eos",
                    "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "5 generated, finish: length; TTFT" in result.stderr and " ms" in result.stderr


def test_generate_json(tiny_gguf):
    result = ricllm("generate", "hello", "--model", str(tiny_gguf), "--max-tokens", "3", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert len(payload["token_ids"]) == 3 and payload["finish_reason"] == "length"


def test_info_prints_dimensions_and_kv_bytes(smollm2):
    result = ricllm("info", str(smollm2))
    assert result.returncode == 0, result.stderr
    assert "KV heads (n_kv)" in result.stdout
    assert "23040 B  (2·30·3·64·2)" in result.stdout  # bf16 bytes per token of SmolLM2


@pytest.mark.parametrize("bf16,says", [("1", "bf16 products             yes (RICLLM_CPU_BF16=1)"),
                                       ("0", "bf16 products             no (RICLLM_CPU_BF16=0)")])
def test_info_says_what_auto_resolves_to_on_this_cpu(smollm2, bf16, says):
    from ricllm.kernels.cpu_library import quant_gemm_available

    result = ricllm("info", str(smollm2), env={**os.environ, "RICLLM_CPU_BF16": bf16})
    assert result.returncode == 0, result.stderr
    assert says in result.stdout
    if quant_gemm_available(4):  # bf16 either way: the packed kernels do the products where the CPU does not
        assert "dtype auto (CPU)          bfloat16" in result.stdout
        assert "weights auto (CPU)        layers int4, LM head int8" in result.stdout


def test_a_bad_bf16_answer_is_a_clear_error(smollm2):
    result = ricllm("info", str(smollm2), env={**os.environ, "RICLLM_CPU_BF16": "maybe"})
    assert result.returncode == 2 and "RICLLM_CPU_BF16='maybe': expected 0 or 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flag_value_is_a_clear_error(tiny_gguf):
    result = ricllm("generate", "x", "--model", str(tiny_gguf), "--kv-cache-budget", "lots")
    assert result.returncode == 2 and "cannot parse byte size 'lots'" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_fills_the_weight_cache_and_the_fit_that_the_next_start_uses(tiny_gguf, tmp_path, monkeypatch):
    env = {**os.environ, "RICLLM_CACHE_DIR": str(cache_with_kernels(tmp_path))}
    first = ricllm("prepare", "--model", str(tiny_gguf), "--dtype", "bfloat16", "--calibrate", env=env)
    assert first.returncode == 0, first.stderr
    assert f"converted from {tiny_gguf}" in first.stdout and str(tmp_path / "weights") in first.stdout
    fit = first.stdout.split("step-latency fit for this machine: ")[1].split()[0]
    assert fit.startswith(str(tmp_path / "latency")) and os.path.isfile(fit)
    again = ricllm("prepare", "--model", str(tiny_gguf), "--dtype", "bfloat16", env=env)
    assert again.returncode == 0 and "already in the weight cache" in again.stdout, again.stdout + again.stderr
    from ricllm import LLM
    from ricllm.engine import calibration

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate", lambda engine, **_: pytest.fail("calibrated again"))
    llm = LLM(str(tiny_gguf), dtype="bfloat16", admission="deadline")
    assert llm.engine.runtime.weights_source.startswith(f"cache {tmp_path / 'weights'}")


def test_prepare_refuses_to_skip_the_weight_cache(tiny_gguf):
    result = ricllm("prepare", "--model", str(tiny_gguf), "--no-weight-cache")
    assert result.returncode == 2 and "--no-weight-cache contradicts it" in result.stderr
    assert "Traceback" not in result.stderr
