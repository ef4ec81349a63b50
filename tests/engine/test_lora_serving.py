"""LoRA adapters through the engine, as a user serves them, on both runtimes and both model families
(SmolLM2's Llama and Gemma 3's hybrid cache): requests under different adapters (and none) share batches and get the tokens each gets alone; a prefix computed under one adapter is
never served to another; unknown adapters and full slots are refused by name; an adapter replaced
under its name serves new requests while the ones in flight finish on the old one."""

from __future__ import annotations

import pytest

from ricllm import LLM, LoRARequest, SamplingParams
from ricllm.engine.lora_registry import UnknownAdapterError
from ricllm.errors import CapacityError, InvalidRequestError
from ricllm.model.loader import open_checkpoint
from ricllm.template import Template
from tests.helpers import write_tiny_gemma3_gguf
from tests.lora_adapters import write_lora_adapter

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 8, 1, 4], [11, 2, 6, 6, 9, 10, 1], [7, 12, 4]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma3_int8(tmp_path_factory):
    """A tiny random Gemma 3 (windows of 8 tokens: a hybrid cache) that both runtimes serve."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", seed=9, quant="Q8_0",
                                  pad_vocab_to=16)


@pytest.fixture(scope="module", params=["native", "torch", "gemma3-native", "gemma3-torch"])
def served(request, tiny_native_gguf, tiny_gguf, tiny_gemma3_int8, tmp_path_factory):
    """An engine of each runtime on each model family, and two adapters for its model."""
    runtime = request.param.removeprefix("gemma3-")
    gemma = request.param.startswith("gemma3-")
    path = tiny_gemma3_int8 if gemma else tiny_native_gguf if runtime == "native" else tiny_gguf
    spec = open_checkpoint(path).spec
    folder = tmp_path_factory.mktemp(f"adapters-{request.param}")
    adapters = {name: write_lora_adapter(folder / name, spec, rank=4, seed=seed, std=0.5)
                for name, seed in (("congestion", 1), ("energy", 2))}
    weights = {"weights": "int8"} if gemma else {"weights": "int4"}
    settings = {"kv_cache_budget": 256 * 1024 * (4 if gemma else 1), "block_size": 4, "max_loras": 2,
                "runtime": runtime, **(weights if runtime == "native" else {"dtype": "float32"})}
    llm = LLM(str(path), **settings)
    assert llm.engine.runtime.name == runtime and llm.engine.spec.architecture == ("gemma3" if gemma else "llama")
    return llm, adapters


def tokens(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def test_a_mixed_batch_gives_each_request_its_tokens_alone(served):
    llm, adapters = served
    under = [LoRARequest("congestion", str(adapters["congestion"])), LoRARequest("energy", str(adapters["energy"])),
             None, LoRARequest("congestion")]
    alone = [tokens(llm.generate([p], GREEDY, lora_request=a))[0] for p, a in zip(PROMPTS, under)]
    mixed = tokens(llm.generate(PROMPTS, GREEDY, lora_request=under))
    assert mixed == alone
    base = tokens(llm.generate(PROMPTS[:2], GREEDY))
    assert base != alone[:2], "the adapters change the answers (else this test shows nothing)"


def test_a_prefix_pinned_under_one_adapter_is_served_only_under_it(served):
    llm, adapters = served
    system = [{"role": "system", "content": "Decide for a congested cell, briefly."}]
    prefix_ids = llm.render_chat(system, add_generation_prompt=False)
    llm.pin_prefix(Template.build(system), lora_request=LoRARequest("congestion", str(adapters["congestion"])))
    prompt = prefix_ids + [5, 6, 7]

    def cached_under(adapter):
        return llm.generate([prompt], GREEDY, lora_request=adapter)[0].num_cached_tokens

    pinned = len(prefix_ids) // 4 * 4
    assert pinned > 0 and cached_under(LoRARequest("congestion")) == pinned
    assert cached_under(LoRARequest("energy", str(adapters["energy"]))) < pinned
    assert cached_under(None) < pinned


def test_an_unknown_adapter_and_full_slots_are_refused_by_name(served, tmp_path):
    llm, adapters = served
    llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("congestion", str(adapters["congestion"])))
    llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("energy", str(adapters["energy"])))
    with pytest.raises(UnknownAdapterError, match="'mobility'.*congestion, energy"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("mobility"))
    third = write_lora_adapter(tmp_path / "mobility", llm.engine.spec, rank=2, seed=3)
    with pytest.raises(InvalidRequestError, match="base model's served name"):
        llm.engine.loras.add(llm.engine.served_model.served_name, third)
    with pytest.raises(CapacityError, match="all 2 adapter slots.*max_loras"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("mobility", str(third)))


def test_a_replaced_adapter_serves_new_requests_while_old_ones_finish_on_it(served, tmp_path):
    llm, adapters = served
    spec, settings = llm.engine.spec, _settings_of(llm)
    old, new = adapters["energy"], write_lora_adapter(tmp_path / "energy-v2", spec, rank=4, seed=7, std=0.5)
    old_tokens = tokens(llm.generate([PROMPTS[2]], GREEDY, lora_request=LoRARequest("energy", str(old))))[0]
    fresh = LLM(str(llm.engine.model_path), **settings)
    new_tokens = tokens(fresh.generate([PROMPTS[2]], GREEDY, lora_request=LoRARequest("energy-v2", str(new))))[0]
    assert new_tokens != old_tokens

    engine = LLM(str(llm.engine.model_path), **settings).engine  # one adapter held: a slot is free
    engine.loras.add("energy", old)
    in_flight = engine.add_request(PROMPTS[2], GREEDY, lora_request=LoRARequest("energy"))
    engine.step()  # its prompt is computed under the old content
    engine.loras.add("energy", new)
    after = engine.add_request(PROMPTS[2], GREEDY, lora_request=LoRARequest("energy"))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: list(o.token_ids) for o in engine.step()})
    assert done[in_flight.request_id] == old_tokens and done[after.request_id] == new_tokens
    (held,) = engine.snapshot().adapters
    assert (held.name, held.requests) == ("energy", 0) and held.content_hash == engine.loras.by_name["energy"].slot.content_hash
    engine.loras.add("mobility", old)  # the old content's slot was freed when its last request ended


def _settings_of(llm: LLM) -> dict:
    config = llm.config
    return {"kv_cache_budget": config.kv_cache_budget, "block_size": config.block_size, "max_loras": config.max_loras,
            "runtime": config.runtime, "weights": config.weights, "dtype": config.dtype}
