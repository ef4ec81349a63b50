"""Deadline-aware admission: decide at arrival, in well under a millisecond, and keep the promise.

A request with a deadline is admitted only if
- memory: its worst case, ``ceil((prompt + max_tokens) / block_size)`` blocks (for a windowed
  request, no more than its window keeps at once: ``KVWindow.max_blocks``; with a hybrid cache,
  the sum over its cache groups, a sliding-window group's at most its window's) less the full
  blocks it shares with pinned prefixes, fits beside what every admitted deadline request has
  reserved (pinned blocks excluded). An admitted request therefore never waits for memory and is
  never preempted; best-effort requests use only capacity nobody reserved, and are the ones
  preempted when a deadline request claims its reservation.
- time: an upper bound on every admitted request's finish time, this one included, stays
  inside its deadline (with a safety margin) when they run earliest-deadline-first.

The time bound. With a step costing ``a + b·P + c·D + d·C + e·Q + f·[op by op] + k·H``
(``LatencyModel``; C and Q the positions each KV cache group's layers read, averaged over the
groups, H the head's rows), request ``k`` in EDF order finishes within ``N_k`` steps, ``N_k = ceil(P_k / M)
+ decode_k - [P_k' > 0]``, where ``P_k`` is the prefill of ``k`` and of everything ahead of it,
``P_k'`` its own and ``M`` the per-step token budget less the sequences that may decode beside it
(decodes are seated first, a token of the budget each: best effort, and every request with a
decode step past the one its prefill samples): the step that ends a prefill samples its first
token. Every step carries at most all ``B`` sequences (best effort included) at
their final contexts ``C_max`` (what each group reads there: a sliding-window group at most its
window), each sampling at most one whole head row, and best effort at most ``best_effort_chunk``
prefill tokens; all pending prefill tokens are charged to everyone (later-deadline prefill chunks
may share ``k``'s steps), and so are the positions a chunk reads past a sliding window (its first
query's window to its last one's: at most a request's prefill tokens in each such group,
``chunk_reach_s``), so

    finish_k <= now + busy + m · (N_k · max(a + (c + k)·B + d·C_max + b·chunk + e·W, roofline(C_max))
                                  + b·P_all + e·Q_all + d'·R_all + f·prefill_steps_k) + stall + idle

with ``m`` the larger of the error model's two busy multipliers (``StepErrors``: measured / fitted,
the 0.9 quantile of each kind's steps among the last 32 busy steps, at most 2 s old, seeded by the
calibration's residuals), of decode steps and of prefill steps: each step is within its own kind's,
so within ``m``, and a slowdown that shows first on one kind (whichever runs) raises every bound.
When the promises already made are re-checked between steps (``rescue``, best effort joining, the
prefill pace), ``m`` is also at least the last busy step's own ratio: the next step follows it at
once and tends to run as it did, so the rescue answers a slowdown on its first slowed step. A new
request's bound does not take it: one stalled step is the stall reserve's, and refusing for it
would refuse what one step later fits. ``stall`` is the worst amount by which one busy step overran
its kind's bound over the last ``stall_reserve_steps`` busy steps, at most
``stall_reserve_max_ms``, and at least ``stall_reserve_share`` of the request's mean step (the
bound's steps over their count: one step running that share past its bound, whatever its size),
held only by a request with at least one busy step; ``idle``, only when
the engine has run no step for ``IDLE_GAP_S`` (20 ms) as the request arrives, is
``(m_idle - m)⁺ · min(first, W)``: the cold part (``AFTER_IDLE_WARM_S``, ``W``) of the first step
of the work, the one after the gap (``first``: at most one step at the full batch with all the
prefill), charged ``m_idle``, the 0.9 quantile of measured / fitted over the last 64 first-steps-
after-a-gap (and probes; ``after_idle_ratio``: over ``W`` of a longer step), where that is the larger. A busy
engine's bounds never charge it, and those steps never move ``m``.

It is pessimistic (batches shrink as requests finish) but safe, and costs O(n) per decision. So
it is the fast pre-check: what it keeps is kept at once. Only when it puts a request past its
deadline is the schedule run forward (``schedule_bound.schedule_bounds``: the EDF plan the
scheduler follows, segment by segment between finish events, each step at the fitted cost of its
real composition, the error model applied the same way), and each request takes the smaller of
its two bounds, both being bounds. Every re-check between steps (``_late``: the rescue, best effort
joining, the pace cap's search) takes the same path, so a promise the schedule made is not taken
for one at risk by the closed form. An admitted request keeps its bound as ``predicted_finish``:
the work it was promised against (a later arrival due later may share its prefill steps; the
re-checks keep its deadline then, not that figure).

The guarantee, exactly: if every busy step takes at most its fitted time × its kind's multiplier,
except at most one busy step per request that may run past that by at most ``stall``, and the first
step after an idle gap takes at most its fitted time plus ``(m_idle - 1) · min(its fitted time,
W)``, every admitted request finishes within its deadline, with ``safety_margin`` (a fraction of the
bound) to spare. ``m`` and ``m_idle`` are 0.9 quantiles, so a step past them is expected one time in
ten: the margin, the reserve and the slack of the other steps absorb it, and every report measures
how often a finish passed its bound (``bound_below_actual``) and a deadline was missed. Assumed, not
guaranteed: that the next steps err as the last ones did, and that a gap of at most ``IDLE_GAP_S``
leaves the machine warm. A slowdown breaks the first for the few steps before the multiplier sees it
(it is past the 0.9 quantile after 4 slowed steps of a kind: misses then are counted, not hidden);
``safety_margin`` is the room for them and for a stall longer than the reserve. Every bound is re-
checked each step: ``rescue`` pauses best effort, lowest priority first, then holds back the prefill
of requests due later; ``on_late`` decides what a request that still cannot make it does.

Two policies sit on the bound: ``prefill_token_cap`` paces prefill chunks for running decodes
(never below the chunk the bound needs), and the opt-in ``degrade`` admits with the largest
``max_tokens`` that passes instead of refusing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ricllm.config import AdmissionSettings
from ricllm.engine.latency_model import LatencyModel, runs_op_by_op
from ricllm.engine.scheduler import ADAPTER_ROWS_PER_BLOCK, StepFeatures
from ricllm.engine.schedule_bound import schedule_bounds, step_counts
from ricllm.kv_window import KVWindow, mean_positions_read, most_blocks
from ricllm.outputs import Degradation, Rejection
from ricllm.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from ricllm.engine.runtime.capabilities import KernelLimits

# refusals a shorter answer can avoid
DEGRADABLE = ("CONTEXT_TOO_LONG", "KV_BUDGET", "KV_RESERVED", "DEADLINE_INFEASIBLE")


@dataclass
class Work:
    """What an admitted request still has to do."""

    deadline: float  # absolute, engine clock
    prefill_left: int
    decode_left: int
    final_context: int
    request_id: str = ""
    running: bool = False  # seated in the batch: its prefill is served before waiting requests'
    adapter: int | None = None  # the runtime slot of the LoRA adapter it is served under
    group_reaches: tuple[int, ...] = ()  # what a query of each of its cache groups 1.. reads (0: all)

    def reads(self, context: int, span: int = 0) -> int | float:
        """K/V positions its layers read at ``context``, averaged over its cache groups
        (``kv_window.mean_positions_read``; ``span``: its chunk's first query sits that far back)."""
        return mean_positions_read(context, self.group_reaches, span)

    @property
    def whole_share(self) -> float:
        """The share of its cache groups whose layers read its whole context (1 with one group)."""
        return (1 + self.group_reaches.count(0)) / (1 + len(self.group_reaches))

    @property
    def window_reads(self) -> float:
        """What its sliding-window groups read at its final context, averaged over its groups: with
        ``whole_share``, ``reads(c) <= whole_share · c + window_reads`` for every ``c`` it reaches."""
        return sum(min(self.final_context, r) for r in self.group_reaches if r) / (1 + len(self.group_reaches))


def work_of(seq: Sequence) -> Work:
    """Pinned prefix blocks are never recomputed, nor the cached ones an admitted request holds from
    admission on (``KVCacheManager.hold_prefix``), so they are not prefill work; an answer's forced
    start is prefilled with the prompt, so it is. A constrained answer decodes one step per
    sampling decision its grammar may still take (``decode_steps_left``); every other token it may
    still get is forced, computed as chunks: prefill work, no more than its grammar's
    ``max_forced_computed`` (a forced tail that completes the answer is appended, never computed)."""
    prefill_tokens = seq.num_prompt_tokens + seq.num_forced_at_arrival
    done = max(seq.num_computed_tokens, seq.pinned_prefix_tokens, seq.prefix_hit_tokens)
    prefill_left = max(prefill_tokens - done, 0)
    decode_left = seq.decode_steps_left
    forced_left = seq.params.max_tokens - seq.num_output_tokens - decode_left
    if seq.guide is not None and seq.guide.grammar.max_forced_computed is not None:
        forced_left = min(forced_left, seq.guide.grammar.max_forced_computed)
    return Work(seq.deadline, prefill_left + forced_left, decode_left,
                seq.num_prompt_tokens + seq.params.max_tokens, seq.request_id,
                seq.status is SequenceStatus.RUNNING, seq.adapter.slot if seq.adapter is not None else None,
                seq.group_reaches)


def adapter_step_s(works: list[Work], model: LatencyModel, best_effort_adapted: int = 0) -> float:
    """The most one step's LoRA updates cost while ``works`` decode (and ``best_effort_adapted``
    best-effort sequences under adapters share the step): each adapter's rows are read in blocks of
    ``ADAPTER_ROWS_PER_BLOCK``, ⌈r/4⌉ ≤ r/4 + 1 reads for r rows, charged at the dearest adapter's
    read. Prefill rows under an adapter add ``adapter_prefill_s``."""
    if model.adapter_block_s == 0:
        return 0.0
    adapted = [w.adapter for w in works if w.adapter is not None]
    rows = len(adapted) + best_effort_adapted
    return model.adapter_block_s * (rows / ADAPTER_ROWS_PER_BLOCK + len(set(adapted)) + (best_effort_adapted > 0))


def adapter_prefill_s(works: list[Work], model: LatencyModel) -> float:
    """What the prefill rows of ``works`` under adapters add to the steps that carry them."""
    rows = sum(w.prefill_left for w in works if w.adapter is not None)
    return model.adapter_block_s * rows / ADAPTER_ROWS_PER_BLOCK


@dataclass(frozen=True)
class BestEffortLoad:
    """Best-effort sequences that share every step with admitted work: how many, the sum of the
    K/V positions their decode steps read at their final contexts (prompt + max_tokens, averaged
    over their cache groups: ``Work.reads``), and the longest final
    context among those that may still bring prefill chunks (0: none may; a constrained answer's
    forced tokens come as chunks too)."""

    seqs: int = 0
    context: int = 0
    longest_pending: int = 0
    adapted: int = 0  # of ``seqs``, those under a LoRA adapter

    @classmethod
    def of(cls, seqs: list[Sequence]) -> BestEffortLoad:
        pending = [_final_context(s) for s in seqs if not s.in_decode or s.guide is not None]
        return cls(len(seqs), sum(map(_final_reads, seqs)), max(pending, default=0),
                   sum(s.adapter is not None for s in seqs))

    def plus(self, joining: Sequence) -> BestEffortLoad:
        """With a sequence that joins now: it has its prompt to prefill."""
        context = _final_context(joining)
        return BestEffortLoad(self.seqs + 1, self.context + _final_reads(joining), max(self.longest_pending, context),
                              self.adapted + (joining.adapter is not None))


def _final_context(seq: Sequence) -> int:
    return seq.num_prompt_tokens + seq.params.max_tokens


def _final_reads(seq: Sequence) -> int | float:
    return mean_positions_read(_final_context(seq), seq.group_reaches)


NO_BEST_EFFORT = BestEffortLoad()


def finish_bounds(works: list[Work], model: LatencyModel, token_budget: int, now: float,
                  busy_s: float = 0.0, best_effort: BestEffortLoad = NO_BEST_EFFORT,
                  best_effort_chunk: int = 0, after_idle: bool = False,
                  follow_last_step: bool = False) -> list[float]:
    """Upper bounds on finish times, in the order of ``works`` (which must be EDF-sorted).

    ``best_effort`` sequences share every step at their final contexts, and while any of them may
    still prefill, up to ``best_effort_chunk`` prefill tokens a step, of at most that many tokens
    times the longest such context, and at most ``model.kernel_prefill_work``, of attention work (the
    scheduler holds them to both: ``best_effort_prefill_cap``); ``busy_s`` is what remains of the
    step in flight. Every fitted term counts: a step that carries the admitted
    requests' prefill may run op by op, so each such step is charged the op-by-op fixed cost too, and
    the positions it reads (at most the batch's final contexts) at the op-by-op price of a position.
    The op-by-op terms are charged only when a step may pass the runtime's kernel limits
    (``may_run_op_by_op``). A step's time is the larger of its fitted terms and the roofline (the
    weights read once); prefill tokens ride on that read, so the room the roofline leaves above one
    step's other terms is taken off the prefill, once: for steps of at most ``L`` other terms, roofline
    ``R`` and prefill ``p_i``, Σ max(L + p_i, R) <= N·max(L, R) + (Σ p_i - (R - L)⁺)⁺.
    Every step is charged ``model.bound_multiplier``: the larger of the decode and prefill
    multipliers and, with ``follow_last_step`` (promises re-checked between a busy engine's steps),
    of the last busy step's own ratio.
    Each bound also holds ``model.reserve``: the stall reserve (room for one busy step to run as
    late as the worst recent one did, and at least a share of the request's mean step) unless
    ``after_idle`` and the request finishes in its first step, and, ``after_idle`` (the engine has
    been idle past ``IDLE_GAP_S``), ``model.after_idle_charge`` of the first step, the one after the
    gap (at most one step at the full batch with all the prefill).
    """
    batch = len(works) + best_effort.seqs
    context_max = sum(w.reads(w.final_context) for w in works) + best_effort.context
    a, b, c, d, e, f, g, h, k, j, x = model.coefficients  # LatencyModel pads a shorter fit with zeros
    prefill_all = sum(w.prefill_left for w in works)
    attention_all = sum(w.prefill_left * w.reads(w.final_context) for w in works)
    chunk, chunk_attention = 0, 0
    if best_effort.longest_pending and best_effort_chunk:
        chunk = best_effort_chunk
        chunk_attention = min(best_effort_chunk * best_effort.longest_pending, model.kernel_prefill_work)
    op = may_run_op_by_op(works, token_budget, model.kernel_limits, chunk, chunk_attention)
    per_token = b + (max(g, x) if op else x)  # a step that may run op by op: either way's price of a token
    linear = a + (c + k) * batch + d * context_max + per_token * chunk + (e + h * op) * chunk_attention
    if chunk and op:  # best effort's chunk may make every step run op by op
        linear += j * context_max
    op_step = (f + j * context_max) * op  # what a step with prefill pays beyond the others, op by op
    floor = model.roofline.seconds(StepFeatures(0, batch, context_max)) if model.roofline is not None else 0.0
    slack = max(floor - linear, 0.0)
    step = max(linear, floor) + adapter_step_s(works, model, best_effort.adapted)
    step += model.adapter_block_s * chunk / ADAPTER_ROWS_PER_BLOCK if best_effort.adapted else 0.0
    prefill_linear = per_token * prefill_all + (e + h * op) * attention_all + chunk_reach_s(works, model)
    adapter_prefill = adapter_prefill_s(works, model)
    multiplier = model.bound_multiplier(follow_last_step and not after_idle)
    idle_charge = 0.0
    if after_idle:  # the first step: the full batch with all the prefill
        idle_charge = model.after_idle_charge(step + max(prefill_linear + op_step - slack, 0.0) + adapter_prefill)
    bounds = []
    for w, (prefill_steps, steps) in zip(works, step_counts(works, token_budget, best_effort.seqs)):
        prefill = max(prefill_linear + op_step * prefill_steps - slack, 0.0) + adapter_prefill
        work_s = multiplier * (steps * step + prefill)
        bounds.append(now + busy_s + work_s + model.reserve(steps - after_idle, work_s / max(steps, 1)) + idle_charge)
    return bounds


def chunk_reach_s(works: list[Work], model: LatencyModel) -> float:
    """What prefill chunks read beyond ``context_max`` in sliding-window groups: a chunk of ``n``
    tokens reads up to ``n - 1`` positions past its window (its first query's window to its last
    one's), so a request's chunks read at most its prefill tokens more in each such group; charged
    at the dearer of the fit's and the roofline's price of a position. 0 with one cache group."""
    extra = sum(w.prefill_left * (1 - w.whole_share) for w in works)
    if not extra:
        return 0.0
    per_position = model.coefficients[3]
    if model.roofline is not None:
        per_position = max(per_position, model.roofline.kv_bytes_per_token / model.roofline.bandwidth_bytes_per_s)
    return per_position * extra


def may_run_op_by_op(works: list[Work], token_budget: int, limits: KernelLimits | None, chunk: int = 0,
                     chunk_attention: float = 0) -> bool:
    """Whether any step of ``works`` may pass the runtime's kernel ``limits`` (``runs_op_by_op``): the most
    admitted prefill one step can carry, beside ``chunk`` best-effort tokens of ``chunk_attention``
    work, at the widest context any of it attends to. When none can, every step is one C call and
    no op-by-op term is charged."""
    pending = [w for w in works if w.prefill_left > 0]
    if not pending:
        return False
    tokens = min(token_budget, sum(w.prefill_left for w in pending))
    widest = max(w.final_context for w in pending)
    return runs_op_by_op(StepFeatures(tokens + chunk, 0, 0, tokens * widest + chunk_attention), limits)


@dataclass
class Rescue:
    """What a step gives up so that admitted requests at risk stay on time: best-effort sequences
    that sit it out, and, when that is not enough, prefill only for requests due by ``prefill_until``."""

    paused: list[Sequence]
    prefill_until: float | None = None


class AdmissionController:
    """Holds the promises: which deadline requests were admitted, the KV blocks reserved for them,
    and the latency model their bounds are computed with.

    ``best_effort`` arguments are the unpromised sequences running now (``BestEffortLoad``): they
    share every step with admitted work, and the bound charges them.
    """

    def __init__(self, config: AdmissionSettings, latency: LatencyModel, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, group_windows: tuple[int, ...] = ()):
        self.config = config
        self.group_windows = group_windows  # the layer windows of a hybrid cache's groups 1.. (kv_groups)
        self.latency = latency
        latency.keep_overruns(config.stall_reserve_steps, config.stall_reserve_max_ms / 1000,
                              config.stall_reserve_share)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admitted: dict[str, Sequence] = {}  # deadline requests not yet finished
        self.reserved_blocks = 0
        self.counts: dict[str, int] = {"admitted": 0}
        self.paced_steps = 0  # steps whose prefill the pace cap shortened

    @property
    def promises(self) -> bool:
        """Whether this policy admits against deadlines (else it only queues, up to ``max_queue``)."""
        return self.config.policy == "deadline"

    # ------------------------------------------------------------ decision

    def decide(self, seq: Sequence, now: float, pinned_blocks: int, pinned_hits: int, waiting: list[Sequence],
               busy_s: float = 0.0, after_idle: bool = False, cached_hits: int = 0) -> Rejection | None:
        """None to admit (and reserve), or the reason to refuse, with the numbers.

        Running best effort does not count against a new promise: it shares steps only while every
        promise holds with it, and the rescue pauses as much of it as a promise needs.
        A request promised a deadline is one with a deadline and a priority above ``best_effort``;
        a ``best_effort`` request with a deadline is served as best effort (never promised, first
        to pause), its deadline only orders it among best effort. With ``degrade`` on, a request
        refused for its length, its memory or its time is admitted instead with the largest
        ``max_tokens`` that passes (``seq.degradation`` says so), when its prompt and one token pass.
        ``after_idle``: the engine has run no step for ``IDLE_GAP_S``, so the next is a cold one.
        ``cached_hits``: leading blocks of the prompt in the prefix cache, pinned or not; an admitted
        request's bound credits them, and the engine holds them for it from then on.
        """
        seq.prefix_hit_tokens = cached_hits * self.block_size

        def judge():
            return self._judge(seq, now, pinned_blocks, pinned_hits, waiting, busy_s, after_idle)

        verdict = judge()
        if isinstance(verdict, Rejection) and self.config.degrade and verdict.code in DEGRADABLE:
            verdict = self._degrade(seq, verdict, judge)
        if isinstance(verdict, Rejection):
            self._count(verdict.code)
            return verdict
        need, promise, bounds = verdict
        return self._admit(seq, need, promise, bounds)

    def _judge(self, seq: Sequence, now: float, pinned_blocks: int, pinned_hits: int, waiting: list[Sequence],
               busy_s: float, after_idle: bool) -> Rejection | tuple[int, bool, dict[Sequence, float] | None]:
        """The refusal, or ``(blocks to reserve, promised, the finish bounds promised)``; changes nothing."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if total > self.max_model_len:
            return Rejection("CONTEXT_TOO_LONG",
                             f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = "
                             f"{total} tokens exceeds the context of {self.max_model_len} tokens",
                             dict(prompt_tokens=seq.num_prompt_tokens, max_tokens=seq.params.max_tokens,
                                  max_model_len=self.max_model_len))
        pinned = seq.pinned_blocks_held(pinned_hits, self.block_size)
        need = seq.most_blocks(self.block_size, self.token_budget) - pinned
        seq.pinned_prefix_tokens = pinned_hits * self.block_size
        capacity = self.num_blocks - pinned_blocks
        if need > capacity:
            return Rejection("KV_BUDGET", f"needs {need} KV blocks ({total} tokens) but the budget holds "
                             f"{capacity} blocks besides {pinned_blocks} pinned",
                             dict(blocks_needed=need, blocks_capacity=capacity, pinned_blocks=pinned_blocks))
        if not self._promisable(seq):
            return self._queue_full(waiting) or (0, False, None)
        free = capacity - self.reserved_blocks
        if need > free:
            return Rejection("KV_RESERVED", f"needs {need} KV blocks ({total} tokens) but only {free} of "
                             f"{capacity} are not reserved by admitted requests",
                             dict(blocks_needed=need, blocks_free=free, blocks_reserved=self.reserved_blocks))
        verdict = self._first_late(seq, now, busy_s, after_idle)  # without best effort: the rescue pauses what a promise needs
        return verdict if isinstance(verdict, Rejection) else (need, True, verdict)

    def _promisable(self, seq: Sequence) -> bool:
        return self.promises and seq.deadline is not None and seq.params.priority != "best_effort"

    def _queue_full(self, waiting: list[Sequence]) -> Rejection | None:
        """The queue bound: best-effort requests under the deadline policy, every request under edf and fcfs."""
        queued = sum(1 for s in waiting if not s.promised)
        if queued < self.config.max_queue:
            return None
        what = "best-effort requests" if self.promises else "requests"
        return Rejection("QUEUE_FULL", f"{queued} {what} already wait (max_queue {self.config.max_queue})",
                         dict(waiting=queued, max_queue=self.config.max_queue))

    def _degrade(self, seq: Sequence, refusal: Rejection, judge) -> Rejection | tuple[int, bool, dict[Sequence, float] | None]:
        """Binary search for the largest ``max_tokens`` that passes (every check is monotone in it)."""
        requested = seq.params

        def with_tokens(tokens: int):
            seq.params = replace(requested, max_tokens=tokens)
            return judge()

        low, high = 0, requested.max_tokens - 1
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if not isinstance(with_tokens(middle), Rejection) else (low, middle - 1)
        verdict = with_tokens(low) if low >= seq.min_output_tokens else refusal  # never below a whole answer
        if isinstance(verdict, Rejection):
            seq.params = requested
            return refusal
        seq.degradation = Degradation(refusal.code, requested.max_tokens, low,
                                      f"max_tokens {requested.max_tokens} -> {low}: {refusal.message}",
                                      refusal.numbers)
        self._count("degraded")
        return verdict

    def _first_late(self, seq: Sequence, now: float, busy_s: float,
                    after_idle: bool) -> Rejection | dict[Sequence, float]:
        """The refusal for the first request the new one would make late, or the bound of every
        request with the new one admitted (the new one's included)."""
        candidates = sorted([*self.admitted.values(), seq], key=_edf)
        works = [work_of(s) for s in candidates]
        bounds = self._bounds(candidates, now, NO_BEST_EFFORT, busy_s, after_idle=after_idle)
        late = self._refusal(seq, works, bounds, now)
        return late if late is not None else dict(zip(candidates, bounds))

    def _refusal(self, seq: Sequence, works: list[Work], bounds: list[float], now: float) -> Rejection | None:
        margin = 1 + self.config.safety_margin
        batch = len(works)
        for w, bound in zip(works, bounds):
            bound_ms = (bound - now) * margin * 1000
            slack_ms = (w.deadline - now) * 1000
            if bound_ms > slack_ms:
                whose = "it" if w.request_id == seq.request_id else f"admitted request {w.request_id!r}"
                return Rejection(
                    "DEADLINE_INFEASIBLE",
                    f"finish bound of {whose} is {bound_ms:.1f} ms (with {self.config.safety_margin:.0%} "
                    f"margin) > {slack_ms:.1f} ms left to its deadline; batch would be {batch}, "
                    f"{w.decode_left} decode steps to run",
                    dict(bound_ms=round(bound_ms, 3), deadline_ms=round(slack_ms, 3),
                         batch=batch, request=w.request_id, decode_steps=w.decode_left))
        return None

    def finish_bound(self, seq: Sequence, now: float, best_effort: list[Sequence]) -> float:
        """The bound on an admitted request's finish, as of ``now``, safety margin included."""
        ordered = sorted(self.admitted.values(), key=_edf)
        bounds = self._bounds(ordered, now, BestEffortLoad.of(best_effort))
        return now + (bounds[ordered.index(seq)] - now) * (1 + self.config.safety_margin)

    def reject(self, code: str, message: str, **numbers) -> Rejection:
        """A refusal decided outside ``decide`` (the engine's seat limit), counted with the others."""
        self._count(code)
        return Rejection(code, message, numbers)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def _admit(self, seq: Sequence, reserve: int, promise: bool, bounds: dict[Sequence, float] | None) -> None:
        """``bounds``: every promised request's bound with this one admitted. Each earlier promise now
        holds with this request's work beside it: that bound is the one it was last promised."""
        seq.reserved_blocks = reserve
        seq.promised = promise
        seq.predicted_finish = bounds[seq] if bounds else None
        for promised, bound in (bounds or {}).items():
            promised.promised_finish = bound
        self.reserved_blocks += reserve
        if promise:
            self.admitted[seq.request_id] = seq
        self.counts["admitted"] += 1

    # ------------------------------------------------------------ caps and stats

    def caps(self, deadline_ms: float, tokens: int, contexts=(128, 256, 512, 1024, 2048, 4096, 8192)) -> list[dict]:
        """Largest batch of identical requests (context n, ``tokens`` new) that meets the deadline
        and fits the KV budget, per context: what the tightest deadline class allows."""
        rows = []
        for context in (c for c in contexts if c + tokens <= self.max_model_len):
            blocks_each = self._blocks_each(context + tokens)
            by_memory = self.num_blocks // blocks_each
            rows.append({"context": context, "max_batch_memory": by_memory,
                         "max_batch": self._largest_batch_in_time(context, tokens, deadline_ms / 1000, by_memory)})
        return rows

    def _blocks_each(self, total: int) -> int:
        """The most blocks a request of ``total`` tokens holds, over every cache group."""
        windows = (None, *(KVWindow(0, w) if w else None for w in self.group_windows))
        return sum(most_blocks(total, window, self.block_size, self.token_budget) for window in windows)

    def _largest_batch_in_time(self, context: int, tokens: int, deadline_s: float, limit: int) -> int:
        def fits(batch: int) -> bool:
            works = [Work(deadline_s, context, tokens, context + tokens, group_reaches=self.group_windows)] * batch
            return finish_bounds(works, self.latency, self.token_budget, 0.0)[-1] * (
                1 + self.config.safety_margin) <= deadline_s

        low, high = 0, limit  # fits() is monotone in batch: binary search
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    def stats(self) -> dict:
        rejected = {k: v for k, v in self.counts.items() if k not in ("admitted", "degraded")}
        return {"policy": self.config.policy, "admitted": self.counts["admitted"], "rejected": rejected,
                "degraded": self.counts.get("degraded", 0), "paced_steps": self.paced_steps,
                "reserved_blocks": self.reserved_blocks, "promised_in_flight": len(self.admitted),
                "latency_model": {"coefficients": self.latency.coefficients,
                                  "step_multipliers": self.latency.multipliers,
                                  "after_idle_multiplier": self.latency.after_idle_multiplier,
                                  **self.latency.error_summary()}}

    # ------------------------------------------------------------ running

    def _bounds(self, ordered: list[Sequence], now: float, best_effort: BestEffortLoad, busy_s: float = 0.0,
                token_budget: int | None = None, after_idle: bool = False, recheck: bool = False) -> list[float]:
        """The closed form first (cheap, and what it keeps is kept); only when it puts a request past
        its deadline, the schedule run forward (``schedule_bounds``), each request taking the
        smaller of its two bounds (both are bounds). ``token_budget``: the pace cap to check."""
        works = [work_of(s) for s in ordered]
        cap = token_budget or self.token_budget
        closed = finish_bounds(works, self.latency, cap, now, busy_s, best_effort, self._chunk, after_idle,
                               follow_last_step=recheck)
        if not self._any_late(works, closed, now):
            return closed
        planned = schedule_bounds(works, self.latency, self.token_budget, now, best_effort, busy_s, self._chunk,
                                  after_idle, follow_last_step=recheck, prefill_cap=cap)
        return [min(c, p) for c, p in zip(closed, planned)]

    def _any_late(self, works: list[Work], bounds: list[float], now: float) -> bool:
        margin = 1 + self.config.safety_margin
        return any(now + (b - now) * margin > w.deadline for w, b in zip(works, bounds))

    def _late(self, now: float, best_effort: BestEffortLoad, busy_s: float = 0.0,
              token_budget: int | None = None) -> list[Sequence]:
        """Admitted requests whose bound, safety margin included, passes their deadline, as re-checked
        between steps (the last busy step's ratio counts)."""
        ordered = sorted(self.admitted.values(), key=_edf)
        bounds = self._bounds(ordered, now, best_effort, busy_s, token_budget, recheck=True)
        margin = 1 + self.config.safety_margin
        return [s for s, b in zip(ordered, bounds) if now + (b - now) * margin > s.deadline]

    def best_effort_may_join(self, now: float, best_effort: list[Sequence], joining: Sequence,
                             busy_s: float = 0.0) -> bool:
        """A waiting best-effort request may join the batch if no admitted promise breaks."""
        if not self.promises or not self.admitted:
            return True
        return not self._late(now, BestEffortLoad.of(best_effort).plus(joining), busy_s)

    def prefill_token_cap(self, now: float, decodes: list[Sequence], first_prefill: Sequence, budget: int,
                          best_effort: list[Sequence] = ()) -> int:
        """Prefill tokens this step may carry so that running decodes keep their per-token pace.

        A decode with a deadline needs, from now on, one step per ``(deadline - now) / tokens
        left`` (less the safety margin): its pace. The cap is the largest prefill whose step the
        latency model predicts within the tightest pace of the step's decodes, so a long prompt
        is spread over several steps instead of stalling every stream for one long step. The cap
        never breaks a promise: admission's bound assumed chunks of the full budget, so the cap
        is raised to the smallest chunk with which ``finish_bounds`` still keeps every admitted
        deadline (the full budget if the bound has drifted past it).
        """
        if not self.config.pace_prefill or not self.promises:
            return budget
        paces = [(s.deadline - now) / max(s.decode_steps_left, 1)
                 for s in decodes if s.deadline is not None]
        if not paces:
            return budget
        target_s = min(paces) / (1 + self.config.safety_margin)
        cap = self._largest_prefill_within(target_s, decodes, first_prefill, budget)
        if cap >= budget:
            return budget
        cap = max(cap, self._smallest_chunk_keeping_promises(now, BestEffortLoad.of(best_effort), cap, budget))
        self.paced_steps += cap < budget
        return cap

    def _largest_prefill_within(self, target_s: float, decodes: list[Sequence], first: Sequence, budget: int) -> int:
        """Binary search: predicted step time grows with the prefill tokens it carries (the K/V
        positions read per cache group, as ``ScheduledBatch.features`` counts them; the chunk's
        last row may sample)."""
        context = sum(mean_positions_read(s.num_computed_tokens + 1, s.group_reaches) for s in decodes)

        def step_s(tokens: int) -> float:
            attended = first.num_computed_tokens + tokens
            reads = mean_positions_read(attended, first.group_reaches, tokens - 1)
            attention = tokens * mean_positions_read(attended, first.group_reaches)
            return self.latency.predict(StepFeatures(tokens, len(decodes), context + reads, attention,
                                                     head_rows=len(decodes) + 1, prefill_products=tokens * attended))

        low, high = 0, budget
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if step_s(middle) <= target_s else (low, middle - 1)
        return low

    def _smallest_chunk_keeping_promises(self, now: float, best_effort: BestEffortLoad, low: int, high: int) -> int:
        """Smallest chunk in [max(low, 1), high] with which every admitted request stays on time."""
        low = max(low, 1)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if not self._late(now, best_effort, token_budget=middle) else (middle + 1, high)
        return low

    @property
    def _chunk(self) -> int:
        return self.config.best_effort_chunk

    def rescue(self, now: float, best_effort: list[Sequence]) -> Rescue | None:
        """None while every admitted request stays on time beside the running best effort, at the
        speed measured now. Otherwise the rescue, in order: best-effort sequences sit the step out,
        lowest priority first and only as many as needed (paused, not preempted); if even none
        would do, prefill runs only for the requests at risk and those due before them."""
        if not self.promises or not self.admitted or not self._late(now, BestEffortLoad.of(best_effort)):
            return None
        by_pause_order = sorted(best_effort, key=Sequence.priority_key, reverse=True)
        low, high = 1, len(by_pause_order)  # pausing more never hurts: binary search the fewest
        while low < high:
            middle = (low + high) // 2
            safe = not self._late(now, BestEffortLoad.of(by_pause_order[middle:]))
            low, high = (low, middle) if safe else (middle + 1, high)
        at_risk = self._late(now, BestEffortLoad.of(by_pause_order[high:]))
        return Rescue(by_pause_order[:high], max((s.deadline for s in at_risk), default=None))

    def best_effort_prefill_allowance(self) -> int | None:
        """Prefill tokens best-effort sequences may add to the next step: the chunk the bound charges
        while admitted requests are in flight; None (no limit) when none is."""
        if not self.promises or not self.admitted:
            return None
        return self._chunk

    def best_effort_work_allowance(self) -> float:
        """The attention work best-effort prefill may do in a step: all the bound charges for it, the
        runtime's kernel limit (so the step stays one C call on a CPU; unbounded without a limit)."""
        return self.latency.kernel_prefill_work

    @staticmethod
    def best_effort_prefill_cap(start: int, tokens: int, work: float) -> int:
        """The largest chunk of at most ``tokens``, from position ``start``, whose attention work stays
        within ``work``: what is left of the step's ``best_effort_work_allowance``."""
        low, high = 0, tokens
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if middle * (start + middle) <= work else (low, middle - 1)
        return low

    def outstanding_reservation(self) -> int:
        """Blocks reserved by admitted requests but not yet allocated to them."""
        return sum(max(s.reserved_blocks - s.num_held_blocks, 0) for s in self.admitted.values())

    def release(self, seq: Sequence) -> None:
        self.reserved_blocks -= seq.reserved_blocks
        seq.reserved_blocks = 0
        self.admitted.pop(seq.request_id, None)


def _edf(seq: Sequence) -> tuple:
    return seq.deadline, seq.arrival_time
