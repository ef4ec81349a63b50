"""The engine: load once, accept requests, and advance every running request by one step.

``add_request`` checks a request and queues it; ``step`` is schedule → run → process outputs:
the scheduler picks a batch, the runtime computes it and samples, and the output processor turns
the tokens into text and names the requests that end. Its collaborators own their state:
``RequestChecks`` (what may enter), ``ConstrainedDecoding`` (grammars, masks, forced tokens),
``OutputProcessor`` (text, stop, finish, outputs, the deadline tally) and ``StepRecorder`` (step
timings, the latency model's errors, slowdowns). The offline ``LLM`` API and the servers drive
this same loop.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ricllm.affinity import format_cpu_list, pin_current_thread
from ricllm.cache.kv_cache_manager import KVCacheManager, PinHandle
from ricllm.cache.kv_groups import sliding_windows
from ricllm.config import LIVE_ADMISSION_CONTROLS, EngineConfig
from ricllm.engine.admission import AdmissionController
from ricllm.engine.chat_prefix import PinnedTemplate, render_chat_prefix
from ricllm.engine.collector import freeze_heap
from ricllm.engine.constrained import ConstrainedDecoding, computed_head_rows
from ricllm.engine.lora_registry import LoraRegistry
from ricllm.engine.output_processor import OutputProcessor
from ricllm.engine.request_checks import RequestChecks
from ricllm.engine.runtime.choice import build_runtime
from ricllm.engine.runtime.interface import KVStore, Runtime
from ricllm.engine.scheduler import ScheduledBatch, Scheduler
from ricllm.engine.stats import EngineStats, KVCacheStats, LatencyStats
from ricllm.engine.step_recorder import StepRecorder
from ricllm.errors import CapacityError, InvalidRequestError
from ricllm.logging import get_logger
from ricllm.lora_request import AdapterSlot, LoRARequest
from ricllm.model.identity import ServedModel
from ricllm.model.loader import resolve_model_path
from ricllm.outputs import RequestOutput
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence
from ricllm.template import Template
from ricllm.units import format_bytes

if TYPE_CHECKING:  # llguidance is imported with the first constraint, not with the engine
    from ricllm.structured.compiler import CompiledGrammar
    from ricllm.structured.fallback import Fallback
    from ricllm.structured.spec import StructuredSpec

log = get_logger("ricllm.engine")


class LLMEngine:
    """``spec``, ``tokenizer`` and ``kv_cache`` are the runtime's, named here because requests,
    pins and stats read them so often; ``step_history`` is the step recorder's history."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.perf_counter, latency_model=None):
        self.clock = clock  # the one clock: it stamps every request and times every step
        started = clock()
        self.config = config
        self._built_on = self._stepping_on = threading.get_ident()
        if config.engine_cpus:  # before the runtime starts any OpenMP worker: they inherit it
            pin_current_thread(config.engine_cpus)
        self.model_path = resolve_model_path(config.model)
        # the model, its KV store and how it runs; its load_s is the weights alone (startup_s adds calibration)
        self.runtime = build_runtime(config, self.model_path)
        self.spec, self.tokenizer, self.kv_cache = self.runtime.spec, self.runtime.tokenizer, self.runtime.kv_cache
        self.served_model = ServedModel.of(self.model_path, self.spec.name, config.served_model_name)
        self.loras = LoraRegistry(self.runtime.lora, self.spec, self.served_model.served_name)  # the adapters, by name
        self.max_model_len = min(self.spec.max_position_embeddings, config.max_model_len or 1 << 62)
        num_blocks = self.kv_cache.geometry.num_blocks
        self.cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                    sliding_windows(self.kv_cache.geometry.groups))
        self.checks = RequestChecks(config, self.spec.vocab_size, self.max_model_len, num_blocks, self.cache)
        self.constraints = ConstrainedDecoding(self.tokenizer, self.runtime, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.constraints)
        self.steps = StepRecorder(clock, self.runtime, self.cache)
        self.step_history = self.steps.history
        self._ids, self._pin_ids = itertools.count(), itertools.count(1)
        self._seeds = random.Random(config.seed)  # unseeded sampled requests draw their seeds from it
        self.admission: AdmissionController | None = None
        self.caps: list[dict] | None = None  # the tightest deadline class's largest batches (admission on)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   jump_forward=config.jump_forward,
                                   order="fcfs" if config.admission.policy == "fcfs" else "edf")
        if config.admission.policy != "off":
            self.admission = self.scheduler.gate = _build_admission(self, latency_model)  # may calibrate: runs steps
            self.steps.latency = self.loras.latency = self.admission.latency
            self.caps = self.admission.caps(config.admission.tightest_deadline_ms,
                                            config.admission.tightest_deadline_tokens)
            log.info("admission_caps", deadline_ms=config.admission.tightest_deadline_ms,
                     tokens=config.admission.tightest_deadline_tokens, caps=self.caps)
        freeze_heap()
        self.steps.last_end = self.clock()  # the build has just run or loaded the model: no idle gap yet
        self.startup_s = self.clock() - started
        _log_start(self.runtime, config, self.max_model_len, self.startup_s)

    # ------------------------------------------------------------ requests

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      adapter: AdapterSlot | None = None) -> None:
        """Raise for a prompt that is malformed or can never fit the context or the budget (beside
        the pinned prefixes it would share under ``adapter``)."""
        self.checks.well_formed(prompt_token_ids)
        self.checks.fits(prompt_token_ids, params, adapter)

    def validate(self, token_ids: list[int], params: SamplingParams, adapter: AdapterSlot | None = None) -> None:
        """Raise for malformed input; without admission also for what can never fit (with
        admission that is a refusal, decided at arrival)."""
        self.checks.well_formed(token_ids)
        if self.admission is None:
            self.checks.fits(token_ids, params, adapter)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    pin_on_finish: PinHandle | None = None, arrival_time: float | None = None,
                    grammar: CompiledGrammar | None = None, lora_request: LoRARequest | None = None) -> Sequence:
        """Check and queue a request; returns at once. Malformed input raises.

        Without admission a request that can never fit raises ``CapacityError``. With admission
        every well-formed request gets a decision now: a refused one comes back finished with
        ``finish_reason == "rejected"`` and ``rejection`` set (its output is also returned by the
        next ``step``). ``arrival_time`` (engine clock) is when the request reached the API, if
        earlier than now (it waited in a queue to the engine's thread): its deadline and timings
        count from then. ``grammar`` is its constraint as ``compile_structured`` gave it, for a
        caller that compiled it already. ``lora_request`` names the adapter it is served under
        (``LoraRegistry.resolve``: an unknown name raises ``UnknownAdapterError``).
        """
        adapter = self.loras.resolve(lora_request)
        text, token_ids = self.encode_prompt(prompt)
        grammar = self.constraints.grammar_of(params, grammar)
        now = self.clock()
        arrival = now if arrival_time is None else min(arrival_time, now)
        kv_window, *group_windows = self.checks.kv_windows_of(params, pinning=pin_on_finish is not None)
        seq = Sequence(request_id=request_id or str(next(self._ids)), token_ids=list(token_ids),
                       num_prompt_tokens=len(token_ids), params=params, prompt=text, arrival_time=arrival,
                       pin_on_finish=pin_on_finish, adapter=adapter, kv_window=kv_window,
                       group_windows=tuple(group_windows))
        rejection = self.constraints.start(seq, grammar) if grammar is not None else None
        if rejection is not None:
            self.outputs.refuse(seq, rejection, now)
            return seq
        self.validate(token_ids, seq.params, adapter)
        if params.deadline_ms is not None:
            seq.deadline = arrival + params.deadline_ms / 1000
        self.constraints.force_start(seq)
        if self.admission is not None and not self._admit(seq, now):
            return seq
        self.outputs.start(seq)
        if not params.greedy:
            seed = params.seed
            if seed is None:
                seed = self.config.seed * 1_000_003 + self._seeds.randrange(2**31)
            seq.generator = self.runtime.new_generator(seed)
        self.loras.hold(adapter)
        self.scheduler.add(seq)
        return seq

    def _admit(self, seq: Sequence, now: float) -> bool:
        """Ask admission; a refused request is finished as rejected (False)."""
        pinned_blocks, pinned_hits, hits = self.checks.prefix_share(seq.token_ids, seq.adapter, seq.group_windows)
        rejection = self.admission.decide(seq, now, pinned_blocks, pinned_hits, self.scheduler.waiting,
                                          after_idle=self.steps.idle_at(now), cached_hits=len(hits))
        if rejection is None and seq.promised and len(self.admission.admitted) > self.config.max_num_seqs:
            self.admission.release(seq)
            rejection = self.admission.reject(
                "QUEUE_FULL", f"{self.config.max_num_seqs} deadline requests already hold every seat of the "
                f"batch (max_num_seqs)", max_num_seqs=self.config.max_num_seqs)
        if rejection is not None:
            self.outputs.refuse(seq, rejection, now)
            if rejection.code == "DEADLINE_INFEASIBLE" and not self.scheduler.has_unfinished():
                self.steps.probe(now)
            return False
        if seq.promised and hits:
            seq.take_blocks(self.cache.hold_prefix(seq, hits))  # its bound credited them: no eviction may take them now
        if seq.degradation is not None:
            d = seq.degradation
            log.info("request_degraded", request_id=seq.request_id, code=d.code,
                     requested_max_tokens=d.requested_max_tokens, granted_max_tokens=d.granted_max_tokens)
        return True

    def compile_structured(self, spec: StructuredSpec | Mapping[str, Any]) -> CompiledGrammar:
        """Compile a constraint once (cached by its text); ``InvalidRequestError`` if it cannot be.
        A caller that compiles a request's constraint first (to answer its error itself) passes
        the result to ``add_request`` as ``grammar``; templates compile theirs when pinned."""
        return self.constraints.compile(spec)

    def check_fallback(self, grammar: CompiledGrammar, fallback: Fallback) -> None:
        """``InvalidRequestError`` naming the problem unless ``fallback``'s answer is a whole answer
        of the compiled constraint (a template's is checked when it is pinned, a request's on arrival)."""
        self.constraints.check_fallback(grammar, fallback)

    # ------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.outputs.refused)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that finished (rejected ones included).

        The step's measured time, which the latency model learns from, runs from entry to return:
        scheduling, sampling and finishing requests are part of every step's cost (about 0.4 ms
        of a 10 ms decode step on 2 cores), and a bound that left them out would drift past it.
        A step that computes prefixes to pin and nothing else is recorded as an idle engine's, as a
        probe is (``StepRecorder.record``): no request waits on it (it runs at start, or when a
        template is added to an idle engine), so it is no step of a busy engine, whose multipliers
        the bounds of busy steps charge.
        """
        if threading.get_ident() != self._stepping_on:
            self._stepping_on = _stepping_thread_changed(self._built_on)
        entered = self.clock()
        batch, finished = self._schedule(entered)
        if not batch:
            return finished
        features, after_idle = batch.features(), self.steps.idle_at(entered) or batch.pins_only
        ready, tokens, head_rows = self._run(batch)
        now = self.clock()
        finished += [self._end(seq, reason, now) for seq, reason in self.outputs.append(ready, tokens, now)]
        self.steps.record(replace(features, head_rows=head_rows), self.clock() - entered, after_idle,
                          work_left=self.scheduler.has_unfinished())
        return finished

    def _schedule(self, now: float) -> tuple[ScheduledBatch, list[RequestOutput]]:
        """The step's batch, and the requests that end before it: refused at arrival, or late under
        ``on_late`` (abort: past their deadline; end_early: past it by this step's end, as measured now)."""
        ended = self.outputs.take_refused()
        on_late = self.admission.config.on_late if self.admission is not None else "finish"
        if on_late != "finish":
            unfinished = self.scheduler.running + self.scheduler.waiting
            ended += [self._end(s, "deadline", now) for s in unfinished if s.deadline is not None and now > s.deadline]
        batch = self.scheduler.schedule(now)
        if on_late == "end_early" and batch:
            step_end = now + self.admission.latency.predict(batch.features())
            late = [s for s, _ in batch.items if s.deadline is not None and step_end > s.deadline]
            ended += [self._end(s, "deadline", now) for s in late]
            batch = ScheduledBatch([(s, n) for s, n in batch.items if not s.is_finished])
        if not batch and self.scheduler.has_unfinished() and not ended:
            raise RuntimeError("scheduler could not schedule any request: this is a bug in ricllm")
        return batch, ended

    def _run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], float]:
        """Compute the batch's tokens once; sample a token for each request now wholly computed.
        Also returns the rows the head computed, each by its share of the vocabulary
        (``StepFeatures.head_rows``: the k-wide constrained head computes less than a row)."""
        started = self.clock()
        for seq, _ in batch.items:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        ready = [seq for seq, num_new in batch.items if seq.num_computed_tokens + num_new == seq.num_tokens]
        allowed = self.constraints.allowed(ready)  # None: no row is constrained, the whole head for all
        logits, _ = self.runtime.runner.run(batch) if allowed is None else self.runtime.runner.run(batch, allowed)
        cached = 0
        for seq, num_new in batch.items:
            seq.num_computed_tokens += num_new
            full = self.cache.cache_full_blocks(seq)
            seq.block_hashes += full
            cached += len(full)
            seq.evict_blocks(self.cache.evict_outside_window(seq))
            seq.evict_group_blocks(self.cache.evict_outside_group_windows(seq))
        if cached:  # waiting promises take at once the blocks that continue their prefix
            self.scheduler.take_prefixes_cached_since()
        return ready, self.constraints.sample(logits, ready), computed_head_rows(logits, len(ready))

    def _end(self, seq: Sequence, reason: str, now: float, aborted: bool = False) -> RequestOutput:
        """End a request: its blocks freed (a pin's prompt blocks kept), its reservation released."""
        seq.finish_time = now
        self.scheduler.finish(seq, reason)
        self.loras.release(seq.adapter)
        if self.admission is not None:
            self.admission.release(seq)
        return self.outputs.finish(seq, aborted)

    def queue_position(self, seq: Sequence) -> int | None:
        """Where ``seq`` waits (0: next to be seated), or None when it is not waiting."""
        return next((i for i, s in enumerate(self.scheduler.waiting) if s is seq), None)

    def abort_all(self, reason: str = "cancelled") -> int:
        """End every unfinished request now (``abort`` each); how many there were."""
        unfinished = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in unfinished:
            self.abort(seq, reason)
        return len(unfinished)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> RequestOutput:
        """End a waiting or running request now (cancel, shutdown); returns its output so far.

        Its blocks and its admission reservation are released; it counts neither as a met nor
        as a missed deadline, since it was not left to finish.
        """
        return self._end(seq, reason, self.clock(), aborted=True)

    # ------------------------------------------------------------ pinned prefixes (templates)

    def pin_template(self, template: Template | list[dict[str, str]], request_id: str | None = None,
                     wait: bool = True) -> PinnedTemplate:
        """Pin a template's conversation (a ``Template``, or chat messages) as its chat requests
        start with it: its constraint compiled first (so its requests find it compiled; a
        constraint that cannot be, or a fallback that does not satisfy it, pins nothing), the conversation rendered (``ChatPrefix``), then
        pinned. With ``wait`` the engine steps until its K/V is computed (before any request: the
        outputs of other requests those steps finish are not returned); otherwise the caller
        steps and sees the pinning request's output. A chat template that refuses the
        conversation raises ``InvalidRequestError``; no room, ``CapacityError`` (``pin_prefix``).
        A template that names an ``adapter`` is pinned under it: its K/V is that adapter's."""
        lora_request = None
        if isinstance(template, Template):
            if template.structured is not None:
                grammar = self.compile_structured(template.structured)
                if template.fallback is not None:
                    self.check_fallback(grammar, template.fallback)
            lora_request = LoRARequest(template.adapter) if template.adapter is not None else None
            template = template.message_list
        try:
            prefix = render_chat_prefix(self.tokenizer, template)
        except Exception as exc:  # the chat template's raise_exception
            raise InvalidRequestError(f"cannot apply the model's chat template: {exc}") from None
        handle, seq = self.pin_prefix(prefix.token_ids, request_id, lora_request)
        while wait and not seq.is_finished:
            self.step()
        return PinnedTemplate(prefix, handle, seq, self.config.block_size)

    def pin_prefix(self, token_ids: list[int], request_id: str | None = None,
                   lora_request: LoRARequest | None = None) -> tuple[PinHandle, Sequence]:
        """Queue the computation of a prefix's K/V; its full blocks stay pinned once ``seq`` finishes.

        The one rule for room (``RequestChecks.pin_fits``): pins may not take blocks that admitted
        requests reserved, nor the last free block. Raises ``CapacityError`` when it does not fit, or
        when admission refuses the pinning request now; the caller steps the engine until ``seq`` is done.
        """
        self.checks.pin_fits(token_ids, self.admission.reserved_blocks if self.admission is not None else 0)
        handle = PinHandle(handle_id=next(self._pin_ids), token_ids=list(token_ids))
        seq = self.add_request(token_ids, SamplingParams(max_tokens=1, ignore_eos=True), request_id=request_id,
                               pin_on_finish=handle, lora_request=lora_request)
        if seq.rejection is not None:
            raise CapacityError(f"cannot pin {len(token_ids)} tokens now: {seq.rejection}")
        return handle, seq

    def is_pinned(self, handle: PinHandle) -> bool:
        """Whether ``handle``'s prefix is still pinned (not yet unpinned)."""
        return handle.handle_id in self.cache.pins

    def unpin_prefix(self, handle: PinHandle) -> None:
        if handle.handle_id not in self.cache.pins:
            raise InvalidRequestError(f"prefix handle {handle.handle_id} is not pinned")
        self.cache.unpin(handle)

    # ------------------------------------------------------------ live controls

    def set_admission_controls(self, **changes: Any) -> None:
        """Change admission controls while serving (``LIVE_ADMISSION_CONTROLS``: each is read afresh at
        every decision or step), between steps, on the thread that steps. Values are the caller's to
        validate (the settings model). The tightest class's caps follow a new safety margin; requests
        already admitted keep their promise, later decisions use the new values."""
        unknown = set(changes) - set(LIVE_ADMISSION_CONTROLS)
        if unknown:
            raise ValueError(f"admission controls {sorted(unknown)} are fixed at start")
        self.config.admission = self.config.admission.model_copy(update=changes)
        if self.admission is None:  # policy off: nothing decides with them
            return
        self.admission.config = self.config.admission
        if "safety_margin" in changes:
            tightest = self.config.admission
            self.caps = self.admission.caps(tightest.tightest_deadline_ms, tightest.tightest_deadline_tokens)

    # ------------------------------------------------------------ what the engine promises and holds

    def finish_bound(self, request_id: str) -> float | None:
        """Admission's bound on an admitted request's finish (engine clock, safety margin included);
        None for a request without a promise. The same bound admission checked the request against."""
        seq = self.admission.admitted.get(request_id) if self.admission is not None else None
        if seq is None:
            return None
        running_best_effort = [s for s in self.scheduler.running if not s.promised]
        return self.admission.finish_bound(seq, self.clock(), running_best_effort)

    def snapshot(self) -> EngineStats:
        """The engine's numbers now: the one place they are gathered (:mod:`ricllm.engine.stats`)."""
        admission = self.admission.stats() if self.admission is not None else None
        latency = None
        if self.admission is not None:
            model = self.admission.latency
            errors, multipliers = model.error_summary(), model.multipliers
            latency = LatencyStats(errors["steps"], errors["median_abs_error"], errors["p95_abs_error"],
                                   correction=max(multipliers.values()), decode_multiplier=multipliers["decode"],
                                   prefill_multiplier=multipliers["prefill"],
                                   after_idle_multiplier=model.after_idle_multiplier)
        counts, scheduler, tally = admission or {}, self.scheduler, self.outputs.deadline_counts
        return EngineStats(
            kv_cache=_kv_cache_stats(self.kv_cache, self.cache, scheduler), running=len(scheduler.running),
            waiting=len(scheduler.waiting), policy=self.config.admission.policy,
            reserved_blocks=self.admission.reserved_blocks if self.admission is not None else 0,
            admitted=counts.get("admitted", 0),
            rejected=counts.get("rejected", {}), degraded=counts.get("degraded", 0),
            deadlines_met=tally["met"], deadlines_missed=tally["missed"],
            deadlines_ended_early=tally["ended_early"], slack_ms=tuple(self.outputs.slack_ms),
            best_effort_paused_steps=scheduler.num_paused_steps,
            rescue_prefill_steps=scheduler.num_rescue_prefill_steps, slowdowns=tuple(self.steps.slowdowns),
            caps=self.caps, admission=admission, latency=latency, steps=self.steps.num_steps,
            adapters=self.loras.stats(), max_loras=self.loras.capacity)


def _kv_cache_stats(kv_cache: KVStore, cache: KVCacheManager, scheduler: Scheduler) -> KVCacheStats:
    g, pool = kv_cache.geometry, cache.pool
    return KVCacheStats(
        num_blocks=g.num_blocks, block_size=g.block_size, bytes_per_block=g.bytes_per_block,
        budget_bytes=g.budget_bytes, allocated_bytes=kv_cache.total_bytes(),
        used_blocks=pool.num_used, free_blocks=pool.num_free, cached_free_blocks=pool.num_cached_free,
        pinned_blocks=cache.num_pinned_blocks, peak_used_blocks=cache.peak_used_blocks,
        prefix_cache_queries_tokens=cache.prefix_queries_tokens,
        prefix_cache_hits_tokens=cache.prefix_hits_tokens,
        preemptions=scheduler.num_preemptions, waits=scheduler.num_waits,
        kv_cache_dtype=g.kv_format.name, group_windows=tuple(group.window for group in g.groups),
        group_used_blocks=cache.held_blocks_by_group(scheduler.running) if g.groups else ())


def _build_admission(engine: LLMEngine, latency_model) -> AdmissionController:
    """Admission, with the latency model given, or loaded from the cache, or calibrated now (which
    steps ``engine``: the engine exists before admission does)."""
    from ricllm.engine.calibration import load_or_calibrate

    latency = latency_model or load_or_calibrate(engine)
    latency.clock = engine.clock  # its recent errors age on the clock the engine's steps are timed with
    latency.kernel_limits = engine.runtime.capabilities.kernel_limits  # which steps pass them is the runtime's
    config = engine.config
    return AdmissionController(config.admission, latency, engine.kv_cache.geometry.num_blocks, config.block_size,
                               config.max_num_batched_tokens, engine.max_model_len, engine.cache.group_windows)


def _stepping_thread_changed(built_on: int) -> int:
    """Warn when steps run on a thread other than the engine's building one while that one lives:
    two OpenMP pools on few cores make every step slow (``async_engine``). The new stepping thread."""
    stepping_on = threading.get_ident()
    if any(t.ident == built_on for t in threading.enumerate()):
        log.warning("engine_stepped_off_its_build_thread", built_on=built_on, stepping_on=stepping_on,
                    why="two OpenMP worker pools: each parallel region sleeps and wakes its workers, "
                        "steps run up to 3x slower on few cores",
                    fix="build the engine on the thread that steps it: EngineThread(EngineConfig(...))")
    return stepping_on


def _log_start(runtime: Runtime, config: EngineConfig, max_model_len: int, startup_s: float) -> None:
    kv_cache, spec = runtime.kv_cache, runtime.spec
    g = kv_cache.geometry
    log.info(
        "kv_cache_allocated",
        equation="M_KV = sum_g 2*L_g*n_g*n_kv*(d_h*b+s)*B" if g.groups else "M_KV = 2*L*n*n_kv*(d_h*b+s)*B",
        groups=[(len(group.layers), group.window) for group in g.groups] or None,
        layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        dtype=str(runtime.dtype).removeprefix("torch."), kv_cache_dtype=g.kv_format.name,
        scale_bytes_per_row=g.kv_format.scale_bytes,
        bytes_per_token=g.bytes_per_block // g.block_size, block_size=g.block_size, bytes_per_block=g.bytes_per_block,
        num_blocks=g.num_blocks, num_tokens=g.num_tokens, budget=format_bytes(g.budget_bytes),
        allocated=format_bytes(kv_cache.total_bytes()), max_model_len=max_model_len,
        max_concurrency_at_max_len=round(g.num_tokens / max_model_len, 2),
    )
    log.info("engine_ready", model=spec.name, runtime=runtime.name, runtime_why=runtime.why,
             device=str(runtime.device), threads=runtime.threads,
             engine_cpus=format_cpu_list(config.engine_cpus) if config.engine_cpus else None,
             weights=f"layers {runtime.weight_formats[0]}, head {runtime.weight_formats[1]}",
             cpu_kernels=_cpu_kernel_family() if runtime.runs_ricllm_kernels else None,
             weights_from=runtime.weights_source, attention_backend=runtime.attention_backend,
             startup_s=round(startup_s, 2))


def _cpu_kernel_family() -> str:
    from ricllm.kernels.cpu_library import kernel_family

    return kernel_family()
