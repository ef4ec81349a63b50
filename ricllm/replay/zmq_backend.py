"""The ZeroMQ replay backend: a running ``ricllm serve``, reached through ``AsyncRicClient``.

Templates are registered on the server (and unregistered at the end) with their worked examples
and constraint, which every request naming the template inherits; requests are streamed so
the replay measures its own time to first token, and the server's ``stats`` reply feeds the
timeline. This path never imports torch, so a replay client can run on a machine without it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ricllm.errors import RicllmError
from ricllm.report.records import timeline_sample

if TYPE_CHECKING:
    from ricllm.template import Template


def template_digest(template: Template) -> str:
    """Names a template's content (conversation, constraint and fallback), so two scenarios never
    share an id for different templates."""
    fallback = [template.fallback.min_confidence, template.fallback.answer] if template.fallback else None
    content = json.dumps([template.message_list, template.structured.key if template.structured else None,
                          *([fallback] if fallback else [])])
    return hashlib.sha256(content.encode()).hexdigest()[:10]


class ZmqBackend:
    """A running ``ricllm serve``: templates registered, requests streamed for the client's TTFT."""

    mode = "zmq"

    def __init__(self, endpoint: str, timeout_s: float):
        from ricllm.client import AsyncRicClient

        self.endpoint = endpoint
        self.client = AsyncRicClient(endpoint, timeout_s=timeout_s)
        self.template_ids: dict[str, str] = {}
        self.version: str | None = None

    async def start(self, plan: list, templates: dict[str, Template],
                    adapters: dict[str, Any] | None = None) -> dict[str, dict]:
        """``adapters`` are the server's to hold (``ricllm serve --lora-modules``), never sent from here."""
        if adapters:
            raise RicllmError("a replay over ZeroMQ serves templates under the adapters the server holds "
                              "(ricllm serve --lora-modules); it does not load adapters into it")
        try:
            self.version = (await self.client.ping(timeout_s=10)).version
        except TimeoutError:
            raise RicllmError(f"no ricllm server answers at {self.endpoint} (ping timed out after 10 s)") from None
        return {name: await self._register(name, template) for name, template in templates.items()}

    async def _register(self, name: str, template: Template) -> dict[str, Any]:
        """Register the conversation and its constraint; a refusal (a schema the server cannot
        compile, a template that does not fit) stops the replay, naming the template."""
        from ricllm.client import RicClientError

        try:
            reply = await self.client.register_template(
                messages=template.message_list, template_id=f"{name}-{template_digest(template)}",
                structured=template.structured.to_wire() if template.structured else None,
                min_confidence=template.fallback.min_confidence if template.fallback else None,
                fallback=template.fallback.answer if template.fallback else None)
        except RicClientError as exc:
            raise RicllmError(f"template {name!r}: the server refused it: {exc}") from None
        self.template_ids[name] = reply.template_id
        return {"template_id": reply.template_id, "tokens": reply.num_tokens, "pinned_tokens": reply.num_pinned_tokens}

    async def generate(self, planned, spec, record, t0: float) -> None:
        from ricllm.client import RejectedError, ServerError

        options = dict(max_tokens=spec.max_tokens, temperature=spec.temperature, ignore_eos=spec.ignore_eos,
                       deadline_ms=spec.deadline_ms, priority=spec.resolved_priority(),
                       kv_window=spec.kv_window, kv_sinks=spec.kv_sinks)
        if planned.template is not None:
            options["template_id"] = self.template_ids[planned.template]
        messages = [{"role": "user", "content": planned.user_prompt}]
        first, sent = None, time.perf_counter()
        record.sent_s = sent - t0
        try:
            async for reply in self.client.stream(messages=messages, request_id=f"{planned.request_id}-{id(self):x}",
                                                  **options):
                if reply.type == "token":
                    first = first or time.perf_counter()
                else:
                    _fill_from_result(record, reply, sent, first, time.perf_counter(), t0)
        except RejectedError as exc:
            record.finish("rejected", admitted=False, rejection_code=exc.code, rejection_message=exc.message,
                          rejection_numbers=dict(exc.numbers), done_s=time.perf_counter() - t0, client_e2e_s=time.perf_counter() - sent)
        except ServerError as exc:
            record.finish("error", rejection_code=exc.code, rejection_message=exc.message,
                          done_s=time.perf_counter() - t0)
        except TimeoutError as exc:
            record.finish("timeout", rejection_message=str(exc), done_s=time.perf_counter() - t0)

    async def sample(self) -> dict[str, Any]:
        stats = await self.client.stats(timeout_s=2)
        return timeline_sample(stats.kv_cache, stats.queues.running, stats.queues.waiting)

    async def finish(self, interrupted: bool) -> dict[str, Any]:
        info: dict[str, Any] = {"source": "server", "endpoint": self.endpoint, "server_version": self.version}
        try:
            stats = await self.client.stats(timeout_s=5)
            info.update(kv_cache=asdict(stats.kv_cache), server_stats=stats.model_dump(mode="json"),
                        model=stats.model.served_model().record(digest=False))
            for template_id in self.template_ids.values():
                await self.client.unregister_template(template_id, timeout_s=5)
        except (TimeoutError, RicllmError) as exc:
            info["error"] = str(exc)
        finally:
            await self.client.aclose()
        return info


def _fill_from_result(record, result, sent: float, first: float | None, done: float, t0: float) -> None:
    timings = result.timings
    if first is None and result.token_ids:
        first = done
    record.finish("completed", admitted=True, finish_reason=result.finish_reason, server_queue_s=timings.queue_s,
                  server_ttft_s=timings.ttft_s, server_e2e_s=timings.e2e_s, done_s=done - t0,
                  client_ttft_s=None if first is None else first - sent, client_e2e_s=done - sent,
                  prompt_tokens=result.num_prompt_tokens, output_tokens=len(result.token_ids),
                  cached_tokens=result.num_cached_tokens, met=result.deadline_met, text=result.text,
                  granted_max_tokens=result.degraded.granted_max_tokens if result.degraded else None,
                  num_forced_tokens=result.num_forced_tokens, predicted_e2e_s=timings.predicted_e2e_s,
                  promised_e2e_s=timings.promised_e2e_s, confidence=result.confidence, model_text=result.model_text)
