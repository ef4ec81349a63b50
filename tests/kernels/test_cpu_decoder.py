"""The one-call decoder stack (``ricllm.kernels.cpu_decoder``) computes exactly what the per-op
path computes: same logits, bit for bit, on decode steps of one and many sequences and on small
prefill steps, and it hands steps it does not take (large prefills, more rows than the packed
kernels serve) to that path."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.model.packed_linear import vnni_layout_available
from tests.helpers import require, write_tiny_llama_gguf
from tests.recorder import LogitsRecorder
from tests.test_oracle_parity import random_prompts


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("stack") / "tiny_q4_1.gguf", seed=4, quant="Q4_1")


def need_kernels(weights: str) -> None:
    for fmt in {"int4": ("int4", "int8"), "int8": ("int8",)}[weights]:
        require(vnni_layout_available(fmt), f"ricllm's {fmt} kernel does not run here (AVX-512 VNNI/BF16, a C compiler)")


def engine(path, weights: str, stack: bool, **kwargs) -> LLM:
    llm = LLM(str(path), dtype="bfloat16", weights=weights, weight_cache=False, block_size=4,
              kv_cache_budget="4MiB", **kwargs)
    assert llm.engine.runtime.model.decoder_stack is not None, "the packed tiny model should run on the stack"
    if not stack:
        llm.engine.runtime.model.decoder_stack = None
    return llm


def count_stack_calls(llm: LLM) -> list[int]:
    """Rows of each step the stack ran (it is replaced by a counting wrapper)."""
    stack, rows = llm.engine.runtime.model.decoder_stack, []

    class Counting:
        def accepts(self, x, kernel_attention):
            return stack.accepts(x, kernel_attention)

        def __call__(self, x, *args):
            rows.append(x.shape[0])
            return stack(x, *args)

    llm.engine.runtime.model.decoder_stack = Counting()
    return rows


def run(llm: LLM, prompts, params) -> tuple[list, LogitsRecorder]:
    recorder = LogitsRecorder(llm.engine)
    return llm.generate(prompts, params), recorder


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_stack_gives_the_per_op_logits_bit_for_bit(tiny_q4_1, weights):
    need_kernels(weights)
    vocab = LLM(str(tiny_q4_1), weight_cache=False).engine.spec.vocab_size
    prompts = random_prompts(vocab, (3, 17, 6, 30, 9), seed=5)  # contexts crossing several 4-token blocks
    params = [SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    fast = engine(tiny_q4_1, weights, stack=True)
    stack_rows = count_stack_calls(fast)
    fast_out, fast_rec = run(fast, prompts, params)
    slow_out, slow_rec = run(engine(tiny_q4_1, weights, stack=False), prompts, params)
    assert len(prompts) in stack_rows, "decode steps of the whole batch ran on the stack"
    assert [o.token_ids for o in fast_out] == [o.token_ids for o in slow_out]
    for fo, so in zip(fast_out, slow_out):
        (positions, ours), (theirs_positions, theirs) = fast_rec.stacked(fo.request_id), slow_rec.stacked(so.request_id)
        assert positions == theirs_positions
        assert torch.equal(ours, theirs), f"logits differ by up to {(ours - theirs).abs().max().item()}"


def test_steps_the_stack_does_not_take_run_per_op(tiny_q4_1):
    need_kernels("int4")
    llm = engine(tiny_q4_1, "int4", stack=True, max_packed_rows=2)
    assert llm.engine.runtime.model.decoder_stack.max_rows == 2
    stack_rows = count_stack_calls(llm)
    vocab = llm.engine.spec.vocab_size
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 8, 12)]
    outputs = llm.generate(random_prompts(vocab, (5, 7, 9), seed=1), params)
    assert [len(o.token_ids) for o in outputs] == [4, 8, 12]
    # while three sequences decode (3 rows: dense weights, per-op path) the stack is skipped;
    # once the first finishes, the last 2-row and 1-row steps run on it
    assert sorted(set(stack_rows)) == [1, 2]


def test_dense_weights_or_the_torch_backend_keep_the_per_op_path(tiny_q4_1):
    assert LLM(str(tiny_q4_1), dtype="bfloat16", weights="bf16", weight_cache=False).engine.runtime.model.decoder_stack is None
    assert LLM(str(tiny_q4_1), dtype="bfloat16", weights="int4", attention_backend="torch",
               weight_cache=False).engine.runtime.model.decoder_stack is None


def test_small_prefills_run_on_the_stack_and_large_ones_per_op(tiny_q4_1):
    need_kernels("int4")
    from ricllm.attention.backends import C_KERNEL_PREFILL_ROWS

    llm = engine(tiny_q4_1, "int4", stack=True, enable_prefix_caching=False)
    stack_rows = count_stack_calls(llm)
    vocab = llm.engine.spec.vocab_size
    [short, long] = random_prompts(vocab, (8, C_KERNEL_PREFILL_ROWS + 10), seed=2)
    llm.generate([short], SamplingParams(max_tokens=2, ignore_eos=True))
    assert stack_rows == [8, 1]  # the 8-token prefill, then a decode step
    stack_rows.clear()
    llm.generate([long], SamplingParams(max_tokens=2, ignore_eos=True))
    assert stack_rows == [1]  # the 74-token prefill ran op by op (SDPA attention)


def test_a_prompt_joining_running_decodes_stays_on_the_stack_bit_for_bit(tiny_q4_1):
    """Decode rows do not count against the stack's prefill limit: 3 decodes + a 62-token prompt
    (65 rows) run as one C call, with the per-op path's logits."""
    need_kernels("int4")
    from ricllm.attention.backends import C_KERNEL_PREFILL_ROWS

    def mixed_run(stack: bool):
        llm = engine(tiny_q4_1, "int4", stack=stack, enable_prefix_caching=False)
        rows = count_stack_calls(llm) if stack else []
        vocab = llm.engine.spec.vocab_size
        first, late = random_prompts(vocab, (5, 7, 9), seed=8), random_prompts(vocab, (62,), seed=9)[0]
        recorder = LogitsRecorder(llm.engine)
        for p in first:
            llm.engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
        llm.engine.step()  # the three prefills
        llm.engine.add_request(late, SamplingParams(max_tokens=3, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
        return rows, recorder

    rows, fast = mixed_run(stack=True)
    _, slow = mixed_run(stack=False)
    assert 3 + 62 in rows and 3 + 62 > C_KERNEL_PREFILL_ROWS
    for request_id in ("0", "1", "2", "3"):
        (positions, ours), (theirs_positions, theirs) = fast.stacked(request_id), slow.stacked(request_id)
        assert positions == theirs_positions and torch.equal(ours, theirs)
