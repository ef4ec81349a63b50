"""Converted weights are cached on disk: the second start reads them and gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from tests.helpers import write_tiny_llama_gguf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("wc") / "tiny_q4.gguf", seed=3, quant="Q4_1")


def entries(cache_dir):
    return sorted((cache_dir / "weights").glob("*.pt"))


def tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_second_start_reads_the_cache_and_generates_the_same_tokens(cache_dir, tiny_q4, weights):
    first = LLM(str(tiny_q4), dtype="bfloat16", weights=weights, kv_cache_budget="4MiB")
    assert first.engine.runtime.weights_source.startswith("file") and len(entries(cache_dir)) == 1
    second = LLM(str(tiny_q4), dtype="bfloat16", weights=weights, kv_cache_budget="4MiB")
    assert second.engine.runtime.weights_source == f"cache {entries(cache_dir)[0]}"
    assert second.engine.runtime.weight_formats == first.engine.runtime.weight_formats
    assert tokens(second) == tokens(first)
    assert second.engine.tokenizer.encode("hello world") == first.engine.tokenizer.encode("hello world")


def test_cached_model_has_the_same_weights_and_packed_layers(cache_dir, tiny_q4):
    first = LLM(str(tiny_q4), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB").engine.runtime.model
    second = LLM(str(tiny_q4), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB").engine.runtime.model
    assert type(second.layers[0].mlp.down_proj).__name__ == "PackedLinear"
    assert second.layers[0].mlp.down_proj.fmt == "int4"
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(first.rope.cos, second.rope.cos)


def test_another_format_or_dtype_is_another_entry(cache_dir, tiny_q4):
    LLM(str(tiny_q4), dtype="bfloat16", weights="int8", kv_cache_budget="4MiB")
    LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB")
    LLM(str(tiny_q4), dtype="bfloat16", weights="int8", kv_cache_budget="4MiB")
    assert len(entries(cache_dir)) == 2


def test_a_damaged_entry_is_rebuilt_not_fatal(cache_dir, tiny_q4):
    expected = tokens(LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB"))
    (entry,) = entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:1000])
    again = LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB")
    assert again.engine.runtime.weights_source.startswith("file")
    assert tokens(again) == expected
    assert LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB").engine.runtime.weights_source.startswith("cache")


def test_a_changed_model_file_misses_the_cache(cache_dir, tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", seed=1)
    before = tokens(LLM(str(path), dtype="float32", kv_cache_budget="4MiB"))
    write_tiny_llama_gguf(path, seed=2)  # same name, other weights
    after = LLM(str(path), dtype="float32", kv_cache_budget="4MiB")
    assert after.engine.runtime.weights_source.startswith("file")
    assert tokens(after) != before


def test_cache_can_be_turned_off(cache_dir, tiny_q4):
    llm = LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB", weight_cache=False)
    assert llm.engine.runtime.weights_source.startswith("file") and entries(cache_dir) == []


def test_only_the_most_recently_used_entries_are_kept(cache_dir, tiny_q4, monkeypatch):
    from ricllm.engine.runtime import weight_cache

    monkeypatch.setattr(weight_cache, "MAX_ENTRIES", 2)
    LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB")
    LLM(str(tiny_q4), dtype="bfloat16", weights="int8", kv_cache_budget="4MiB")
    assert LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB").engine.runtime.weights_source.startswith("cache")
    LLM(str(tiny_q4), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB")  # evicts the int8 entry
    assert len(entries(cache_dir)) == 2
    assert LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB").engine.runtime.weights_source.startswith("cache")
    assert LLM(str(tiny_q4), dtype="bfloat16", weights="int8", kv_cache_budget="4MiB").engine.runtime.weights_source.startswith("file")


def test_tied_head_shares_the_embedding_and_lean_mode_keeps_no_bf16_copy(cache_dir, tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "tied.gguf", seed=4, tied=True, quant="Q4_1")
    for start in ("file", "cache"):  # with a bf16 copy for large steps, a tied head's copy is the embedding
        model = LLM(str(path), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB",
                    max_packed_rows=16).engine.runtime.model
        assert model.packed_head.weight.data_ptr() == model.embed.weight.data_ptr(), start
    lean = LLM(str(path), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB")  # the default: no copy
    layer = lean.engine.runtime.model.layers[0]
    assert layer.mlp.down_proj.weight is None and lean.engine.runtime.model.packed_head.weight is None
    with_copy = LLM(str(path), dtype="bfloat16", weights="int4", kv_cache_budget="4MiB", max_packed_rows=16)
    # packed at every batch size: same greedy tokens as with the copy within the packed range
    assert tokens(lean) == tokens(with_copy)


def test_an_edit_to_the_conversion_code_misses_the_cache(cache_dir, tiny_q4, monkeypatch):
    from ricllm.engine.runtime import weight_cache

    LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB")
    monkeypatch.setattr(weight_cache, "_conversion_code_digest", lambda: "edited")
    assert LLM(str(tiny_q4), dtype="float32", kv_cache_budget="4MiB").engine.runtime.weights_source.startswith("file")
