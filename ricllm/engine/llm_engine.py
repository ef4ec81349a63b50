"""The engine: load once, accept requests, and advance every running request by one step.

``add_request`` checks a request and queues it; ``step`` schedules a batch, runs the model once,
samples, and returns the requests that finished. The offline ``LLM`` API and the servers drive
this same loop.
"""

from __future__ import annotations

import gc
import itertools
import math
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

from ricllm.affinity import format_cpu_list, pin_current_thread
from ricllm.cache.kv_cache_manager import KVCacheManager, PinHandle
from ricllm.config import LIVE_ADMISSION_CONTROLS, EngineConfig
from ricllm.engine.admission import AdmissionController
from ricllm.engine.chat_prefix import ChatPrefix, render_chat_prefix
from ricllm.engine.runtime.choice import build_runtime
from ricllm.engine.runtime.interface import KVStore
from ricllm.engine.scheduler import ScheduledBatch, Scheduler, StepFeatures
from ricllm.engine.slowdown import SlowdownDetector
from ricllm.engine.stats import EngineStats, KVCacheStats, LatencyStats, SlowdownEvent
from ricllm.engine.step_errors import IDLE_GAP_S
from ricllm.errors import CapacityError, InvalidRequestError
from ricllm.kv_window import KVWindow, most_blocks, pinned_blocks_held, window_of
from ricllm.logging import get_logger
from ricllm.model.loader import resolve_model_path
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ricllm.outputs import Rejection, RequestOutput
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence, SequenceStatus
from ricllm.structured.spec import StructuredSpec
from ricllm.units import format_bytes

log = get_logger("ricllm.engine")
PROBE_INTERVAL_S = 0.05  # an idle engine that refuses for time measures a probe step at most this often


@dataclass(frozen=True)
class StepRecord:
    """One executed step: what it carried and how long it took (for the latency model)."""

    features: StepFeatures
    duration_s: float


def _cpu_kernel_family() -> str:
    from ricllm.kernels.cpu_library import kernel_family

    return kernel_family()


def _freeze_heap() -> None:
    """Keep the objects alive now (the model, the tokenizer, every import) out of Python's cyclic
    garbage collector: a full collection walks every tracked object, and one that fires between two
    steps stalls the engine for all of it (93 ms measured in bench_admission, past a 100 ms
    deadline that the bound had kept). Collected first, so no garbage is frozen with them."""
    gc.collect()
    gc.freeze()


def _checkable_after(params: SamplingParams) -> bool:
    """Whether a constrained row may draw first and be checked after (no top-k, no top-p filter)."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)


class LLMEngine:
    def __init__(self, config: EngineConfig, clock=time.perf_counter, latency_model=None):
        self.clock = clock  # the one clock: it stamps every request and times every step
        started = clock()
        self.config = config
        self._built_on = self._stepping_on = threading.get_ident()
        if config.engine_cpus:  # before the runtime starts any OpenMP worker: they inherit it
            pin_current_thread(config.engine_cpus)
        self.model_path = resolve_model_path(config.model)
        # the model, its KV store and how it runs; its load_s is the weights alone (startup_s adds calibration)
        self.runtime = build_runtime(config, self.model_path)
        self.max_model_len = min(self.spec.max_position_embeddings, config.max_model_len or 1 << 62)
        geometry = self.kv_cache.geometry
        self.cache = KVCacheManager(geometry.num_blocks, config.block_size, config.enable_prefix_caching)
        self._ids = itertools.count()
        self._pin_ids = itertools.count(1)
        self._seeds = random.Random(config.seed)  # unseeded sampled requests draw their seeds from it
        self.step_history: deque[StepRecord] = deque(maxlen=4096)
        self.num_steps = 0
        self.deadline_counts = {"met": 0, "missed": 0, "ended_early": 0}  # ended_early: by on_late
        self.slack_ms: deque[float] = deque(maxlen=4096)  # deadline − finish, of finished deadline requests
        self._rejected: list[RequestOutput] = []
        self._grammars = None  # a GrammarCompiler, built with the first constraint
        self._last_probe = -math.inf  # engine-clock time of the last latency probe
        self._last_step_end = -math.inf  # engine-clock time the last step (probes included) ended
        self.slowdown_detector = SlowdownDetector()  # is the typical step slower than it has lately been?
        self.slowdown_events: list[SlowdownEvent] = []  # when the detector said slow / back to speed
        self.admission = None
        self.caps: list[dict] | None = None  # the tightest deadline class's largest batches (admission on)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   jump_forward=config.jump_forward,
                                   order="fcfs" if config.admission.policy == "fcfs" else "edf")
        if config.admission.policy != "off":
            self.admission = self._build_admission(latency_model)  # may calibrate: runs real steps first
            self.scheduler.gate = self.admission
            tightest = config.admission
            self.caps = self.admission.caps(tightest.tightest_deadline_ms, tightest.tightest_deadline_tokens)
            log.info("admission_caps", deadline_ms=tightest.tightest_deadline_ms,
                     tokens=tightest.tightest_deadline_tokens, caps=self.caps)
        _freeze_heap()
        self._last_step_end = self.clock()  # the build has just run or loaded the model: no idle gap yet
        self.startup_s = self.clock() - started
        self._log_start()

    # the runtime's, read so often (requests, pins, stats) that they are named here too
    @property
    def spec(self) -> ModelSpec:
        return self.runtime.spec

    @property
    def tokenizer(self) -> Tokenizer:
        return self.runtime.tokenizer

    @property
    def kv_cache(self) -> KVStore:
        return self.runtime.kv_cache

    def _build_admission(self, latency_model) -> AdmissionController:
        from ricllm.engine.calibration import load_or_calibrate

        latency = latency_model or load_or_calibrate(self)
        latency.clock = self.clock  # its recent errors age on the clock the engine's steps are timed with
        return AdmissionController(self.config.admission, latency, self.kv_cache.geometry.num_blocks,
                                   self.config.block_size,
                                   self.config.max_num_batched_tokens, self.max_model_len)

    def _log_start(self) -> None:
        g, spec = self.kv_cache.geometry, self.spec
        per_token = g.bytes_per_block // g.block_size
        log.info(
            "kv_cache_allocated",
            equation="M_KV = 2*L*n*n_kv*(d_h*b+s)*B",
            layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            dtype=str(self.runtime.dtype).removeprefix("torch."), kv_cache_dtype=g.kv_format.name,
            scale_bytes_per_row=g.kv_format.scale_bytes,
            bytes_per_token=per_token, block_size=g.block_size, bytes_per_block=g.bytes_per_block,
            num_blocks=g.num_blocks, num_tokens=g.num_tokens, budget=format_bytes(g.budget_bytes),
            allocated=format_bytes(self.kv_cache.total_bytes()), max_model_len=self.max_model_len,
            max_concurrency_at_max_len=round(g.num_tokens / self.max_model_len, 2),
        )
        log.info("engine_ready", model=self.spec.name, runtime=self.runtime.name, runtime_why=self.runtime.why,
                 device=str(self.runtime.device), threads=self.runtime.threads,
                 engine_cpus=format_cpu_list(self.config.engine_cpus) if self.config.engine_cpus else None,
                 weights=f"layers {self.runtime.weight_formats[0]}, head {self.runtime.weight_formats[1]}",
                 cpu_kernels=_cpu_kernel_family() if str(self.runtime.device) == "cpu" else None,
                 weights_from=self.runtime.weights_source, attention_backend=self.runtime.attention_backend,
                 startup_s=round(self.startup_s, 2))

    # ------------------------------------------------------------ requests

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise for a prompt that is malformed or can never fit the context or the budget."""
        self._check_well_formed(prompt_token_ids)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise CapacityError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens")
        self._check_fits_budget(prompt_token_ids, total, self.kv_window_of(params))

    def kv_window_of(self, params: SamplingParams) -> KVWindow | None:
        """The request's sink + window retention: its own, else the engine's (None: exact)."""
        window = self.config.kv_window if params.kv_window is None else params.kv_window
        sinks = self.config.kv_sinks if params.kv_sinks is None else params.kv_sinks
        return window_of(sinks, window)

    def _prefix_share(self, token_ids: list[int]) -> tuple[int, int, list]:
        """(blocks pinned in all, leading cached blocks of ``token_ids`` that are pinned, every
        leading cached block: pinned or not)."""
        pinned_ids = {b for pin in self.cache.pins.values() for b in pin.block_ids}
        hits = self.cache.find_cached_prefix(token_ids)
        return len(pinned_ids), sum(1 for b in hits if b.block_id in pinned_ids), hits

    def _check_fits_budget(self, prompt_token_ids: list[int], total_tokens: int, kv_window: KVWindow | None) -> None:
        pinned, shared, _ = self._prefix_share(prompt_token_ids)
        needed = most_blocks(total_tokens, kv_window, self.config.block_size, self.config.max_num_batched_tokens)
        needed -= pinned_blocks_held(shared, kv_window, self.config.block_size)
        available = self.kv_cache.geometry.num_blocks - pinned
        if needed > available:
            bs = self.config.block_size
            raise CapacityError(
                f"request needs {needed} KV blocks ({total_tokens} tokens: prompt + max_tokens, "
                f"{bs} tokens per block) but the KV budget of {format_bytes(self.config.kv_cache_budget)} "
                f"holds {available} blocks ({available * bs} tokens)"
                + (f" besides {pinned} pinned blocks" if pinned else ""))

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    pin_on_finish: PinHandle | None = None, arrival_time: float | None = None) -> Sequence:
        """Check and queue a request; returns at once. Malformed input raises.

        Without admission a request that can never fit raises ``CapacityError``. With admission
        every well-formed request gets a decision now: a refused one comes back finished with
        ``finish_reason == "rejected"`` and ``rejection`` set (its output is also returned by the
        next ``step``). ``arrival_time`` (engine clock) is when the request reached the API, if
        earlier than now (it waited in a queue to the engine's thread): its deadline and timings
        count from then.
        """
        text, token_ids = self.encode_prompt(prompt)
        guide = self._guide(params)
        now = self.clock()
        arrival = now if arrival_time is None else min(arrival_time, now)
        seq = Sequence(request_id=request_id or str(next(self._ids)), token_ids=list(token_ids),
                       num_prompt_tokens=len(token_ids), params=params, prompt=text,
                       pin_on_finish=pin_on_finish, arrival_time=arrival, guide=guide,
                       kv_window=None if pin_on_finish is not None else self.kv_window_of(params))
        if guide is not None and self._bound_by_grammar(seq, now) is not None:
            return seq
        self.validate(token_ids, seq.params)
        if params.deadline_ms is not None:
            seq.deadline = arrival + params.deadline_ms / 1000
        if guide is not None:
            self._append_forced(seq, guide.forced_tokens(), at_arrival=True)
        if self.admission is not None and self._admit(seq, now) is not None:
            return seq
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        for token in seq.output_token_ids:  # the answer's forced start
            seq.detokenizer.add(token)
        seq.output_text = seq.detokenizer.text
        if not params.greedy:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + self._seeds.randrange(2**31)
            seq.generator = self.runtime.new_generator(seed)
        self.scheduler.add(seq)
        return seq

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise for malformed input; without admission also for what can never fit."""
        if self.admission is None:
            self.check_request(token_ids, params)
        else:
            self._check_well_formed(token_ids)

    def _admit(self, seq: Sequence, now: float):
        """Ask admission; on refusal finish the sequence as rejected and return the rejection."""
        pinned_blocks, pinned_hits, hits = self._prefix_share(seq.token_ids)
        rejection = self.admission.decide(seq, now, pinned_blocks, pinned_hits, self.scheduler.waiting,
                                          after_idle=self._idle_at(now), cached_hits=len(hits))
        if rejection is None and seq.promised and len(self.admission.admitted) > self.config.max_num_seqs:
            self.admission.release(seq)
            rejection = self.admission.reject(
                "QUEUE_FULL", f"{self.config.max_num_seqs} deadline requests already hold every seat of the "
                f"batch (max_num_seqs)", max_num_seqs=self.config.max_num_seqs)
        if rejection is not None:
            self._refuse(seq, rejection, now)
            if rejection.code == "DEADLINE_INFEASIBLE" and not self.scheduler.has_unfinished():
                self._probe(now)
            return rejection
        if seq.promised and hits:
            self.cache.hold_prefix(seq, hits)  # its bound credited them: no eviction may take them now
        if seq.degradation is not None:
            d = seq.degradation
            log.info("request_degraded", request_id=seq.request_id, code=d.code,
                     requested_max_tokens=d.requested_max_tokens, granted_max_tokens=d.granted_max_tokens)
        return None

    def _idle_at(self, now: float) -> bool:
        """Whether the engine has run no step for longer than ``IDLE_GAP_S``: its next step is a cold one."""
        return now - self._last_step_end > IDLE_GAP_S

    def _probe(self, now: float) -> None:
        """Measure one small step while idle and refusing for time: what a first step after a gap
        costs here now (cold caches, the clock ramped down), the bound's after-idle excess. It
        informs that alone: a step of an idle machine says nothing of a busy one's, whose recent
        errors age out instead (``StepErrors``). At most one probe per ``PROBE_INTERVAL_S``."""
        if now - self._last_probe < PROBE_INTERVAL_S:
            return
        self._last_probe = now
        seq = Sequence(request_id="probe", token_ids=[0], num_prompt_tokens=1, params=SamplingParams(max_tokens=1),
                       arrival_time=now)
        if not self.cache.allocate(seq, 1):
            return
        batch = ScheduledBatch([(seq, 1)])
        started = self.clock()
        self.runtime.runner.run(batch)
        self._record_step(batch.features(), self.clock() - started, after_idle=True)
        self.cache.free(seq)
        log.info("latency_probe", after_idle_excess_ms=round(self.admission.latency.after_idle_excess * 1000, 3))

    def _refuse(self, seq: Sequence, rejection: Rejection, now: float) -> None:
        del seq.token_ids[seq.num_prompt_tokens:]  # a refused request answers nothing, forced start included
        seq.num_forced_tokens = seq.num_forced_at_arrival = 0
        seq.rejection = rejection
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "rejected"
        seq.finish_time = now
        self._rejected.append(self._output(seq))
        log.info("request_rejected", request_id=seq.request_id, code=rejection.code, **rejection.numbers)

    # ------------------------------------------------------------ constrained answers

    def compile_structured(self, spec: StructuredSpec | dict):
        """Compile (once: cached by its key) a constraint; ``InvalidRequestError`` if it cannot be.
        Templates call this when they are registered or pinned, so their requests find it compiled."""
        if self._grammars is None:
            from ricllm.structured.compiler import GrammarCompiler  # llguidance only for engines that constrain

            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars.compile(StructuredSpec.parse(spec))

    def _guide(self, params: SamplingParams):
        if params.structured is None:
            return None
        from ricllm.structured.guide import Guide

        return Guide(self.compile_structured(params.structured))

    def _bound_by_grammar(self, seq: Sequence, now: float) -> Rejection | None:
        """Refuse a ``max_tokens`` shorter than any complete answer; cap it at the longest one."""
        grammar, requested = seq.guide.grammar, seq.params.max_tokens
        seq.min_output_tokens = grammar.min_tokens
        if requested < grammar.min_tokens:
            rejection = Rejection(
                "OUTPUT_TOO_SHORT", f"max_tokens {requested} is shorter than the shortest complete answer "
                f"the constraint allows ({grammar.min_tokens} tokens); it would end as invalid output",
                {"max_tokens": requested, "shortest_answer_tokens": grammar.min_tokens})
            self._refuse(seq, rejection, now)
            return rejection
        if grammar.max_tokens is not None and grammar.max_tokens < requested:
            seq.params = replace(seq.params, max_tokens=grammar.max_tokens)  # admission plans with the bound
        return None

    def _append_forced(self, seq: Sequence, forced: list[int], at_arrival: bool = False) -> list[int]:
        """Append the grammar's forced tokens without sampling; the next step computes them as one chunk."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        forced = forced[:max(room, 0)]
        seq.guide.accept(forced)
        seq.token_ids += forced
        seq.num_forced_tokens += len(forced)
        if at_arrival:
            seq.num_forced_at_arrival = len(forced)
        return forced

    def _check_well_formed(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty (0 tokens)")
        for position, token in enumerate(prompt_token_ids):
            if not isinstance(token, int) or not 0 <= token < self.spec.vocab_size:
                raise InvalidRequestError(
                    f"token id {token!r} at position {position} is outside the vocabulary [0, {self.spec.vocab_size})")

    # ------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that finished (rejected ones included).

        The step's measured time, which the latency model learns from, runs from entry to return:
        scheduling, sampling and finishing requests are part of every step's cost (about 0.4 ms
        of a 10 ms decode step on 2 cores), and a bound that left them out would drift past it.
        """
        if threading.get_ident() != self._stepping_on:
            self._check_stepping_thread()
        finished, self._rejected = self._rejected, []
        now = entered = self.clock()
        on_late = self.admission.config.on_late if self.admission is not None else "finish"
        if on_late != "finish":
            finished += self._end_late(now)
        batch = self.scheduler.schedule(now)
        if on_late == "end_early" and batch:
            batch, ended = self._end_before_late_step(batch, now)
            finished += ended
        if not batch:
            if self.scheduler.has_unfinished() and not finished:
                raise RuntimeError("scheduler could not schedule any request: this is a bug in ricllm")
            return finished
        features = batch.features()
        after_idle = self._idle_at(entered)
        started = self.clock()
        for seq, _ in batch.items:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        logits, _ = self.runtime.runner.run(batch)
        for seq, num_new in batch.items:
            seq.num_computed_tokens += num_new
            self.cache.cache_full_blocks(seq)
            self.cache.evict_outside_window(seq)
        ready = [seq for seq, _ in batch.items if seq.num_computed_tokens == seq.num_tokens]
        tokens = self._sample(logits, ready)
        now = self.clock()
        for seq, token in zip(ready, tokens):
            reason = self._append_token(seq, token, now)
            if reason is not None:
                finished.append(self._finish(seq, reason, now))
        self._record_step(features, self.clock() - entered, after_idle)
        return finished

    def _sample(self, logits, ready: list[Sequence]) -> list[int]:
        """One token per row; a constrained row's token is one its grammar allows.

        Greedy and temperature-only rows draw first and are masked only when the grammar refuses
        the draw, then draw again: keeping an allowed draw from p, else drawing from p masked,
        is exactly p restricted to the allowed tokens, and checking one token costs far less than
        masking a vocabulary. Rows with top-k or top-p are masked before their one draw, since
        those filters must see the masked distribution.
        """
        params, generators = [s.params for s in ready], [s.generator for s in ready]
        masked_first = [r for r, s in enumerate(ready) if s.guide is not None and not _checkable_after(s.params)]
        if masked_first:
            logits = self._mask_rows(logits, [ready[r] for r in masked_first], masked_first)
        tokens = self.runtime.sample(logits, params, generators)
        refused = [r for r, s in enumerate(ready) if s.guide is not None and _checkable_after(s.params)
                   and not s.guide.allows(tokens[r])]
        if refused:
            again = self._mask_rows(logits[refused], [ready[r] for r in refused], list(range(len(refused))))
            for row, token in zip(refused, self.runtime.sample(again, [params[r] for r in refused],
                                                               [generators[r] for r in refused])):
                tokens[row] = token
        return tokens

    def _mask_rows(self, logits, seqs: list[Sequence], rows: list[int]):
        from ricllm.structured.guide import allowed_tokens

        return self.runtime.mask(logits, rows, allowed_tokens([s.guide for s in seqs], logits.shape[-1]))

    def _check_stepping_thread(self) -> None:
        """Warn (once per thread) when steps run on a thread other than the engine's building one
        while that one lives: two OpenMP pools on few cores make every step slow (``async_engine``)."""
        self._stepping_on = threading.get_ident()
        if any(t.ident == self._built_on for t in threading.enumerate()):
            log.warning("engine_stepped_off_its_build_thread", built_on=self._built_on, stepping_on=self._stepping_on,
                        why="two OpenMP worker pools: each parallel region sleeps and wakes its workers, "
                            "steps run up to 3x slower on few cores",
                        fix="build the engine on the thread that steps it: EngineThread(EngineConfig(...))")

    def _record_step(self, features: StepFeatures, duration_s: float, after_idle: bool = False) -> None:
        """``after_idle``: the step followed a gap (or was a probe); the slowdown detector watches
        busy steps only, as a cold step is no sign of a slower machine."""
        self.num_steps += 1
        self._last_step_end = self.clock()
        self.step_history.append(StepRecord(features, duration_s))
        if self.admission is not None:
            self.admission.latency.observe(features, duration_s, after_idle)
            if not after_idle:
                self._watch_slowdown(features, duration_s)

    def _watch_slowdown(self, features: StepFeatures, duration_s: float) -> None:
        """Say when steps run persistently slower than they lately did (a noisy neighbour, thermal
        limits), and when that ends (``engine/slowdown.py``). Admission does not wait for this:
        its bound scales with the step multipliers, high quantiles, which rise within a few steps."""
        latency, detector = self.admission.latency, self.slowdown_detector
        predicted = latency.base(features)
        if predicted <= 0 or duration_s <= 0:
            return
        changed = detector.observe(duration_s / predicted)
        if changed is None:
            return
        self.slowdown_events.append(SlowdownEvent(self.clock(), changed, detector.slowdown, detector.typical,
                                                  latency.step_multiplier))
        event = "sustained_slowdown" if changed else "slowdown_over"
        (log.warning if changed else log.info)(event, slowdown=round(detector.slowdown, 3),
                                               typical_ratio=round(detector.typical, 3),
                                               step_multiplier=round(latency.step_multiplier, 3), threshold=detector.threshold,
                                               window_steps=detector.window)

    def _finish(self, seq: Sequence, reason: str, now: float) -> RequestOutput:
        seq.finish_time = now
        self.scheduler.finish(seq, reason)
        if self.admission is not None:
            self.admission.release(seq)
        if seq.deadline is not None:
            outcome = "missed" if now > seq.deadline else "ended_early" if reason == "deadline" else "met"
            self.deadline_counts[outcome] += 1
            self.slack_ms.append((seq.deadline - now) * 1000)
        return self._output(seq)

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
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
            seq.output_text = seq.detokenizer.text
        seq.finish_time = self.clock()
        self.scheduler.finish(seq, reason)
        if self.admission is not None:
            self.admission.release(seq)
        return self._output(seq)

    def _end_late(self, now: float) -> list[RequestOutput]:
        """``on_late`` abort and end_early: requests whose deadline has passed end now."""
        late = [s for s in self.scheduler.running + self.scheduler.waiting
                if s.deadline is not None and now > s.deadline]
        return [self._finish(s, "deadline", now) for s in late]

    def _end_before_late_step(self, batch: ScheduledBatch, now: float) -> tuple[ScheduledBatch, list[RequestOutput]]:
        """``on_late: end_early``: a request this step would carry past its deadline (at the speed
        measured now) answers now instead, on time, with what it has (finish_reason "deadline")."""
        step_end = now + self.admission.latency.predict(batch.features())
        late = [s for s, _ in batch.items if s.deadline is not None and step_end > s.deadline]
        if not late:
            return batch, []
        ended = [self._finish(s, "deadline", now) for s in late]
        return ScheduledBatch([(s, n) for s, n in batch.items if not s.is_finished]), ended

    def _append_token(self, seq: Sequence, token: int, now: float) -> str | None:
        """Add a sampled token (and what the answer's grammar then forces); the finish reason if it
        ends the request."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        if (not params.ignore_eos and token in self.tokenizer.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"  # the stop token ends the output but is not part of its text
        else:
            seq.detokenizer.add(token)
            reason = self._follow_grammar(seq, token) if seq.guide is not None else None
            out_of_room = seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
            reason = reason or ("length" if out_of_room else None)
        if reason is not None:
            seq.detokenizer.finish()  # flush text held back for an unfinished UTF-8 character
        seq.output_text = seq.detokenizer.text
        if params.stop and self._truncate_at_stop(seq):
            return "stop"
        return reason

    def _follow_grammar(self, seq: Sequence, token: int) -> str | None:
        """Feed the sampled token to the grammar and append what it then forces; "stop" once the
        answer is whole (its end is not sampled: the grammar allows nothing else)."""
        seq.guide.accept([token])
        for forced_token in self._append_forced(seq, seq.guide.forced_tokens()):
            seq.detokenizer.add(forced_token)
        return "stop" if seq.guide.is_complete else None

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> bool:
        hits = [i for i in (seq.output_text.find(s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.output_text = seq.output_text[:min(hits)]
        return True

    def _output(self, seq: Sequence) -> RequestOutput:
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - seq.arrival_time

        rejected = seq.finish_reason == "rejected"
        met = None if seq.deadline is None or rejected else (
            seq.finish_time <= seq.deadline and seq.finish_reason != "deadline")  # an answer ended early is not met
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], text=seq.output_text,
            token_ids=seq.output_token_ids, num_cached_tokens=max(seq.num_cached_tokens, 0),
            finish_reason=seq.finish_reason, ttft_s=since_arrival(seq.first_token_time),
            e2e_s=since_arrival(seq.finish_time), queue_s=since_arrival(seq.first_scheduled_time),
            admitted=not rejected, rejection=seq.rejection, deadline_met=met,
            deadline_ms=seq.params.deadline_ms, degradation=seq.degradation, num_forced_tokens=seq.num_forced_tokens,
            predicted_e2e_s=since_arrival(seq.predicted_finish), promised_e2e_s=since_arrival(seq.promised_finish))

    # ------------------------------------------------------------ pinned prefixes (templates)

    def render_chat_prefix(self, messages: list[dict[str, str]]) -> ChatPrefix:
        """A template's messages as chat requests start with them (:mod:`ricllm.engine.chat_prefix`)."""
        return render_chat_prefix(self.tokenizer, messages)

    def pin_prefix(self, token_ids: list[int], request_id: str | None = None) -> tuple[PinHandle, Sequence]:
        """Queue the computation of a prefix's K/V; its full blocks stay pinned once ``seq`` finishes.

        The one rule for room: pins may not take blocks that admitted requests reserved, nor the
        last free block (decoding needs one). Raises ``CapacityError`` when it does not fit, or when
        admission refuses the pinning request now; the caller steps the engine until ``seq`` is done.
        """
        self._check_pin_fits(token_ids)
        handle = PinHandle(handle_id=next(self._pin_ids), token_ids=list(token_ids))
        seq = self.add_request(token_ids, SamplingParams(max_tokens=1, ignore_eos=True), request_id=request_id,
                               pin_on_finish=handle)
        if seq.rejection is not None:
            raise CapacityError(f"cannot pin {len(token_ids)} tokens now: {seq.rejection}")
        return handle, seq

    def _check_pin_fits(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prefix to pin is empty")
        needed = len(token_ids) // self.cache.block_size
        reserved = self.admission.reserved_blocks if self.admission is not None else 0
        room = self.kv_cache.geometry.num_blocks - self.cache.num_pinned_blocks - reserved - 1
        if needed > room:
            raise CapacityError(
                f"pinning {len(token_ids)} tokens needs {needed} full KV blocks, but only {room} can be pinned "
                f"now ({self.cache.num_pinned_blocks} already pinned, {reserved} reserved by admitted requests, "
                f"one kept for decoding)")

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
                                   after_idle_excess_s=model.after_idle_excess)
        counts, scheduler = admission or {}, self.scheduler
        return EngineStats(
            kv_cache=_kv_cache_stats(self.kv_cache, self.cache, scheduler), running=len(scheduler.running),
            waiting=len(scheduler.waiting), policy=self.config.admission.policy,
            reserved_blocks=self.admission.reserved_blocks if self.admission is not None else 0,
            admitted=counts.get("admitted", 0),
            rejected=counts.get("rejected", {}), degraded=counts.get("degraded", 0),
            deadlines_met=self.deadline_counts["met"], deadlines_missed=self.deadline_counts["missed"],
            deadlines_ended_early=self.deadline_counts["ended_early"], slack_ms=tuple(self.slack_ms),
            best_effort_paused_steps=scheduler.num_paused_steps,
            rescue_prefill_steps=scheduler.num_rescue_prefill_steps, slowdowns=tuple(self.slowdown_events),
            caps=self.caps, admission=admission, latency=latency, steps=self.num_steps)


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
        kv_cache_dtype=g.kv_format.name)
