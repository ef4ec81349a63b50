"""The engine thread of ``ricllm serve`` (docs/serve.md): ``Worker``, plugged into the engine's
``EngineLoop``, owns the engine, the templates and the table of pending requests, and runs on the
``ricllm-engine`` thread. It shares only the ``ServerState`` with the fronts (the socket thread,
the HTTP thread), whose commands it takes from one inbox alike."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ricllm import protocol as p
from ricllm.engine.engine_loop import EngineDriver
from ricllm.errors import CapacityError, ConfigError, InvalidRequestError, RicllmError
from ricllm.lora_request import LoRARequest
from ricllm.serve.handoff import Command, Key, Refused, client_name, clock, log, log_refusal, wire_numbers
from ricllm.serve.metrics import EngineSnapshot, FinishedRequest, deadline_class
from ricllm.serve.reload import apply_live_changes
from ricllm.version import __version__

if TYPE_CHECKING:
    from ricllm.cache.kv_cache_manager import PinHandle
    from ricllm.config import EngineConfig
    from ricllm.engine.chat_prefix import ChatPrefix
    from ricllm.engine.latency_model import LatencyModel
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.outputs import RequestOutput
    from ricllm.sampling_params import SamplingParams
    from ricllm.sequence import Sequence
    from ricllm.serve.state import ServerState
    from ricllm.structured.compiler import CompiledGrammar
    from ricllm.structured.fallback import Fallback
    from ricllm.structured.spec import StructuredSpec
    from ricllm.template import Template


PUBLISH_EVERY_S = 0.1


@dataclass(eq=False)
class _Pending:
    """A generate inside the engine, until its one final reply."""

    command: Command
    seq: Sequence
    internal_id: str
    holdback: int  # characters kept back while streaming, so a stop string is never sent
    deadline_class: str  # its metrics label
    inter_token: Any  # its class's inter-token histogram (looked up once, observed each step)
    sent_tokens: int = 0
    sent_chars: int = 0
    timed_tokens: int = 0  # output tokens as of the last step that brought some
    last_token_at: float = 0.0  # that step's end

    @property
    def request(self) -> p.GenerateRequest:
        return self.command.request

    def time_tokens(self, now: float, tokens: int) -> None:
        """One inter-token interval per step that brought tokens after the first (as vLLM counts them)."""
        if tokens <= self.timed_tokens:
            return
        if self.timed_tokens:
            self.inter_token.observe(now - self.last_token_at)
        self.timed_tokens, self.last_token_at = tokens, now


@dataclass(eq=False)
class _Template:
    """A registered template and its pin; ``waiters`` are register requests awaiting the pin."""

    template_id: str
    template: Template  # its conversation and the constraint its requests inherit
    prefix: ChatPrefix  # the conversation as chat requests start with it
    handle: PinHandle
    waiters: list[Command] = field(default_factory=list)
    pinned: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.prefix.token_ids

    @property
    def constraint(self) -> str | None:
        return self.template.structured.kind if self.template.structured is not None else None

    def pinned_tokens(self, block_size: int) -> int:
        return len(self.handle.block_ids) * block_size

    @property
    def adapter(self) -> str | None:
        return self.template.adapter

    def registered(self, request_id: str, block_size: int) -> p.TemplateRegistered:
        return p.TemplateRegistered(id=request_id, template_id=self.template_id, num_tokens=len(self.token_ids),
                                    num_pinned_tokens=self.pinned_tokens(block_size),
                                    num_examples=self.template.num_examples, adapter=self.adapter)

    def stats(self, block_size: int) -> p.TemplateStats:
        return p.TemplateStats(num_tokens=len(self.token_ids), pinned=self.pinned,
                               num_pinned_tokens=self.pinned_tokens(block_size),
                               num_examples=self.template.num_examples, constraint=self.constraint,
                               adapter=self.adapter)


class Worker(EngineDriver):
    """What the server plugs into the engine thread (``EngineLoop``): the command handlers, the
    replies along each command's route and the metrics. Only it touches the engine, the templates and
    the pending table, and every method runs on the engine thread.

    Handlers raise (``ProtocolError``, ``Refused``) only before a request reaches the engine's
    queues, so a request that is answered with an error never also gets a result.
    """

    def __init__(self, state: ServerState, config: EngineConfig, latency_model: LatencyModel | None) -> None:
        self.state = state
        self.config = config
        self.latency_model = latency_model
        self.metrics = state.metrics
        self.outbox = state.outbox
        self.intake = state.intake
        self.engine: LLMEngine | None = None
        self._generates: dict[Key, _Pending] = {}
        self._internal: dict[str, _Pending | _Template] = {}
        self._templates: dict[str, _Template] = {}
        self._ids = itertools.count(1)
        self._template_ids = itertools.count(1)
        self._published = 0.0
        self._adapter_paths: dict[str, str] = {}  # adapter name -> its folder as configured, for those held

    def load_engine(self) -> LLMEngine:
        """The engine, built on the engine thread (the loop's source), with ``lora_modules`` loaded:
        an adapter that cannot be fails the start."""
        from ricllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(self.config, clock=clock, latency_model=self.latency_model)
        for name, path in self.state.options.lora_modules.items():
            try:
                engine.loras.add(name, path)
            except RicllmError as exc:
                raise ConfigError(f"lora_modules: cannot serve adapter {name!r} from {path!r}: {exc}") from None
            self._adapter_paths[name] = path
        return engine

    # -- the engine thread's life (EngineDriver)

    def on_ready(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.metrics.set_model_name(self._model_identity().served_name)
        self._publish_adapters()
        self._publish(force=True)
        self.state.ready.set()
        log.info("server_ready", endpoint=self.state.endpoint, http_port=self.state.http_port,
                 admission=self.config.admission.policy, startup_s=round(engine.startup_s, 2))

    def on_load_failed(self, exc: BaseException) -> None:
        log.error("engine_load_failed", error=f"{type(exc).__name__}: {exc}")
        self.state.record_failure(exc)

    def on_fault(self, exc: Exception) -> None:
        log.exception("engine_fault")
        self.state.record_failure(exc)
        self._fail_everything(f"engine fault: {type(exc).__name__}: {exc}")

    def on_exit(self) -> None:
        """Wake the socket thread before and after ``worker_done``: whichever it sees, it sends the rest."""
        self.outbox.wake(force=True)
        self.state.worker_done.set()
        self.outbox.wake(force=True)
        self.outbox.close()

    def on_commands(self, commands: list[Command]) -> None:
        apply_live_changes(self.engine, self.state.live_changes, self.state.publish_config,  # from $CONFIG_FILE
                           self._serve_adapters)
        for command in commands:
            self._dispatch(command)
        self.outbox.wake()  # accepted / rejected go out now, not after the coming step
        self._enforce_drain_deadline()

    def after_round(self, idle: bool) -> None:
        self.outbox.wake()
        # idle through a whole wait: publish, or the metrics would show the last busy state until
        # a command comes (not at once on going idle: the replies of the last step go out first)
        self._publish(force=idle)

    def stop_requested(self) -> bool:
        """Drained once this holds, the engine has no work and the inbound queue is empty."""
        return self.state.draining.is_set()

    def on_stopped(self) -> None:
        self._publish(force=True)

    def _dispatch(self, command: Command) -> None:
        handlers = {p.GenerateRequest: self._generate, p.RegisterTemplateRequest: self._register,
                    p.UnregisterTemplateRequest: self._unregister, p.CancelRequest: self._cancel,
                    p.StatsRequest: self._stats}
        request = command.request
        try:
            handlers[type(request)](command)
        except Refused as refused:  # counted before it is answered: an HTTP client hears at once
            self.metrics.rejected(refused.code, deadline_class(request))
            log_refusal(command, refused.code, refused.message, rejected=True)
            command.reply(refused.reply(request.id))
        except p.ProtocolError as exc:
            self._fail(command, exc.code, exc.message)
        except Exception as exc:  # a bug: answer it, keep serving
            log.exception("request_fault", id=request.id, type=request.type)
            self._fail(command, "INTERNAL", f"{type(exc).__name__}: {exc}")

    def _fail(self, command: Command, code: str, message: str) -> None:
        if isinstance(command.request, p.GenerateRequest):
            self.metrics.error(code, deadline_class(command.request))
            log_refusal(command, code, message, rejected=False)
        command.reply(p.ErrorReply(id=command.request.id, code=code, message=message))

    # -- generate

    def _generate(self, command: Command) -> None:
        request: p.GenerateRequest = command.request
        template = self._template(request.template_id, request.id)
        adapter = self._adapter(request, template)
        grammar = self._constraint(request, template)
        token_ids = self._prompt_tokens(request, template)
        params = self._sampling(request, command.received, grammar.spec if grammar is not None else None,
                                _fallback(request, template))
        internal_id = str(next(self._ids))
        seq = self._add(request, token_ids, params, internal_id, command.received, grammar, adapter)
        if seq.rejection is not None:  # its output comes back from the next step: ignored, unknown id
            raise Refused(seq.rejection.code, seq.rejection.message, seq.rejection.numbers)
        cls = deadline_class(request)
        self.metrics.admitted("degraded" if seq.degradation is not None else "admitted", cls)
        holdback = max((len(s) for s in request.stop), default=1) - 1
        pending = _Pending(command, seq, internal_id, holdback, cls, self.metrics.inter_token(cls))
        self._generates[command.key] = pending
        self._internal[internal_id] = pending
        command.reply(p.Accepted(id=request.id, bound_ms=self._bound_ms(pending),
                                 queue_position=self.engine.queue_position(seq), degraded=_degraded(seq.degradation)))

    def _template(self, template_id: str | None, request_id: str) -> _Template | None:
        if template_id is None:
            return None
        template = self._templates.get(template_id)
        if template is None:
            raise p.ProtocolError("UNKNOWN_TEMPLATE", f"field 'template_id': no template {template_id!r} is "
                                  "registered", request_id)
        return template

    def _adapter(self, request: p.GenerateRequest, template: _Template | None) -> str | None:
        """The adapter it is served under: its own, else its template's (whose K/V is pinned under it).
        Naming another than the template's would find none of the template's pinned K/V."""
        named = template.adapter if template is not None else None
        if request.adapter is not None and named is not None and request.adapter != named:
            raise p.ProtocolError("ADAPTER_MISMATCH", f"field 'adapter': the request names adapter "
                                  f"{request.adapter!r}, but template {template.template_id!r} is pinned under "
                                  f"adapter {named!r}; name {named!r} or none", request.id)
        adapter = request.adapter or named
        self._check_adapter(adapter, request.id)
        return adapter

    def _check_adapter(self, adapter: str | None, request_id: str) -> None:
        if adapter is not None and adapter not in self.engine.loras.by_name:
            held = ", ".join(self.engine.loras.names()) or "none"
            raise p.ProtocolError("UNKNOWN_ADAPTER", f"field 'adapter': no adapter {adapter!r} is loaded; the "
                                  f"server holds {held} (lora_modules)", request_id)

    def _constraint(self, request: p.GenerateRequest, template: _Template | None) -> CompiledGrammar | None:
        """The request's own constraint, else its template's, compiled now: the request's one compile
        (the engine caches it by its text, and ``add_request`` takes it as it is), so one that cannot
        be is an error reply before the request reaches the engine's queues."""
        from ricllm.structured.spec import StructuredSpec

        if request.structured is not None:
            spec = StructuredSpec.parse(request.structured)  # checked at receipt: cannot fail here
        else:
            spec = template.template.structured if template is not None else None
        return self._compile(spec, request.id) if spec is not None else None

    def _compile(self, spec: StructuredSpec, request_id: str) -> CompiledGrammar:
        try:
            return self.engine.compile_structured(spec)
        except ValueError as exc:  # InvalidRequestError, or the grammar engine's own refusal of the schema
            log.info("structured_refused", id=request_id, kind=spec.kind, key=spec.key, error=str(exc))
            raise p.ProtocolError("VALIDATION", f"field 'structured': {exc}", request_id) from None

    def _prompt_tokens(self, request: p.GenerateRequest, template: _Template | None) -> list[int]:
        """The prompt; with a template its pinned tokens come first, token for token."""
        tokenizer = self.engine.tokenizer
        if request.messages is not None:
            return self._chat_tokens(request, template)
        prefix = template.token_ids if template is not None else []
        if request.prompt is not None:
            return prefix + tokenizer.encode(request.prompt, add_special_tokens=not prefix)
        return prefix + list(request.token_ids)

    def _chat_tokens(self, request: p.GenerateRequest, template: _Template | None) -> list[int]:
        from ricllm.engine.chat_prefix import render_chat_request

        messages = [m.model_dump() for m in request.messages]
        if template is not None and messages[0]["role"] == "system":  # the template's messages come first
            raise p.ProtocolError("VALIDATION", "field 'messages': starts with a system message, but "
                                  "template_id already supplies the conversation's start", request.id)
        try:
            return render_chat_request(self.engine.tokenizer, template.prefix if template else None, messages)
        except Exception as exc:  # no template, or the template's raise_exception
            raise p.ProtocolError("VALIDATION", f"field 'messages': cannot apply the model's chat template: "
                                  f"{exc}", request.id) from None

    def _sampling(self, request: p.GenerateRequest, received: float,
                  constraint: StructuredSpec | None, fallback: Fallback | None) -> SamplingParams:
        """The deadline counts from receipt (the engine is given it as the arrival); one that passed
        before the request reached the engine is refused at once (the intake's check)."""
        from ricllm.sampling_params import SamplingParams, default_priority

        priority = request.priority or default_priority(request.deadline_ms)  # of the deadline as sent
        self.intake.check_deadline(request, received)
        try:
            return SamplingParams(**request.sampling_kwargs(), deadline_ms=request.deadline_ms, priority=priority,
                                  structured=constraint, fallback=fallback)
        except InvalidRequestError as exc:
            raise p.ProtocolError("VALIDATION", str(exc), request.id) from None

    def _add(self, request: p.GenerateRequest, token_ids: list[int], params: SamplingParams,
             internal_id: str, received: float, grammar: CompiledGrammar | None, adapter: str | None) -> Sequence:
        engine = self.engine
        if engine.admission is None:
            self.intake.check_context(len(token_ids), self._planned_tokens(params, grammar), engine.max_model_len)
        try:
            return engine.add_request(token_ids, params, request_id=internal_id, arrival_time=received,
                                      grammar=grammar, lora_request=LoRARequest(adapter) if adapter else None)
        except CapacityError as exc:  # admission off: can never fit the KV budget
            raise Refused("KV_BUDGET", str(exc), prompt_tokens=len(token_ids), max_tokens=params.max_tokens) from None
        except InvalidRequestError as exc:
            source = "token_ids" if request.token_ids is not None else "prompt"
            raise p.ProtocolError("VALIDATION", f"field {source!r}: {exc}", request.id) from None

    @staticmethod
    def _planned_tokens(params: SamplingParams, grammar: CompiledGrammar | None) -> int:
        """``max_tokens``, or the constraint's longest answer when that is shorter (the engine caps it so)."""
        longest = grammar.max_tokens if grammar is not None else None
        return params.max_tokens if longest is None else min(params.max_tokens, longest)

    def _bound_ms(self, pending: _Pending) -> float | None:
        """Admission's bound on this request's finish, from receipt, margin included (promised only)."""
        try:
            finish = self.engine.finish_bound(pending.seq.request_id)
        except Exception:  # an estimate only: never let it fail an admitted request
            log.exception("bound_ms_failed")
            return None
        return None if finish is None else round((finish - pending.command.received) * 1000, 3)

    # -- after a step

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Replies first, woken at once; then the step's token intervals, and each finished request's
        metrics and log event."""
        now = clock()  # the step's end: when its tokens came
        completed = []
        for out in outputs:
            item = self._internal.pop(out.request_id, None)
            if isinstance(item, _Pending):
                completed.append((item, out, self._send_result(item, out)))
            elif isinstance(item, _Template):
                self._pinned(item)
        for pending in self._generates.values():
            if pending.request.stream:
                self._stream(pending, final=False)
        self.outbox.wake()
        for pending in self._generates.values():
            pending.time_tokens(now, pending.seq.num_output_tokens)
        for pending, out, timings in completed:
            pending.time_tokens(now, len(out.token_ids))
            self._account(pending, out, timings)

    def _stream(self, pending: _Pending, final: bool) -> None:
        """A ``token`` per new output token; the text since the last one rides on the newest.

        While running, the last ``holdback`` characters wait (a stop string may be forming), so
        the token texts concatenate to the result's text; to its ``model_text`` where a fallback
        replaced the model's answer (the tokens are the model's).
        """
        seq = pending.seq
        token_ids, text = seq.output_token_ids, seq.model_text if seq.model_text is not None else seq.output_text
        visible = len(text) if final else max(pending.sent_chars, len(text) - pending.holdback)
        for index in range(pending.sent_tokens, len(token_ids)):
            piece = ""
            if index == len(token_ids) - 1:
                piece, pending.sent_chars = text[pending.sent_chars:visible], max(visible, pending.sent_chars)
            pending.command.reply(p.Token(id=pending.request.id, index=index, token_id=token_ids[index], text=piece))
        pending.sent_tokens = len(token_ids)

    def _complete(self, pending: _Pending, out: RequestOutput) -> None:
        """The final ``result`` (after any last tokens), its metrics and its one log event."""
        self._account(pending, out, self._send_result(pending, out))

    def _send_result(self, pending: _Pending, out: RequestOutput) -> p.Timings:
        self._generates.pop(pending.command.key, None)
        self._internal.pop(pending.internal_id, None)
        if pending.request.stream:
            self._stream(pending, final=True)
        timings = _timings(out)
        pending.command.reply(p.Result(
            id=pending.request.id, text=out.text, token_ids=out.token_ids,
            num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=out.num_cached_tokens,
            finish_reason=out.finish_reason, timings=timings, deadline_met=out.deadline_met,
            degraded=_degraded(out.degradation), num_forced_tokens=out.num_forced_tokens,
            confidence=out.confidence, model_text=out.model_text))
        return timings

    def _account(self, pending: _Pending, out: RequestOutput, timings: p.Timings) -> None:
        adapter = pending.seq.adapter.name if pending.seq.adapter is not None else None
        self.metrics.finished(FinishedRequest(pending.deadline_class, out.finish_reason, len(out.prompt_token_ids),
                                              len(out.token_ids), timings, out.deadline_met, adapter))
        structured = pending.seq.params.structured
        log.info("request_done", id=pending.request.id, client=client_name(pending.command.identity),
                 template=pending.request.template_id, adapter=adapter, admitted=True, reason=out.finish_reason,
                 outcome="result",
                 prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                 output_tokens=len(out.token_ids), forced_tokens=out.num_forced_tokens,
                 constraint=structured.kind if structured is not None else None, confidence=out.confidence,
                 **{f"{k[:-2]}_ms": None if v is None else round(v * 1000, 3) for k, v in timings.model_dump().items()},
                 deadline_ms=pending.request.deadline_ms, deadline_met=out.deadline_met)

    # -- cancel and drain

    def _cancel(self, command: Command) -> None:
        request: p.CancelRequest = command.request
        pending = self._generates.get((command.identity, request.target_id))
        if pending is None:
            raise p.ProtocolError("UNKNOWN_REQUEST", f"field 'target_id': no generate request {request.target_id!r} "
                                  "of this client is in flight", request.id)
        self._abort(pending, "cancelled")
        command.reply(p.Cancelled(id=request.id, target_id=request.target_id))

    def _abort(self, pending: _Pending, reason: str) -> None:
        """Finish a running or waiting sequence now."""
        self._complete(pending, self.engine.abort(pending.seq, reason))

    def _enforce_drain_deadline(self) -> None:
        deadline = self.state.drain_deadline
        if deadline is None or clock() < deadline or not self._generates:
            return
        log.warning("drain_timeout", cancelled=len(self._generates))
        for pending in list(self._generates.values()):
            self._abort(pending, "cancelled")

    def _fail_everything(self, message: str) -> None:
        """After an engine fault: an error for each request still waiting for the engine."""
        for pending in list(self._generates.values()):
            self._fail(pending.command, "INTERNAL", message)
        for template in self._templates.values():
            for waiter in template.waiters:
                self._fail(waiter, "INTERNAL", message)
        self._generates.clear()

    # -- templates

    def _register(self, command: Command) -> None:
        """Compile the constraint, render the conversation, pin it: a failure at any step pins nothing."""
        request: p.RegisterTemplateRequest = command.request
        template = request.template()
        template_id = request.template_id or self._new_template_id()
        existing = self._templates.get(template_id)
        if existing is not None:
            self._register_again(command, existing, template)
            return
        self._check_adapter(template.adapter, request.id)
        if template.structured is not None:
            grammar = self._compile(template.structured, request.id)  # its own error reply; the pin finds it compiled
            if template.fallback is not None:
                self._check_fallback(grammar, template.fallback, request.id)
        self._pin(command, template_id, template)

    def _check_fallback(self, grammar: CompiledGrammar, fallback: Fallback, request_id: str) -> None:
        try:
            self.engine.check_fallback(grammar, fallback)
        except InvalidRequestError as exc:
            raise p.ProtocolError("VALIDATION", f"field 'fallback': {exc}", request_id) from None

    def _pin(self, command: Command, template_id: str, template: Template) -> None:
        """Queue the pin; the register request is answered once its prefill has run (``_pinned``)."""
        request: p.RegisterTemplateRequest = command.request
        try:
            registered = self._start_pin(template_id, template)
        except (CapacityError, InvalidRequestError) as exc:  # no room, or the chat template refused it
            raise p.ProtocolError("VALIDATION", f"field {request.conversation_field!r}: {exc}", request.id) from None
        registered.waiters.append(command)

    def _start_pin(self, template_id: str, template: Template) -> _Template:
        """``engine.pin_template`` (under the template's adapter), its record registered under ``template_id``."""
        internal_id = f"template:{next(self._ids)}"
        pinned = self.engine.pin_template(template, request_id=internal_id, wait=False)
        registered = _Template(template_id, template, pinned.prefix, pinned.handle)
        self._templates[template_id] = registered
        self._internal[internal_id] = registered
        return registered

    def _register_again(self, command: Command, registered: _Template, template: Template) -> None:
        """The same id, conversation and constraint again is a no-op (answered once pinned); any
        difference is an error: requests already using the id expect what it holds."""
        request: p.RegisterTemplateRequest = command.request
        if registered.template != template:
            raise p.ProtocolError("VALIDATION", f"field 'template_id': {registered.template_id!r} is registered with "
                                  "another conversation or constraint, or another adapter or fallback; unregister it first",
                                  request.id)
        if registered.pinned:
            command.reply(registered.registered(request.id, self.engine.config.block_size))
        else:
            registered.waiters.append(command)

    def _new_template_id(self) -> str:
        while True:
            template_id = f"t-{next(self._template_ids)}"
            if template_id not in self._templates:
                return template_id

    def _pinned(self, template: _Template) -> None:
        template.pinned = True
        block_size = self.engine.config.block_size
        if self._templates.get(template.template_id) is not template:  # unregistered while it was pinning
            self._unpin(template)
        for waiter in template.waiters:
            waiter.reply(template.registered(waiter.request.id, block_size))
        template.waiters.clear()
        log.info("template_registered", template=template.template_id, tokens=len(template.token_ids),
                 pinned_tokens=template.pinned_tokens(block_size), examples=template.template.num_examples,
                 constraint=template.constraint, adapter=template.adapter)

    def _unpin(self, template: _Template) -> None:
        if self.engine.is_pinned(template.handle):
            self.engine.unpin_prefix(template.handle)

    def _unregister(self, command: Command) -> None:
        request: p.UnregisterTemplateRequest = command.request
        template = self._templates.pop(request.template_id, None)
        if template is None:
            raise p.ProtocolError("UNKNOWN_TEMPLATE", f"field 'template_id': no template {request.template_id!r} "
                                  "is registered", request.id)
        if template.pinned:
            self._unpin(template)
        command.reply(p.TemplateUnregistered(id=request.id, template_id=request.template_id))
        log.info("template_unregistered", template=request.template_id)

    # -- adapters (lora_modules)

    def _serve_adapters(self, wanted: dict[str, str]) -> dict[str, str]:
        """Hold exactly the adapters ``wanted`` (name -> folder), between steps; returns those held now.

        A new name is loaded; a held one is read again, and new content replaces it (requests in
        flight finish on the old content) and re-pins its templates. A name no longer wanted is
        removed, unless a registered template names it (refused: unregister the template first).
        An adapter that cannot be loaded leaves what was held under its name."""
        for name in [n for n in self._adapter_paths if n not in wanted]:
            self._remove_adapter(name)
        for name, path in wanted.items():
            self._load_adapter(name, path)
        self._publish_adapters()
        return dict(self._adapter_paths)

    def _remove_adapter(self, name: str) -> None:
        users = sorted(t.template_id for t in self._templates.values() if t.adapter == name)
        if users:
            log.warning("adapter_remove_refused", adapter=name, templates=users,
                        reason="registered templates name it; unregister them first", kept=self._adapter_paths[name])
            return
        self.engine.loras.remove(name)
        del self._adapter_paths[name]
        log.info("adapter_removed", adapter=name)

    def _load_adapter(self, name: str, path: str) -> None:
        loras = self.engine.loras
        before = loras.by_name.get(name)
        try:
            held = loras.add(name, path)
        except (RicllmError, OSError) as exc:
            log.warning("adapter_load_failed", adapter=name, path=path, error=f"{type(exc).__name__}: {exc}",
                        kept=self._adapter_paths.get(name))
            return
        self._adapter_paths[name] = path
        if before is not None and before.slot.content_hash != held.slot.content_hash:
            self._repin(name)

    def _repin(self, adapter: str) -> None:
        """Pin again the templates pinned under ``adapter``, now under its new content: the K/V of the
        old pin is keyed by the old content's hash, so no request would find it."""
        for old in [t for t in self._templates.values() if t.adapter == adapter]:
            if old.pinned:
                self._unpin(old)
                old.pinned = False
            try:
                new = self._start_pin(old.template_id, old.template)
            except (CapacityError, InvalidRequestError) as exc:  # stays registered; its requests compute its tokens
                log.warning("template_repin_failed", template=old.template_id, adapter=adapter, error=str(exc))
                continue
            new.waiters, old.waiters = old.waiters, []  # an old pin still running is unpinned when it ends
            log.info("template_repinning", template=old.template_id, adapter=adapter)

    def _publish_adapters(self) -> None:
        """For the HTTP thread (``/v1/models``, a request's ``model``): the adapters held now."""
        self.state.publish_adapters(self.engine.loras.stats())

    # -- stats and metrics

    def _stats(self, command: Command) -> None:
        command.reply(p.StatsReply(id=command.request.id, stats=self._server_stats()))

    def _server_stats(self) -> p.ServerStats:
        engine, snap = self.engine, self.engine.snapshot()
        counts = self.metrics.counts()
        block_size = engine.config.block_size
        return p.ServerStats(
            model=self._model_identity(), kv_cache=snap.kv_cache,
            queues=p.QueueStats(inbound=self.state.inbound.qsize(),
                                inbound_capacity=self.state.options.inbound_queue_size,
                                running=snap.running, waiting=snap.waiting, in_flight=len(self._generates)),
            admission=p.AdmissionSummary(policy=snap.policy, counts=counts["admission"],
                                         reserved_blocks=snap.reserved_blocks),
            deadlines=counts["deadlines"], latency_model=snap.latency,
            templates={t.template_id: t.stats(block_size) for t in self._templates.values()},
            draining=self.state.draining.is_set(), adapters=snap.adapters, max_loras=snap.max_loras)

    def _model_identity(self) -> p.ModelIdentity:
        runtime = self.engine.runtime
        layers, head = runtime.weight_formats
        served = self.engine.served_model
        return p.ModelIdentity(name=served.name, path=str(served.path), served_name=served.served_name,
                               dtype=str(runtime.dtype).removeprefix("torch."),
                               weights=p.WeightFormats(layers=layers, head=head),
                               attention_backend=runtime.attention_backend, device=str(runtime.device),
                               threads=runtime.threads, runtime=runtime.name, ricllm=__version__,
                               served_model_name=self.engine.config.served_model_name)

    def _publish(self, force: bool = False) -> None:
        """Hand the metrics collector a fresh snapshot, at most every PUBLISH_EVERY_S."""
        now = clock()
        if not force and now - self._published < PUBLISH_EVERY_S:
            return
        self._published = now
        self.metrics.publish(EngineSnapshot(self.engine.snapshot(), inbound=self.state.inbound.qsize()))


def _timings(out: RequestOutput) -> p.Timings:
    """The engine's times count from its arrival, which is the server's receipt."""
    e2e = out.e2e_s or 0.0
    queue_s = out.queue_s
    return p.Timings(queue_s=e2e if queue_s is None else min(queue_s, e2e), ttft_s=out.ttft_s, e2e_s=e2e,
                     tpot_s=out.tpot_s, predicted_e2e_s=out.predicted_e2e_s, promised_e2e_s=out.promised_e2e_s)



def _fallback(request: p.GenerateRequest, template: _Template | None) -> Fallback | None:
    """The template's fallback, for a request that answers under the template's constraint (one
    with its own constraint is not judged by the template's answer)."""
    if template is None or request.structured is not None:
        return None
    return template.template.fallback


def _degraded(degradation) -> p.Degraded | None:
    if degradation is None:
        return None
    return p.Degraded(code=degradation.code, requested_max_tokens=degradation.requested_max_tokens,
                      granted_max_tokens=degradation.granted_max_tokens, message=degradation.message,
                      numbers=wire_numbers(degradation.numbers))
