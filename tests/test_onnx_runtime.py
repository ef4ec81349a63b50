"""The ONNX runtime: the GGUF exported as an ONNX graph that ONNX Runtime checks and runs, on the
engine's paged pool, with the torch runtime's tokens and logits (to a stated difference), and no
torch in the serving process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ricllm import LLM, SamplingParams
from ricllm.errors import ConfigError
from tests.recorder import LogitsRecorder
from tests.test_oracle_parity import random_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
# fp32 weights run as fp32 MatMul: ONNX Runtime's sums against torch's, nothing else differs
FP32_MAX_LOGIT_DIFFERENCE = 1e-4
# packed layers at accuracy_level 4 (activations quantized to int8 per block of 32, as the native
# runtime's kernels do) against the torch runtime's fp32 products of the same dequantized weights, on
# the tiny model's first sampled positions; measured 0.20 (1e-6 at accuracy_level 0, fp32 products)
PACKED_MAX_LOGIT_DIFFERENCE = 0.3


pytestmark = pytest.mark.usefixtures("onnx_modules")


def onnx_llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("weight_cache", False)
    kwargs.setdefault("kv_cache_budget", "4MiB")
    return LLM(str(path), runtime="onnx", **kwargs)


def recorded(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorder = LogitsRecorder(llm.engine)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [recorder.stacked(o.request_id)[1] for o in outs]


def test_the_graph_passes_the_onnx_checker_and_ort_symbolic_shape_inference(tiny_smollm_like):
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from ricllm.engine.runtime.onnx_export import export

    model, spec, _, formats = export(tiny_smollm_like)
    assert formats == ("int4", "int8")
    onnx.checker.check_model(model)  # the standard ops; the checker skips com.microsoft
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False, guess_output_rank=False)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert shapes["logits"] == ["N", spec.vocab_size]
    assert shapes["present_key_0"] == ["T", spec.num_kv_heads, spec.head_dim]
    unshaped = [out for node in model.graph.node for out in node.output if out not in shapes]
    assert not unshaped, unshaped
    ops = {(node.domain, node.op_type) for node in model.graph.node}
    assert {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized"),
            ("com.microsoft", "SkipSimplifiedLayerNormalization")} <= ops


def test_each_contrib_node_fits_onnx_runtimes_own_schema(tiny_smollm_like):
    """The contrib nodes, which the ONNX checker skips, against the schemas ONNX Runtime registers:
    input count and every attribute known."""
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    from ricllm.engine.runtime.onnx_export import export

    schemas = {(s.domain, s.name): s for s in get_all_operator_schema()}
    model = export(tiny_smollm_like)[0]
    checked = 0
    for node in model.graph.node:
        if node.domain != "com.microsoft":
            continue
        schema = schemas[(node.domain, node.op_type)]
        assert schema.min_input <= len(node.input) <= schema.max_input, node.op_type
        assert {a.name for a in node.attribute} <= set(schema.attributes), node.op_type
        assert schema.min_output <= len(node.output) <= schema.max_output, node.op_type
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_matmul_nbits_reproduces_the_files_weights(kind):
    """One MatMulNBits node built from GGUF blocks, times the identity, is the file's dequantized weight
    (accuracy_level 0, fp32 products: exact up to fp32 rounding); Q4_1's offsets as the graph adds them."""
    import gguf
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ricllm.engine.runtime.onnx_export import GraphBuilder, matmul_nbits

    rows, columns = 48, 96
    source = np.random.default_rng(3).standard_normal((rows, columns)).astype(np.float32) * 0.05
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(source, qtype)
    expected = gguf.quants.dequantize(blocks, qtype).reshape(rows, columns)
    g = GraphBuilder()
    y = matmul_nbits(g, "x", kind, blocks.reshape(rows, columns // 32, -1), "w", accuracy_level=0)
    model = g.model("one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", columns])],
                    [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["M", rows])])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": np.eye(columns, dtype=np.float32)})[0].T
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_fp32_logits_and_greedy_tokens_match_the_torch_runtime(tiny_gguf):
    """F32 weights, GQA 4:2, prompts of 5-100 tokens in chunks of 64 and batched decodes: every
    sampled logit within ``FP32_MAX_LOGIT_DIFFERENCE`` of the torch runtime's fp32, same tokens."""
    prompts = random_prompts(300, (5, 30, 100), seed=1)
    ours = recorded(onnx_llm(tiny_gguf, max_num_batched_tokens=64), prompts)
    theirs = recorded(LLM(str(tiny_gguf), runtime="torch", dtype="float32", kv_cache_budget="4MiB",
                          weight_cache=False, max_num_batched_tokens=64), prompts)
    assert ours[0] == theirs[0]
    difference = max((a - b).abs().max().item() for a, b in zip(ours[1], theirs[1]))
    assert difference <= FP32_MAX_LOGIT_DIFFERENCE, difference


def test_packed_logits_stay_within_the_stated_difference(tiny_smollm_like):
    """Q4_1 layers, tied Q8_0 head: the first sampled position's logits (the same context in both
    runtimes) within ``PACKED_MAX_LOGIT_DIFFERENCE`` of the torch runtime's fp32 products."""
    prompts = random_prompts(300, (5, 30, 100), seed=4)
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    llm = onnx_llm(tiny_smollm_like, max_num_batched_tokens=64)
    assert llm.engine.runtime.weight_formats == ("int4", "int8")
    ours = recorded(llm, prompts, first)[1]
    theirs = recorded(LLM(str(tiny_smollm_like), runtime="torch", dtype="float32", kv_cache_budget="4MiB",
                          weight_cache=False, max_num_batched_tokens=64), prompts, first)[1]
    difference = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    assert 0 < difference <= PACKED_MAX_LOGIT_DIFFERENCE, difference


def test_prefix_caching_and_constrained_answers_run_on_the_onnx_runtime(tiny_gguf):
    """A second request behind the same prompt reads the first one's blocks from the pool (prefix cache
    hits), and still gets the torch runtime's tokens; a choice constraint gives one of its choices."""
    prompt = random_prompts(300, (40,), seed=9)[0]
    llm = onnx_llm(tiny_gguf)
    first = llm.generate([prompt], GREEDY)[0].token_ids
    again = llm.generate([prompt + [7, 8]], GREEDY)[0]
    assert again.num_cached_tokens == 32  # two full blocks of 16 read from the pool
    torch_llm = LLM(str(tiny_gguf), runtime="torch", dtype="float32", kv_cache_budget="4MiB", weight_cache=False)
    assert first == torch_llm.generate([prompt], GREEDY)[0].token_ids
    assert again.token_ids == torch_llm.generate([prompt + [7, 8]], GREEDY)[0].token_ids
    choice = llm.generate(["cell load"], SamplingParams(max_tokens=8, structured={"choice": ["high", "low"]}))[0]
    assert choice.text in ("high", "low")


def test_the_onnx_runtime_refuses_what_it_does_not_serve_by_name(tiny_gguf):
    with pytest.raises(ConfigError, match=r"runtime 'onnx' cannot serve this configuration: dtype 'bfloat16'"):
        onnx_llm(tiny_gguf, dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"runtime 'onnx' cannot serve this configuration: kv_cache_dtype 'int8'"):
        onnx_llm(tiny_gguf, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match=r"runtime 'onnx' cannot serve this configuration: weights 'int8'"):
        onnx_llm(tiny_gguf, weights="int8")


def test_onnx_runtime_threads_follow_the_engine_and_do_not_spin(tiny_gguf):
    llm = onnx_llm(tiny_gguf, threads=1)
    options = llm.engine.runtime.model.session.get_session_options()
    assert llm.engine.runtime.threads == options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


SERVE_WITHOUT_TORCH = """
import json, sys
from ricllm import LLM, SamplingParams
llm = LLM(sys.argv[1], runtime="onnx", kv_cache_budget="4MiB")
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=12, ignore_eos=True))
print(json.dumps({"runtime": llm.engine.runtime.name, "source": llm.engine.runtime.weights_source.split()[0],
                  "torch": "torch" in sys.modules, "tokens": [o.token_ids for o in outs]}))
"""


def test_a_process_serves_through_onnx_runtime_without_importing_torch(tiny_gguf, tmp_path):
    """First start: exported into the cache; second: read from it. Neither imports torch, and both give
    the torch runtime's greedy tokens."""
    prompts = random_prompts(300, (5, 30), seed=1)
    env = {**os.environ, "RICLLM_CACHE_DIR": str(tmp_path), "RICLLM_LOG_LEVEL": "warning"}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TORCH, str(tiny_gguf), json.dumps(prompts)],
                              check=False, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [r["source"] for r in runs] == ["file", "cache"]
    assert all(r["runtime"] == "onnx" and not r["torch"] for r in runs), runs
    expected = [o.token_ids for o in LLM(str(tiny_gguf), runtime="torch", dtype="float32", kv_cache_budget="4MiB",
                                         weight_cache=False).generate(prompts, GREEDY)]
    assert runs[0]["tokens"] == runs[1]["tokens"] == expected


def test_export_onnx_writes_a_graph_onnx_runtime_loads(tiny_smollm_like, tmp_path):
    import onnxruntime as ort

    from ricllm.cli import main

    out = tmp_path / "tiny.onnx"
    assert main(["export-onnx", str(tiny_smollm_like), str(out)]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()][0] == "logits"
    meta = json.loads((tmp_path / "tiny.onnx.json").read_text())
    assert meta["weight_formats"] == ["int4", "int8"]
    # as readable as the file beside it: a container's runtime user reads what the build stage wrote
    assert out.stat().st_mode & 0o777 == (tmp_path / "tiny.onnx.json").stat().st_mode & 0o777
    assert main(["export-onnx", str(tmp_path / "missing.gguf"), str(out)]) == 2


def onnx_teacher_forced_logits(llm: LLM, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """The graph's fp32 logits at ``positions`` (each predicts the next token), from one prefill of
    ``token_ids`` whose rows at ``positions`` all give logits, on the engine's pool (blocks 0, 1, ... in
    order: ``llm`` must hold no cached prefix there)."""
    from ricllm.engine.runtime.flat_batch import FlatBatch

    runner = llm.engine.runtime.runner
    blocks = list(range((len(token_ids) + runner.block_size - 1) // runner.block_size))
    flat = FlatBatch(input_ids=token_ids, positions=list(range(len(token_ids))),
                     slot_mapping=list(range(len(token_ids))), query_start_loc=[0, len(token_ids)],
                     context_lens=[len(token_ids)], block_tables=[blocks], logits_rows=positions,
                     max_query_len=len(token_ids), prefill_rows=len(token_ids),
                     prefill_products=len(token_ids) ** 2)
    return torch.from_numpy(runner.compute(flat))


def teacher_forced_agreement(llm: LLM, choices) -> tuple[int, int]:
    """(positions where the graph's argmax is the oracle's, positions): each oracle sequence as one prefill."""
    agree = total = 0
    for full, positions, oracle in choices:
        agree += int((onnx_teacher_forced_logits(llm, full, positions).argmax(-1) == oracle).sum())
        total += len(positions)
    return agree, total


@pytest.fixture(scope="module")
def smollm2_onnx(smollm2) -> LLM:
    """SmolLM2 through ONNX Runtime, its graph exported for this module alone (into a temporary folder)."""
    return LLM(str(smollm2), runtime="onnx", kv_cache_budget="64MiB", weight_cache=False)


@pytest.mark.slow
def test_smollm2_greedy_choices_agree_with_hf_fp32(smollm2_onnx, smollm2_oracle):
    """Teacher-forced on the oracle's 4 × 128 positions: ONNX Runtime's argmax agrees with HF fp32's at ≥ 95%."""
    agree, total = teacher_forced_agreement(smollm2_onnx, smollm2_oracle["choices"])
    said = f"onnx: greedy agreement with HF fp32 {agree}/{total} = {agree / total:.1%}"
    print(said)
    assert agree / total >= 0.95, said


@pytest.mark.slow
def test_smollm2_perplexity_stays_within_two_percent_of_hf_fp32(smollm2_onnx, smollm2_oracle):
    """TEXT's perplexity from the graph's logits (one prefill), against HF fp32's on the same text."""
    from tests.smollm2_oracle import TEXT

    ids = smollm2_onnx.tokenizer.encode(TEXT)
    logits = onnx_teacher_forced_logits(smollm2_onnx, ids, list(range(len(ids) - 1)))
    ppl = math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
    change = ppl / smollm2_oracle["perplexity"] - 1
    said = f"onnx: perplexity {ppl:.3f} vs HF fp32 {smollm2_oracle['perplexity']:.3f} ({change:+.2%})"
    print(said)
    assert abs(change) <= 0.02, said
