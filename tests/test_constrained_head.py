"""The LM head where the grammar allows: a constrained row's logits are computed on the head's tiles
that hold its allowed tokens, and the engine chooses exactly what the whole head makes it choose,
greedy and seeded, in both runtimes, with constrained and unconstrained rows in one batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.engine.runtime import narrow_head, numpy_sampler, sampler
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.sequence import Sequence
from tests.helpers import write_tiny_gemma3_gguf

PROMPTS = ["the cell is congested", "hello world", "RLC delay 123", "The answer is"]
CHOICE = {"choice": ["offload", "hold", "escalate", "rebalance"]}
DECISION = {"json": {"type": "object", "properties": {
    "action": {"enum": ["offload", "hold", "escalate"]},
    "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
    "required": ["action", "cio_delta_db"], "additionalProperties": False}}


def mixed_batch() -> list[SamplingParams]:
    """Per prompt: greedy and seeded choices, a seeded JSON decision, greedy and seeded free text."""
    params = []
    for seed in range(len(PROMPTS)):
        params += [SamplingParams(max_tokens=16, structured=CHOICE),
                   SamplingParams(max_tokens=16, structured=CHOICE, temperature=1.0, seed=seed),
                   SamplingParams(max_tokens=40, structured=DECISION, temperature=0.9, top_p=0.95, seed=seed),
                   SamplingParams(max_tokens=8, ignore_eos=True),
                   SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=seed)]
    return params


def count_narrow_steps(llm: LLM) -> list[int]:
    """A counter of the steps that compute some rows on the allowed tiles only."""
    model, calls = llm.engine.runtime.model, [0]
    on_tiles = model.compute_logits_on_tiles

    def counted(hidden, tiles):
        calls[0] += 1
        return on_tiles(hidden, tiles)

    object.__setattr__(model, "compute_logits_on_tiles", counted)
    return calls


@pytest.mark.parametrize("runtime", ["native", "torch"])
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_the_k_wide_head_chooses_what_the_whole_head_chooses(tiny_native_gguf: Path, runtime, weights):
    prompts = [p for p in PROMPTS for _ in range(5)]
    tokens = {}
    for narrow in (True, False):
        llm = LLM(str(tiny_native_gguf), weights=weights, runtime=runtime, weight_cache=False, kv_cache_budget="4MiB")
        assert llm.engine.runtime.name == runtime
        llm.engine.runtime.runner.narrow_head = narrow
        narrow_steps = count_narrow_steps(llm)
        outs = llm.generate(prompts, mixed_batch())
        tokens[narrow] = [o.token_ids for o in outs]
        assert (narrow_steps[0] > 0) == narrow  # the k-wide head did run, and only when on
        assert all(o.text in CHOICE["choice"] for o in outs[0::5] + outs[1::5])
    assert tokens[True] == tokens[False]


def test_gemma3s_k_wide_head_chooses_what_its_whole_head_chooses(tmp_path: Path):
    """Gemma 3 in the torch runtime, its head packed at 8 bits in ricllm's layout."""
    gguf = write_tiny_gemma3_gguf(tmp_path / "tiny_gemma3.gguf", seed=3, pad_vocab_to=16)
    tokens = {}
    for narrow in (True, False):
        llm = LLM(str(gguf), weights="int8", weight_cache=False, kv_cache_budget="8MiB", runtime="torch")
        assert llm.engine.spec.architecture == "gemma3" and llm.engine.runtime.model.head_narrows(20)
        llm.engine.runtime.runner.narrow_head = narrow
        narrow_steps = count_narrow_steps(llm)
        tokens[narrow] = [o.token_ids for o in llm.generate([p for p in PROMPTS for _ in range(5)], mixed_batch())]
        assert (narrow_steps[0] > 0) == narrow
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_the_narrow_logits_are_the_whole_heads_bit_for_bit(tiny_native_gguf: Path, runtime):
    """The runner's allowed logits for a narrowed row are the whole head's at the same ids, and the
    unconstrained rows beside it keep the whole head's logits."""
    llm = LLM(str(tiny_native_gguf), weights="int8", runtime=runtime, weight_cache=False, kv_cache_budget="4MiB")
    cache, runner, vocab = llm.engine.cache, llm.engine.runtime.runner, llm.engine.spec.vocab_size
    prompts = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    seqs = [Sequence(request_id=str(i), token_ids=list(prompt), num_prompt_tokens=len(prompt),
                     params=SamplingParams(max_tokens=1), arrival_time=0.0) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        seq.take_blocks(cache.allocate(seq, seq.num_tokens))
    batch = ScheduledBatch([(seq, seq.num_tokens) for seq in seqs])
    allowed = [np.array([17, 20, 33, vocab - 1]), None, np.arange(3), None]  # 4 tiles of the head's 19
    whole = torch.as_tensor(np.asarray(runner.run(batch)[0]))
    narrowed = runner.run(batch, allowed)[0]  # the same prompts again: the same K/V, the same hidden states
    assert narrowed.full_rows == [1, 3] and set(narrowed.allowed) == {0, 2}
    assert torch.equal(torch.as_tensor(narrowed.full), whole[[1, 3]])
    for row in (0, 2):
        assert torch.equal(torch.as_tensor(narrowed.allowed[row].logits), whole[row, allowed[row]])
        assert np.array_equal(narrowed.allowed[row].ids, allowed[row])


def test_a_constraint_allowing_most_of_the_vocabulary_gets_the_whole_head():
    """Past ``MAX_TILE_SHARE`` of the head's tiles (scaled by the constrained rows' part of the step)
    the plan computes every row whole."""
    few, most, half = np.array([3, 40, 41]), np.arange(0, 16 * 60, 2), np.arange(0, 16 * 50, 16)
    assert narrow_head.plan_head([few, None], 100, narrows=True).narrow_rows == [0]
    assert narrow_head.plan_head([most, most], 100, narrows=True).narrow_rows == []
    assert narrow_head.plan_head([few, None], 100, narrows=False).narrow_rows == []
    assert narrow_head.plan_head([half, half], 100, narrows=True).narrow_rows == [0, 1]
    assert narrow_head.plan_head([half, None], 100, narrows=True).narrow_rows == []  # the whole head is read anyway
    plan = narrow_head.plan_head([few, None, np.array([41, 900])], 100, narrows=True)
    assert plan.full_rows == [1] and plan.narrow_rows == [0, 2] and plan.tiles.tolist() == [0, 2, 56]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_a_constrained_draw_is_one_uniform_draw_over_the_allowed_ids_in_vocabulary_order(top_k, top_p):
    """``sample_allowed`` picks what ``numpy_sampler.sample`` picks from a row whose other tokens
    are forbidden (-inf), seed for seed; the torch sampler follows the same definition on its
    generator: one uniform draw on the allowed tokens' cumulative distribution."""
    vocab, rng = 500, np.random.default_rng(7)
    for seed in range(60):
        logits = rng.normal(size=vocab).astype(np.float32) * 3
        ids = np.sort(rng.choice(vocab, 1 + seed % 9, replace=False))
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, seed=seed)
        masked = np.full(vocab, -np.inf, dtype=np.float32)
        masked[ids] = logits[ids]
        picked = numpy_sampler.sample_allowed(ids, logits[ids], params, numpy_sampler.new_generator(seed))
        assert picked == numpy_sampler.sample(masked[None], [params], [numpy_sampler.new_generator(seed)])[0]
        generator = torch.Generator().manual_seed(seed)
        draw = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).item()
        cumulative = np.cumsum(torch.softmax(sampler.filter_logits(torch.from_numpy(logits[ids]), params), -1)
                               .double().numpy())
        expected = ids[min(int(np.searchsorted(cumulative, draw * cumulative[-1], side="right")), len(ids) - 1)]
        assert sampler.sample_allowed(ids, torch.from_numpy(logits[ids]), params, generator) == expected
    greedy = SamplingParams()
    tie = np.array([1.0, 2.0, 2.0], dtype=np.float32)
    assert numpy_sampler.sample_allowed(np.array([4, 9, 12]), tie, greedy, None) == 9  # the first maximum
    assert sampler.sample_allowed(np.array([4, 9, 12]), torch.from_numpy(tie), greedy, None) == 9


def test_the_steps_the_k_wide_head_narrows_record_its_share_of_the_head(tiny_native_gguf: Path):
    """The latency model's head term (``StepFeatures.head_rows``): a step whose constrained rows
    ran on their allowed tiles records each as its tiles' share of the head; with the whole head,
    each sampled row is one."""
    head_rows = {}
    for narrow in (True, False):
        llm = LLM(str(tiny_native_gguf), weights="int4", runtime="native", weight_cache=False, kv_cache_budget="4MiB")
        llm.engine.runtime.runner.narrow_head = narrow
        llm.generate(PROMPTS, [SamplingParams(max_tokens=16, structured=CHOICE)] * len(PROMPTS))
        head_rows[narrow] = [record.features.head_rows for record in llm.engine.step_history]
    assert all(float(rows).is_integer() for rows in head_rows[False])
    assert sum(head_rows[True]) < sum(head_rows[False])
    assert any(not float(rows).is_integer() for rows in head_rows[True])
