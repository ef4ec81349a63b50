"""The latency model's context per KV cache group, and the LM head as a term of its own.

Gemma 3's sliding-window layers (five groups of three, window 512) read at most their window; its
global group reads the whole context. The step features, both admission bounds and the roofline
count that, so a long Gemma request is charged what its layers read, not every layer's whole
context; a Llama model (one group) keeps the whole context. Pure arithmetic on spec objects: no
model is loaded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ricllm import SamplingParams
from ricllm.cache.kv_groups import kv_cache_groups
from ricllm.config import AdmissionSettings
from ricllm.engine.admission import NO_BEST_EFFORT, AdmissionController, finish_bounds, work_of
from ricllm.engine.latency_model import LatencyModel, Roofline, feature_vector, runs_op_by_op
from ricllm.engine.runtime.capabilities import C_KERNEL_LIMITS
from ricllm.engine.runtime.narrow_head import TILE, plan_head
from ricllm.engine.schedule_bound import schedule_bounds
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.kv_window import group_window
from ricllm.model.spec import ModelSpec
from ricllm.plan import NAMED_SHAPES, constrained_step_bytes, plan
from ricllm.sequence import Sequence

GEMMA = ModelSpec("gemma3", 262144, 640, 2048, 18, 4, 1, 256, 32768, 1e-6, 1e6, True,
                  layer_windows=((512,) * 5 + (0,)) * 3)
LLAMA = ModelSpec("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e-5, 1e5, True)
WINDOW = 512
# a, b·P, c·D, d·C, e·Q, op-by-op f, g·P, h·Q, k·H: the context term large enough to matter
COEFFICIENTS = [2e-3, 2e-5, 3e-4, 2e-6, 1e-9, 0.0, 0.0, 0.0, 5e-4]


def sequence(spec: ModelSpec, prompt: int, computed: int, max_tokens: int = 16) -> Sequence:
    """A sequence of ``spec``'s cache groups with ``prompt`` tokens, ``computed`` of them computed."""
    windows = tuple(group_window(group.window, None) for group in kv_cache_groups(spec)[1:])
    seq = Sequence("r", list(range(prompt)), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0,
                   group_windows=windows)
    seq.num_computed_tokens = computed
    return seq


def decoding(spec: ModelSpec, context: int) -> Sequence:
    """A sequence whose next step decodes its token at position ``context - 1``."""
    seq = sequence(spec, context - 1, context - 1)
    seq.token_ids.append(7)
    return seq


def test_a_gemma_decode_at_4096_tokens_reads_the_window_in_its_sliding_groups():
    features = ScheduledBatch([(decoding(GEMMA, 4096), 1)]).features()
    # one global group reads 4,096 positions, five sliding groups 512 each: averaged over the six
    assert features.num_context_tokens == pytest.approx((4096 + 5 * WINDOW) / 6)
    assert features.num_context_tokens < 4096 / 3
    assert features.num_decode_seqs == 1 and features.head_rows == 1


def test_a_gemma_prefill_chunk_reads_its_window_and_chunk_but_the_kernel_limits_see_every_position():
    """A 512-token chunk ending at 4,096: each sliding group reads its first query's window to its
    last query (512 + 511 positions), each query at most 512; the kernel limits are stated over the
    whole context, so they are given that."""
    features = ScheduledBatch([(sequence(GEMMA, 4096, 4096 - 512), 512)]).features()
    assert features.num_context_tokens == pytest.approx((4096 + 5 * (WINDOW + 511)) / 6)
    assert features.prefill_attention == pytest.approx(512 * (4096 + 5 * WINDOW) / 6)
    assert features.prefill_products == 512 * 4096
    assert features.head_rows == 1  # the chunk ends the prompt: its last row samples
    middle = ScheduledBatch([(sequence(GEMMA, 4096, 1024), 512)]).features()
    assert middle.head_rows == 0  # a chunk inside the prompt samples nothing


def test_a_llama_models_features_are_the_whole_context_as_one_group():
    decode, chunk, ending = decoding(LLAMA, 4096), sequence(LLAMA, 4096, 1024), sequence(LLAMA, 600, 100)
    features = ScheduledBatch([(decode, 1), (chunk, 256), (ending, 500)]).features()
    assert (features.num_prefill_tokens, features.num_decode_seqs) == (756, 1)
    assert features.num_context_tokens == 4096 + 1280 + 600
    assert features.prefill_attention == features.prefill_products == 256 * 1280 + 500 * 600
    assert features.head_rows == 2  # the decode and the prompt that ends
    vector = feature_vector(features, C_KERNEL_LIMITS)
    op = runs_op_by_op(features, C_KERNEL_LIMITS)
    assert op
    q = 256 * 1280 + 500 * 600
    assert vector.tolist() == [1.0, 756, 1, 5976, q, 1.0, 756, q, 2, 5976, 0]


def bounds(spec: ModelSpec, prompt: int, max_tokens: int, whole: bool = False,
           coefficients: list[float] = COEFFICIENTS) -> tuple[float, float]:
    """The closed-form and schedule bounds of one request alone; ``whole``: as if every layer read
    the whole context (the request's cache groups dropped)."""
    work = work_of(sequence(spec, prompt, 0, max_tokens))
    if whole:
        work.group_reaches = ()
    model = LatencyModel(list(coefficients))
    return (finish_bounds([work], model, 512, 0.0)[0],
            schedule_bounds([work], model, 512, 0.0, NO_BEST_EFFORT)[0])


def test_a_long_gemma_prompts_bounds_reflect_the_window():
    closed, planned = bounds(GEMMA, 4000, 96)
    closed_whole, planned_whole = bounds(GEMMA, 4000, 96, whole=True)
    assert closed < closed_whole and planned < planned_whole
    # the closed form: 8 prefill steps, the last samples the first token, then 95 decode steps,
    # each at the final context's reads; the prefill's attention and its chunks' reach past the window
    final, steps = 4096, 8 + 95
    a, b, c, d, e, _, _, _, k = COEFFICIENTS
    reads = (final + 5 * WINDOW) / 6
    expected = (steps * (a + (c + k) + d * reads) + b * 4000 + e * 4000 * reads + d * 4000 * 5 / 6)
    assert closed == pytest.approx(expected)
    assert closed_whole == pytest.approx(steps * (a + (c + k) + d * final) + b * 4000 + e * 4000 * final)


def test_a_llama_requests_bounds_are_those_of_the_whole_context():
    assert bounds(LLAMA, 4000, 96) == bounds(LLAMA, 4000, 96, whole=True)


CONTEXT_ONLY = [0.0, 0.0, 0.0, 2e-6]  # what a sliding group's chunks read past the window is all there is


@pytest.mark.parametrize("coefficients, max_tokens", [(COEFFICIENTS, 96), (CONTEXT_ONLY, 2)])
def test_the_gemma_bounds_stay_above_the_fitted_steps_the_request_runs(coefficients, max_tokens):
    """The request run alone, step by step as the scheduler would (chunks of 512, then decodes):
    the fitted time of its real features never exceeds either bound. A chunk's first query reads
    its own window, so a chunk reads up to 511 positions past the window in each sliding group."""
    model = LatencyModel(list(coefficients))
    seq = sequence(GEMMA, 4000, 0, max_tokens)
    closed, planned = bounds(GEMMA, 4000, max_tokens, coefficients=coefficients)
    elapsed = 0.0
    while seq.num_output_tokens < max_tokens:
        num_new = min(512, seq.num_tokens - seq.num_computed_tokens)
        elapsed += model.base(ScheduledBatch([(seq, num_new)]).features())
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    assert elapsed <= planned and elapsed <= closed
    if max_tokens == 96:
        assert planned < elapsed * 1.05  # and the schedule's is tight


def test_the_roofline_reads_each_groups_positions_and_the_head_its_rows_need():
    roofline = Roofline(weight_bytes=1000.0, kv_bytes_per_token=10.0, bandwidth_bytes_per_s=1.0, head_bytes=600.0)
    decode = ScheduledBatch([(decoding(GEMMA, 4096), 1)]).features()
    assert roofline.seconds(decode) == pytest.approx(1000 + 10 * (4096 + 5 * WINDOW) / 6)
    middle = ScheduledBatch([(sequence(GEMMA, 4096, 1024), 512)]).features()
    assert roofline.seconds(middle) == pytest.approx(400 + 10 * (1536 + 5 * (WINDOW + 511)) / 6)


def test_the_k_wide_heads_rows_count_their_tiles_share():
    num_tiles = 64
    allowed = [np.array([3, 5, 40]), None, np.array([33])]  # tiles 0 and 2; the second row unconstrained
    narrowed = plan_head(allowed, num_tiles, narrows=True)
    assert narrowed.narrow_rows == [0, 2] and narrowed.head_rows == pytest.approx(1 + 2 * 2 / num_tiles)
    assert plan_head(allowed, num_tiles, narrows=False).head_rows == 3
    assert TILE == 16


def test_a_fit_of_other_terms_is_refused_and_a_shorter_one_reads_its_terms(tmp_path):
    shorter = tmp_path / "shorter.json"
    shorter.write_text(json.dumps({"model": {"features": ["intercept", "prefill_tokens"], "coefficients": [1e-3, 1e-5]}}))
    assert LatencyModel.load(shorter).coefficients[:3] == [1e-3, 1e-5, 0.0]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": {"features": ["intercept", "context_tokens_whole"],
                                           "coefficients": [1e-3, 1e-6]}}))
    with pytest.raises(ValueError, match="calibrate afresh"):
        LatencyModel.load(other)


def test_plan_prices_the_head_apart_and_a_constrained_steps_weights():
    spec = NAMED_SHAPES["gemma-3-270m"]
    weights = spec.num_parameters() * 2.0
    result = plan(spec, 8e9, 0.0, 30e9, 0.1, 8, 2.0, weights)
    head = spec.vocab_size * spec.hidden_size * 2.0
    assert result.head_bytes == pytest.approx(head)
    assert constrained_step_bytes(weights, head, spec) == pytest.approx(weights - head + head * 16 / (262144 // 16))


def test_the_caps_table_charges_a_gemma_request_what_its_groups_read():
    """The largest batch of 4,096-token requests that meets a deadline: larger when the five
    sliding groups are charged their window than when every layer reads the whole context."""
    def largest_batch(group_windows: tuple[int, ...]) -> int:
        controller = AdmissionController(AdmissionSettings(policy="deadline", safety_margin=0.0),
                                         LatencyModel(list(COEFFICIENTS)), 100_000, 16, 512, 8192, group_windows)
        return controller.caps(10_000, 16, contexts=(4096,))[0]["max_batch"]

    assert largest_batch((512,) * 5) > largest_batch((0,) * 5) >= 1
