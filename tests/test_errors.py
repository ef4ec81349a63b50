"""Bad input is refused with a message that names the problem, before anything is queued."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ricllm import LLM, SamplingParams
from ricllm.errors import CapacityError, ConfigError, InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(str(tiny_gguf), dtype="float32", kv_cache_budget=8 * 16 * 512)  # 8 blocks, 128 tokens


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]])


def test_token_id_outside_vocabulary(llm):
    vocab = llm.engine.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"token id {vocab} at position 1 is outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[5, vocab, 7]])
    with pytest.raises(InvalidRequestError, match="token id -1"):
        llm.generate([[-1]])


def test_max_tokens_below_one():
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_request_larger_than_budget(llm):
    with pytest.raises(CapacityError, match=r"needs 10 KV blocks \(150 tokens.*holds 8 blocks \(128 tokens\)"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))


def test_request_larger_than_context(tiny_gguf):
    llm = LLM(str(tiny_gguf), dtype="float32", max_model_len=64)
    with pytest.raises(CapacityError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 tokens exceeds the model's context of 64"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))


def test_a_bad_request_in_a_batch_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], []])
    assert not llm.engine.has_unfinished()


def test_budget_below_one_block(tiny_gguf):
    with pytest.raises(ConfigError, match=r"below one block: a block of 16 float32 tokens needs 8192 B"):
        LLM(str(tiny_gguf), dtype="float32", kv_cache_budget="4KiB")


def test_unparseable_budget(tiny_gguf):
    with pytest.raises(ConfigError, match="cannot parse byte size '12 parsecs'"):
        LLM(str(tiny_gguf), kv_cache_budget="12 parsecs")


def test_path_that_is_not_a_model(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="is not a model"):
        LLM(str(text))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="is not a model folder"):
        LLM(str(tmp_path))


def test_cli_reports_errors_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ricllm.cli", "generate", "hi", "--model", str(tmp_path / "none.gguf")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "ricllm: error: model path" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
