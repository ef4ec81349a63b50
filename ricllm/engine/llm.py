"""The offline API, in vLLM's words: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import asdict, replace
from typing import Any

from ricllm.cache.kv_cache_manager import PinHandle
from ricllm.config import EngineConfig
from ricllm.engine.chat_prefix import render_chat_prefix, render_chat_request
from ricllm.engine.llm_engine import LLMEngine
from ricllm.errors import InvalidRequestError
from ricllm.lora_request import LoRARequest
from ricllm.outputs import RequestOutput
from ricllm.sampling_params import SamplingParams
from ricllm.template import Template

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """Load a model (``None`` = the installed SmolLM2-135M-Instruct GGUF) on a fixed KV budget.

    ``admission="deadline"`` promises deadlines: a request that cannot be served in time (or can
    never fit) comes back at once with ``finish_reason == "rejected"`` and its ``rejection``;
    ``"off"`` (the default) queues everything that can fit and raises for what never can.
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """``settings`` are :class:`ricllm.config.EngineSettings` fields: ``kv_cache_budget="64MiB"``,
        ``admission="deadline"`` (or ``admission={"policy": "deadline", "degrade": True}``), ...;
        a bad one raises :class:`ricllm.errors.ConfigError` naming it."""
        self.config = EngineConfig(model=model, **settings)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is checked before any is queued.
        ``lora_request`` serves every prompt (or, as a list, each its own) under a LoRA adapter;
        one given with a path is loaded once and kept under its name (at most ``max_loras``)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        adapters = _as_lora_list(lora_request, len(prompts))
        slots = [self.engine.loras.resolve(a) for a in adapters]
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        for (_, token_ids), p, slot in zip(encoded, params, slots):
            self.engine.validate(token_ids, p, slot)
        seqs = [self.engine.add_request(tokens if text is None else text, p, lora_request=a)
                for (text, tokens), p, a in zip(encoded, params, adapters)]
        return self._run(seqs, use_tqdm)

    def chat(self, messages: Messages | Seq[Messages],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def render_chat(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        """A conversation's tokens: as a request (with the generation prompt) or as a prefix to pin."""
        if add_generation_prompt:
            return render_chat_request(self.tokenizer, None, messages)
        return render_chat_prefix(self.tokenizer, messages).token_ids

    def _run(self, seqs, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        wanted = {s.request_id for s in seqs}
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(seqs), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(outputs) < len(wanted):
                for out in self.engine.step():
                    if out.request_id in wanted:
                        outputs[out.request_id] = out
                        bar.update(1)
        return [outputs[s.request_id] for s in seqs]

    # ------------------------------------------------------------ prefix pinning

    def pin_prefix(self, prefix: str | list[int] | Messages | Template,
                   lora_request: LoRARequest | None = None) -> PinHandle:
        """Compute a prefix's K/V once and keep its full blocks resident until ``unpin_prefix``.

        A list of chat messages (e.g. one system message) is pinned in its rendered form, which
        is what ``chat`` requests start with. A :class:`ricllm.template.Template` pins its
        conversation and compiles its constraint now, so its requests find it compiled
        (``LLMEngine.pin_template``, the one way a template is pinned). Under ``lora_request`` the
        prefix's K/V is that adapter's, found only by requests under the same adapter; a template
        names its own adapter (``Template.adapter``).
        """
        if isinstance(prefix, Template) or (isinstance(prefix, list) and prefix and isinstance(prefix[0], dict)):
            template = prefix if isinstance(prefix, Template) else Template.build(prefix)
            if lora_request is not None:
                template = self._under(template, lora_request)
            return self.engine.pin_template(template).handle
        handle, seq = self.engine.pin_prefix(self.engine.encode_prompt(prefix)[1], lora_request=lora_request)
        self._run([seq], use_tqdm=False)
        return handle

    def _under(self, template: Template, lora_request: LoRARequest) -> Template:
        """``template`` named to ``lora_request``'s adapter, loaded now if it comes with a path."""
        if template.adapter not in (None, lora_request.lora_name):
            raise InvalidRequestError(f"the template names adapter {template.adapter!r}; the pin asks for "
                                      f"{lora_request.lora_name!r}")
        self.engine.loras.resolve(lora_request)
        return replace(template, adapter=lora_request.lora_name)

    def unpin_prefix(self, handle: PinHandle) -> None:
        self.engine.unpin_prefix(handle)

    def kv_cache_stats(self) -> dict:
        """The KV cache's part of the engine's snapshot (``LLMEngine.snapshot``), as a dict."""
        return asdict(self.engine.snapshot().kv_cache)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, (str, list, tuple)):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_lora_list(requests, count: int) -> list[LoRARequest | None]:
    if requests is None or isinstance(requests, LoRARequest):
        return [requests] * count
    requests = list(requests)
    if len(requests) != count:
        raise InvalidRequestError(f"got {len(requests)} LoRA requests for {count} prompts")
    for r in requests:
        if r is not None and not isinstance(r, LoRARequest):
            raise InvalidRequestError(f"a lora_request is a LoRARequest or None, got {type(r).__name__}")
    return requests


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
