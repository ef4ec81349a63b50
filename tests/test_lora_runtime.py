"""LoRA adapters served by both runtimes: a step whose rows belong to different adapters (and to
none) gives each row what its adapter computes (PEFT on HF's model of the same GGUF), the same as
that request run alone under it; both runtimes compute the same bits where both run the C decoder
stack; rows without an adapter are untouched; the slots refuse what does not fit them.

The runners are driven directly, one step at a time, with sequences whose ``adapter`` is set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.engine.runtime.flat_batch import flatten
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.lora_request import AdapterSlot
from ricllm.model.lora import LoraAdapter, load_lora_adapter
from ricllm.sequence import Sequence
from tests.hf_oracle import load_hf_oracle
from tests.helpers import require_module
from tests.lora_adapters import write_lora_adapter

# a batch of five requests: under adapter A (slot 0), B (slot 2) and none, A's last two side by side
MIXED = [([5, 6, 7, 8, 9, 10, 11], 0), ([12, 13, 14], 2), ([15, 16, 17, 18, 19], None), ([20, 21], 0),
         ([22, 23, 24, 25], 0)]
DECODE_STEPS = 6
# Greedy tokens may part only where two tokens tie within bf16 rounding (tests/test_weight_formats.py):
# a batch's kernels may differ with its row count. A row given another row's adapter, or none, moves
# this model's logits by several units.
LOGIT_TOL = 0.15
ORACLE_ATOL = 1e-4  # fp32: tests/test_oracle_parity.py


def engine(path: Path, runtime: str, **kwargs) -> LLM:
    kwargs.setdefault("weight_cache", False)
    kwargs.setdefault("kv_cache_budget", "4MiB")
    kwargs.setdefault("weights", "int4")
    return LLM(str(path), runtime=runtime, **kwargs)


def adapters_for(llm: LLM, folder: Path) -> dict[int, LoraAdapter]:
    """Adapter A (rank 4 on every projection) in slot 0 and B (rank 8, and rank 2 on q; not on k)
    in slot 2 of the engine's runtime."""
    spec = llm.engine.spec
    a = load_lora_adapter(write_lora_adapter(folder / "A", spec, seed=1), spec)
    b = load_lora_adapter(write_lora_adapter(folder / "B", spec, seed=2, rank=8, alpha=4,
                                             projections=("q", "v", "o", "gate", "up", "down"),
                                             config={"rank_pattern": {"q_proj": 2}}), spec)
    for slot, adapter in ((0, a), (2, b)):
        llm.engine.runtime.lora.load(slot, adapter)
    return {0: a, 2: b}


def run_steps(llm: LLM, requests: list[tuple[list[int], int | None]], decode_steps: int = DECODE_STEPS
              ) -> list[tuple[list[int], torch.Tensor]]:
    """Each request's (tokens, logits [1 + decode_steps, vocab]) when the runner runs them together:
    one prefill step of every prompt, then greedy decode steps of every sequence."""
    cache, runner = llm.engine.cache, llm.engine.runtime.runner
    params = SamplingParams(max_tokens=decode_steps + 1)
    kv_window, *group_windows = llm.engine.checks.kv_windows_of(params)  # a hybrid cache's groups (Gemma 3)
    seqs = [Sequence(request_id=str(i), token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                     arrival_time=0.0, kv_window=kv_window, group_windows=tuple(group_windows),
                     adapter=None if slot is None else AdapterSlot(f"slot{slot}", slot, f"hash{slot}"))
            for i, (prompt, slot) in enumerate(requests)]
    logits = [[] for _ in seqs]
    counts = [len(prompt) for prompt, _ in requests]
    for _ in range(decode_steps + 1):
        for seq, count in zip(seqs, counts):
            seq.take_blocks(cache.allocate(seq, count))
        step, _ = runner.run(ScheduledBatch(list(zip(seqs, counts))))
        step = torch.as_tensor(np.asarray(step))
        for i, (seq, count) in enumerate(zip(seqs, counts)):
            logits[i].append(step[i])
            seq.num_computed_tokens += count
            seq.token_ids.append(int(step[i].argmax()))
        counts = [1] * len(seqs)
    for seq in seqs:
        cache.free(seq)
    return [(seq.token_ids, torch.stack(rows)) for seq, rows in zip(seqs, logits)]


def divergence(ours: tuple[list[int], torch.Tensor], theirs: tuple[list[int], torch.Tensor], prompt: list[int]
               ) -> tuple[bool, float]:
    """(whether the greedy tokens differ, the largest logit gap up to and including the first
    differing token: past it the two runs have different contexts)."""
    (tokens, logits), (their_tokens, their_logits) = ours, theirs
    generated, their_generated = tokens[len(prompt):], their_tokens[len(prompt):]
    same = next((j for j, (a, b) in enumerate(zip(generated, their_generated)) if a != b), len(generated))
    return same < len(generated), (logits[:same + 1] - their_logits[:same + 1]).abs().max().item()


def assert_each_row_as_alone(llm: LLM, requests=MIXED) -> None:
    together = run_steps(llm, requests)
    for request, batched in zip(requests, together):
        alone = run_steps(llm, [request])[0]
        differ, gap = divergence(batched, alone, request[0])
        assert gap <= LOGIT_TOL, (f"request {request} (slot {request[1]}) in a mixed batch: logits differ from "
                                  f"its own run by up to {gap:.3f}" + (" and its greedy tokens too" if differ else ""))


@pytest.fixture(scope="module")
def native_pair(tiny_native_gguf, tmp_path_factory):
    """The native runtime and the torch runtime (C decoder stack) on the same packed tiny model,
    each with adapters A and B loaded."""
    folder = tmp_path_factory.mktemp("adapters")
    engines = {runtime: engine(tiny_native_gguf, runtime) for runtime in ("native", "torch")}
    assert engines["torch"].engine.runtime.model.decoder_stack is not None
    adapters = {runtime: adapters_for(llm, folder) for runtime, llm in engines.items()}
    return engines, adapters


# ------------------------------------------------------------------ the step's segments


def test_the_flat_batch_groups_rows_by_adapter_slot():
    def seq(length: int, slot: int | None) -> Sequence:
        return Sequence(request_id="r", token_ids=list(range(3, 3 + length)), num_prompt_tokens=length,
                        params=SamplingParams(), arrival_time=0.0, block_table=[0, 1, 2],
                        adapter=None if slot is None else AdapterSlot("a", slot, "h"))

    batch = ScheduledBatch([(seq(4, 1), 4), (seq(3, 1), 3), (seq(2, None), 2), (seq(5, 0), 5), (seq(1, 1), 1),
                            (seq(2, 1), 2)])
    assert flatten(batch, 16).lora_segments == [(0, 7, 1), (9, 14, 0), (14, 17, 1)]
    assert flatten(ScheduledBatch([(seq(4, None), 4), (seq(2, None), 2)]), 16).lora_segments == []


# ------------------------------------------------------------------ against PEFT


def peft_logits(gguf: Path, adapter_folder: Path | None, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    model = load_hf_oracle(gguf)
    if adapter_folder is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_folder))
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, positions].float()


def positions_of(prompt: list[int], tokens: list[int]) -> list[int]:
    return list(range(len(prompt) - 1, len(tokens) - 1))


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"], ids=["c-kernels", "torch-ops"])
def test_fp32_logits_under_an_adapter_are_pefts(tiny_gguf, tmp_path, attention_backend):
    """The torch runtime in fp32 with the C kernels (the adapters in the C layout) and with the torch
    reference ops (``lora_delta`` on tensors): prefill and decode logits of two requests under two
    adapters and one under none, in one batch, equal PEFT's on HF's model of the GGUF."""
    require_module("peft")  # the dev extra's; CI fails without it
    llm = engine(tiny_gguf, "torch", weights="auto", dtype="float32", kv_cache_budget="8MiB",
                 attention_backend=attention_backend)
    kind = type(llm.engine.runtime.lora).__name__
    assert kind == ("LoraSlots" if attention_backend == "cpu" else "TorchLoraSlots")
    adapters_for(llm, tmp_path)
    requests = [MIXED[0], MIXED[1], MIXED[2]]
    for (prompt, slot), (tokens, logits) in zip(requests, run_steps(llm, requests)):
        folder = {0: tmp_path / "A", 2: tmp_path / "B", None: None}[slot]
        reference = peft_logits(tiny_gguf, folder, tokens, positions_of(prompt, tokens))
        torch.testing.assert_close(logits, reference, atol=ORACLE_ATOL, rtol=0)
        assert tokens[len(prompt):] == reference.argmax(-1).tolist()


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_bf16_logits_under_an_adapter_follow_pefts(native_pair, tiny_native_gguf, tmp_path_factory, runtime):
    """bf16 activations and 4-bit weights (the native runtime, the torch one's C stack) err from
    HF's fp32 model of the same GGUF by rounding (about 0.08 here, with or without the adapter);
    under the adapter they stay within the bf16 tolerance of PEFT's logits, which the adapter
    moves by several units."""
    require_module("peft")  # the dev extra's; CI fails without it
    engines, adapters = native_pair
    llm = engines[runtime]
    folder = Path(adapters[runtime][0].path)
    (prompt, _), base_prompt = MIXED[0], MIXED[0][0]
    (tokens, logits), = run_steps(llm, [MIXED[0]])
    (base_tokens, base_logits), = run_steps(llm, [(base_prompt, None)])
    reference = peft_logits(tiny_native_gguf, folder, tokens, positions_of(prompt, tokens))
    base_reference = peft_logits(tiny_native_gguf, None, base_tokens, positions_of(prompt, base_tokens))
    error, base_error = (logits - reference).abs().max().item(), (base_logits - base_reference).abs().max().item()
    moved = (reference - peft_logits(tiny_native_gguf, None, tokens, positions_of(prompt, tokens))).abs().max().item()
    assert error <= LOGIT_TOL, f"{error:.3f} from PEFT's logits under the adapter, {base_error:.3f} without"
    assert moved > 10 * LOGIT_TOL, f"the adapter moves PEFT's logits by only {moved:.3f}"


# ------------------------------------------------------------------ mixed batches


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_a_mixed_batch_gives_each_request_its_own_adapters_logits(native_pair, runtime):
    """Prefill and decode steps whose rows belong to adapter A, adapter B and none, in the C
    decoder stack: each request's logits and greedy tokens are those of its run alone."""
    engines, _ = native_pair
    assert_each_row_as_alone(engines[runtime])


def test_a_mixed_batch_on_the_torch_per_op_path(tiny_native_gguf, tmp_path):
    """The fused modules one by one (the C LoRA kernel on the tensors' data), without the stack."""
    llm = engine(tiny_native_gguf, "torch")
    llm.engine.runtime.model.decoder_stack = None
    adapters_for(llm, tmp_path)
    assert_each_row_as_alone(llm)


def test_a_mixed_batch_on_the_torch_reference_ops(tiny_native_gguf, tmp_path):
    """The torch reference modules with the adapters as tensors (``lora_delta``), as on a GPU."""
    llm = engine(tiny_native_gguf, "torch", attention_backend="torch", dtype="bfloat16")
    assert type(llm.engine.runtime.lora).__name__ == "TorchLoraSlots"
    adapters_for(llm, tmp_path)
    assert_each_row_as_alone(llm)


def test_adapters_change_what_their_rows_compute_and_nothing_else(native_pair):
    """A and B each move their rows' logits by whole units; a row of no adapter is left as it is."""
    engines, _ = native_pair
    llm = engines["native"]
    base = run_steps(llm, [(prompt, None) for prompt, _ in MIXED])
    mixed = run_steps(llm, MIXED)
    for (prompt, slot), (_, ours), (_, plain) in zip(MIXED, mixed, base):
        moved = (ours[0] - plain[0]).abs().max().item()  # the prefill's logits: the same context
        assert moved > 1.0 if slot is not None else moved == 0.0, (slot, moved)


# ------------------------------------------------------------------ runtimes and no adapter


def test_native_and_torch_compute_the_same_bits_under_adapters(native_pair):
    """Where both run the C decoder stack (decodes, small prefills) the two runtimes agree bit for
    bit with adapters, as they do without."""
    engines, _ = native_pair
    native, torch_runtime = (run_steps(engines[runtime], MIXED) for runtime in ("native", "torch"))
    for (tokens, logits), (their_tokens, their_logits) in zip(native, torch_runtime):
        assert tokens == their_tokens
        assert torch.equal(logits, their_logits)


def test_the_stack_adds_the_per_op_paths_updates_bit_for_bit(native_pair, tiny_native_gguf, tmp_path):
    """The torch runtime's decoder stack and its fused modules one by one apply the same LoRA
    kernel at the same places: the same bits, as without adapters."""
    engines, _ = native_pair
    per_op = engine(tiny_native_gguf, "torch")
    per_op.engine.runtime.model.decoder_stack = None
    adapters_for(per_op, tmp_path)
    for (tokens, logits), (their_tokens, their_logits) in zip(run_steps(engines["torch"], MIXED),
                                                              run_steps(per_op, MIXED)):
        assert tokens == their_tokens
        assert torch.equal(logits, their_logits)


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_without_adapters_the_logits_are_those_of_a_runtime_without_slots(tiny_native_gguf, native_pair, runtime):
    """Resident adapters cost rows of no adapter nothing: their logits are bit for bit those of a
    runtime built with max_loras=0."""
    engines, _ = native_pair
    plain = [(prompt, None) for prompt, _ in MIXED]
    without_slots = engine(tiny_native_gguf, runtime, max_loras=0)
    assert without_slots.engine.runtime.lora.capacity == 0
    for (tokens, logits), (their_tokens, their_logits) in zip(run_steps(engines[runtime], plain),
                                                              run_steps(without_slots, plain)):
        assert tokens == their_tokens and torch.equal(logits, their_logits)


# ------------------------------------------------------------------ the slots


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_the_slots_hold_max_loras_adapters_in_the_activations_type(tiny_native_gguf, native_pair, runtime):
    engines, adapters = native_pair
    slots = engines[runtime].engine.runtime.lora
    assert slots.capacity == 4  # max_loras' default
    a, b = adapters[runtime][0], adapters[runtime][2]
    assert slots.nbytes == (a.nbytes + b.nbytes) // 2  # bf16: half of the fp32 arrays
    fresh = engine(tiny_native_gguf, runtime, max_loras=2)
    assert fresh.engine.runtime.lora.capacity == 2 and fresh.engine.runtime.lora.nbytes == 0
    fresh.engine.runtime.lora.load(1, a)
    fresh.engine.runtime.lora.load(1, b)  # replaces A
    assert fresh.engine.runtime.lora.nbytes == b.nbytes // 2
    fresh.engine.runtime.lora.unload(1)
    assert fresh.engine.runtime.lora.nbytes == 0


@pytest.mark.parametrize("slot, projections", [(0, 7), (2, 6)])  # B leaves k alone
def test_a_slot_lays_its_updates_out_in_the_order_a_step_reads_them(native_pair, slot, projections):
    engines, _ = native_pair
    slots = engines["native"].engine.runtime.lora
    assert type(slots).__name__ == "LoraSlots"

    def weights(layer: int, names: tuple[str, ...]) -> list:
        return [found[2] for name in names for found in slots.updates(layer, name, [(0, 1, slot)])]

    reads = [array for layer in range(slots.spec.num_layers)
             for names in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
             for array in [*(w.a for w in weights(layer, names)), *(w.b_t for w in weights(layer, names))]]
    assert len(reads) == 2 * projections * slots.spec.num_layers
    starts = [array.ctypes.data for array in reads]
    assert starts == sorted(starts)
    assert starts[-1] + reads[-1].nbytes - starts[0] <= slots.slot_nbytes(slot) + 64 * len(reads)  # one buffer


def test_an_unloaded_slot_leaves_its_rows_as_without_adapter(tiny_native_gguf, tmp_path):
    llm = engine(tiny_native_gguf, "native")
    adapters_for(llm, tmp_path)
    llm.engine.runtime.lora.unload(0)
    (_, unloaded), = run_steps(llm, [MIXED[0]])
    (_, plain), = run_steps(llm, [(MIXED[0][0], None)])
    assert torch.equal(unloaded, plain)


@pytest.mark.parametrize("runtime, attention_backend", [("native", "auto"), ("torch", "auto"), ("torch", "torch")])
def test_load_refuses_a_slot_out_of_range_and_an_adapter_of_another_shape(tiny_native_gguf, tmp_path, runtime,
                                                                           attention_backend):
    llm = engine(tiny_native_gguf, runtime, max_loras=2, attention_backend=attention_backend)
    spec, slots = llm.engine.spec, llm.engine.runtime.lora
    adapter = load_lora_adapter(write_lora_adapter(tmp_path / "fits", spec), spec)
    with pytest.raises(ValueError, match=r"LoRA slot 2 is out of range: this runtime holds 2 adapters \(max_loras\)"):
        slots.load(2, adapter)
    with pytest.raises(ValueError, match=r"LoRA slot -1 is out of range"):
        slots.unload(-1)
    wider = type(spec)(**{**spec.__dict__, "intermediate_size": 2 * spec.intermediate_size, "name": "wider"})
    other = load_lora_adapter(write_lora_adapter(tmp_path / "wider", wider), wider)
    with pytest.raises(ValueError, match=rf"LoRA adapter {tmp_path / 'wider'}: layer 0 gate is A \[4, 64\], "
                                         rf"B \[{2 * spec.intermediate_size}, 4\]; the model .* needs \[rank, 64\] "
                                         rf"and \[{spec.intermediate_size}, rank\]"):
        slots.load(0, other)
    assert slots.nbytes == 0
    none = engine(tiny_native_gguf, runtime, max_loras=0, attention_backend=attention_backend)
    with pytest.raises(ValueError, match=r"LoRA slot 0: this runtime holds no adapters \(max_loras is 0\)"):
        none.engine.runtime.lora.load(0, adapter)
