"""The native runtime: no torch in the serving process, the torch runtime's tokens and logits,
and a clear fallback (or error) where it cannot serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.engine.runtime import numpy_sampler, sampler
from ricllm.engine.runtime import native_convert
from ricllm.errors import ConfigError
from tests.helpers import cache_with_kernels, write_tiny_llama_gguf
from tests.recorder import LogitsRecorder
from tests.test_oracle_parity import random_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_native(tiny_native_gguf) -> Path:
    return tiny_native_gguf


def tiny(path: Path, runtime: str, **kwargs) -> LLM:
    kwargs.setdefault("weight_cache", False)
    kwargs.setdefault("kv_cache_budget", "4MiB")
    return LLM(str(path), weights="int4", runtime=runtime, **kwargs)


# what a start and its requests must not import: torch (the native runtime's point), and what only
# some features need: structlog and rich (an event at the level), jinja2 (a chat template),
# llguidance (a structured request), the servers' stacks
LAZY = ("torch", "structlog", "rich", "jinja2", "llguidance", "prometheus_client", "starlette", "zmq")
SERVE_WITHOUT_TORCH = """
import json, sys
from ricllm import LLM, SamplingParams
llm = LLM(sys.argv[1], weights="int4", kv_cache_budget="4MiB")
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=12, ignore_eos=True))
print(json.dumps({"runtime": llm.engine.runtime.name, "source": llm.engine.runtime.weights_source.split()[0],
                  "torch": "torch" in sys.modules, "tokens": [o.token_ids for o in outs],
                  "imported": sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[3].split(",")))}))
"""


def test_a_process_serves_the_model_without_importing_torch(tiny_native, tmp_path):
    """First start: converted in a child process (the only one that imports torch); second start:
    mapped from the cache. Both give the torch runtime's greedy tokens."""
    prompts = random_prompts(300, (5, 30, 100), seed=1)  # 100 rows: SDPA in the torch runtime, C here
    env = {**os.environ, "RICLLM_CACHE_DIR": str(cache_with_kernels(tmp_path)), "RICLLM_LOG_LEVEL": "warning"}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TORCH, str(tiny_native), json.dumps(prompts),
                               ",".join(LAZY)], check=False, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [r["source"] for r in runs] == ["file", "cache"]
    assert all(r["runtime"] == "native" and not r["torch"] for r in runs), runs
    assert [r["imported"] for r in runs] == [[], []]  # each costs a start time (structlog with rich: ~0.1 s)
    expected = [o.token_ids for o in tiny(tiny_native, "torch").generate(prompts, GREEDY)]
    assert runs[0]["tokens"] == runs[1]["tokens"] == expected


def test_decode_and_small_prefill_logits_are_bit_identical_to_the_torch_runtime(tiny_native):
    """Where the torch runtime also runs the C decoder stack (decodes, prefills up to 64 rows)
    the two runtimes compute the same bits: same kernels, same order, same roundings."""
    prompts = random_prompts(300, (3, 17, 40, 64), seed=2)
    recorded = []
    for runtime in ("native", "torch"):
        llm = tiny(tiny_native, runtime, max_num_batched_tokens=64)  # no step above the stack's 64 prefill rows
        assert llm.engine.runtime.name == runtime
        recorder = LogitsRecorder(llm.engine)
        outs = llm.generate(prompts, GREEDY)
        recorded.append([recorder.stacked(o.request_id)[1] for o in outs])
    for ours, theirs in zip(*recorded):
        assert torch.equal(ours, theirs)


def test_auto_falls_back_to_torch_and_says_why(tiny_gguf):
    llm = LLM(str(tiny_gguf), kv_cache_budget="4MiB", weight_cache=False)  # F32 weights: dense
    assert llm.engine.runtime.name == "torch"
    assert "dense" in llm.engine.runtime.why


def test_runtime_native_refuses_what_it_cannot_serve_naming_the_reason(tiny_gguf):
    with pytest.raises(ConfigError, match=r"runtime 'native' cannot serve this configuration: dtype 'float32'"):
        LLM(str(tiny_gguf), dtype="float32", runtime="native", kv_cache_budget="4MiB", weight_cache=False)
    with pytest.raises(ConfigError, match=r"runtime 'native' cannot serve this configuration: weights 'auto' "
                                          r"leave the layers dense"):
        LLM(str(tiny_gguf), runtime="native", kv_cache_budget="4MiB", weight_cache=False)


def test_a_model_whose_head_does_not_tile_is_remembered_as_unsupported(tmp_path, monkeypatch):
    """Vocabulary 303: the head cannot be packed in whole tiles. The conversion says so once; the
    next start reads the refusal from the cache instead of converting again."""
    model = write_tiny_llama_gguf(tmp_path / "odd.gguf", seed=5, quant="Q4_1")
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
    first = LLM(str(model), weights="int4", kv_cache_budget="4MiB")
    assert first.engine.runtime.name == "torch" and "LM head" in first.engine.runtime.why
    monkeypatch.setattr(native_convert, "_convert", lambda *a: pytest.fail("converted again"))
    with pytest.raises(ConfigError, match="runtime 'native' cannot serve this model: the LM head is not packed"):
        LLM(str(model), weights="int4", kv_cache_budget="4MiB", runtime="native")


def test_a_torn_native_weights_file_is_converted_again(tiny_native, tmp_path, monkeypatch):
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    entry = native_convert.entry_path(tiny_native, "int4")
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"RICLLMNW" + b"\xff" * 40)
    llm = tiny(tiny_native, "native", weight_cache=True)
    assert llm.engine.runtime.weights_source.startswith("file") and entry.stat().st_size > 10_000
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == tiny(tiny_native, "torch").generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_a_native_weights_file_of_an_older_format_is_converted_again(tiny_native, tmp_path, monkeypatch):
    from ricllm.model import native_weights

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    tiny(tiny_native, "native", weight_cache=True)
    entry = native_convert.entry_path(tiny_native, "int4")
    current = f'"version": {native_weights.FORMAT_VERSION}'.encode()
    data = entry.read_bytes()
    assert current in data[:200]
    entry.write_bytes(data.replace(current, b'"version": 1', 1))  # as a file an older ricllm wrote there
    again = tiny(tiny_native, "native", weight_cache=True)
    assert again.engine.runtime.weights_source.startswith("file")  # refused, converted, written anew
    assert current in entry.read_bytes()[:200]
    assert tiny(tiny_native, "native", weight_cache=True).engine.runtime.weights_source.startswith("cache")


def test_the_tokenizer_is_the_same_read_from_a_native_weights_file(tiny_native, tmp_path, monkeypatch):
    """The file keeps a BPE vocabulary and its merges outside the tokenizer's JSON (format 2)."""
    from ricllm.model import native_weights
    from ricllm.model.loader import open_checkpoint

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    tiny(tiny_native, "native", weight_cache=True)
    entry = native_convert.entry_path(tiny_native, "int4")
    assert native_weights.TOKENIZER_MERGES in native_weights._map(entry)[0]
    original = open_checkpoint(tiny_native).tokenizer
    assert native_weights.read(entry).tokenizer.to_state() == original.to_state()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (20, 0.5)])
def test_the_numpy_sampler_keeps_the_torch_samplers_candidates(top_k, top_p):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(top_k))
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    kept_torch = torch.isfinite(sampler.filter_logits(logits, params)).numpy()
    kept_numpy = np.isfinite(numpy_sampler.filter_logits(logits.numpy(), params))
    assert (kept_torch == kept_numpy).all()


def test_the_numpy_sampler_draws_only_candidates_in_proportion_and_reproducibly():
    logits = np.log(np.array([[0.1, 0.6, 0.3, 1e-9]], dtype=np.float32))
    params = SamplingParams(temperature=1.0, top_k=2)
    rng = numpy_sampler.new_generator(7)
    draws = [numpy_sampler.sample(logits, [params], [rng])[0] for _ in range(4000)]
    assert set(draws) == {1, 2}  # top-2: tokens 0 and 3 never
    assert abs(draws.count(1) / len(draws) - 0.6 / 0.9) < 0.03
    again = numpy_sampler.new_generator(7)
    assert draws[:50] == [numpy_sampler.sample(logits, [params], [again])[0] for _ in range(50)]
    assert numpy_sampler.sample(logits, [SamplingParams(temperature=0)], [None]) == [1]


def test_an_unknown_runtime_is_refused_naming_the_choices():
    from ricllm.config import EngineConfig

    with pytest.raises(ConfigError, match=r"unknown runtime 'numpy'; choose one of auto, native, torch"):
        EngineConfig(runtime="numpy")


def test_the_native_kv_pool_is_the_budget_and_resident_from_the_start(tiny_native):
    llm = tiny(tiny_native, "native", kv_cache_budget="2MiB")
    cache = llm.engine.kv_cache
    assert cache.total_bytes() == cache.geometry.allocated_bytes <= 2 * 1024 * 1024
    assert all(k.base is cache.pool or k.base is cache.pool.base for k, _ in cache.layers)  # views, no copies


def test_what_the_native_runtime_hands_to_c_starts_on_a_cache_line(tiny_native, monkeypatch):
    """numpy's allocator starts arrays 16 bytes past a line: a pool like that made every 128-byte
    K/V row touch three lines and cost the 32-stream decode step ~15% against torch's tensors."""
    from ricllm.kernels.decoder_stack_call import DecoderStackCall

    llm = tiny(tiny_native, "native", kv_cache_budget="2MiB")
    cache = llm.engine.kv_cache
    assert [a.ctypes.data % 64 for k, v in cache.layers for a in (k, v)] == [0] * 2 * len(cache.layers)
    seen, call = [], DecoderStackCall.__call__
    monkeypatch.setattr(DecoderStackCall, "__call__",
                        lambda self, x, out, *a, **k: seen.append((x % 64, out % 64)) or call(self, x, out, *a, **k))
    llm.generate(random_prompts(300, (3, 20), seed=5), SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen and set(seen) == {(0, 0)}


def test_the_cli_refuses_native_for_a_dense_model_with_the_reason_and_no_traceback(tiny_gguf):
    done = subprocess.run([sys.executable, "-m", "ricllm.cli", "generate", "hi", "--model", str(tiny_gguf),
                           "--runtime", "native", "--no-weight-cache"], check=False, capture_output=True,
                           text=True, timeout=120)
    assert done.returncode != 0
    assert "runtime 'native' cannot serve this configuration: weights 'auto' leave the layers dense" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_read_only_weight_cache_costs_time_not_the_start(tiny_native, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "weights").mkdir(parents=True)
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(cache))
    monkeypatch.setattr(native_convert, "_writable", lambda folder: False)
    llm = tiny(tiny_native, "native", weight_cache=True)
    assert llm.engine.runtime.name == "native" and llm.engine.runtime.weight_cache_entry is None
    assert not list((cache / "weights").glob("*.native"))
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_only_the_most_recently_used_native_weights_files_are_kept(tiny_native, tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_convert, "MAX_ENTRIES", 2)
    folder = tmp_path / "weights"
    folder.mkdir()
    for age, name in enumerate(("old", "older")):
        (folder / f"{name}.native").write_bytes(b"x")
        os.utime(folder / f"{name}.native", (time.time() - 100 * (age + 1),) * 2)
    tiny(tiny_native, "native", weight_cache=True)
    assert sorted(p.stem for p in folder.glob("*.native")) == sorted(
        ["old", native_convert.entry_path(tiny_native, "int4").stem])


def test_a_prompt_read_in_chunks_gives_the_unchunked_tokens(tiny_native):
    """Steps whose only rows are an unfinished prompt chunk sample nothing (an empty logits batch)."""
    prompt = random_prompts(300, (100,), seed=4)
    chunked = tiny(tiny_native, "native", max_num_batched_tokens=32).generate(prompt, GREEDY)[0]
    whole = tiny(tiny_native, "native").generate(prompt, GREEDY)[0]
    assert chunked.token_ids == whole.token_ids and len(chunked.token_ids) == GREEDY.max_tokens
