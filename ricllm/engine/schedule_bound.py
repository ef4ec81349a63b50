"""Finish bounds that follow the schedule: the EDF schedule run forward, one segment per event.

``finish_bounds`` (the closed form) charges every step at the full batch and the final contexts, and
all pending prefill to everyone. Batches shrink as requests finish, so it refuses work that fits.
``schedule_bounds`` runs the scheduler's own plan forward instead, with the fitted cost of each
step's real composition:

- decodes first, one token each (admitted and best effort), then prefill in the scheduler's order:
  running prefills by deadline, then waiting requests by deadline (``Scheduler.schedule`` serves
  running sequences before it seats waiting ones), in chunks of what is left of the token budget
  (``max_num_batched_tokens``, no more than the pace cap when one is given) after the decodes and
  the best-effort chunk;
- a request whose prefill is done decodes its ``decode_left`` steps, then leaves the batch.

Between two events (a prefill done, a request finished) the composition is constant, so every step
of the segment costs the same: each is charged at the contexts of the segment's last step (contexts
grow by one a step, so that is an upper bound; a sliding-window cache group's reads at the
request's final context, and a prefill chunk's up to its window plus the chunk), one whole head
row per sequence and, when a step of it may pass the runtime's kernel limits, the op-by-op terms.
Prefill tokens and their attention are charged once, where they run, as the closed form charges
them. Best effort is charged as the closed form charges it, on every step: its sequences at their
final contexts and, while any may still prefill, ``best_effort_chunk`` tokens a step. The error
model applies as in the closed form: the multiplier on the fitted steps, the stall reserve, and
the after-idle multiplier on the first step. At most two events per request: O(n log n) per bound.
Rows under LoRA adapters are charged their adapters' weight reads: a segment's adapted decodes and
prefill tokens in blocks of four, plus one read per adapter in the plan (a partial block) while
any of its rows run.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ricllm.engine.latency_model import LatencyModel, runs_op_by_op
from ricllm.engine.scheduler import ADAPTER_ROWS_PER_BLOCK, StepFeatures

UNREACHED = math.inf  # a request the plan never finishes (the budget leaves no room for its prefill)


@dataclass
class StepCost:
    """The fitted terms of one step, best effort's share folded into ``fixed``."""

    fixed: float  # intercept, plus best effort's prefill chunk while any may prefill
    per_seq: float
    per_context: float
    per_prefill_token: float
    per_attention: float
    op_by_op: float
    op_by_op_prefill_token: float
    op_by_op_attention: float
    per_head_row: float  # each sequence samples at most one row a step, computed whole at most
    op_by_op_context: float  # each position read, in a step run op by op
    kernel_prefill_token: float  # each prefill token's extra in a step run as the kernel's one call
    model: LatencyModel
    best_effort_seqs: int = 0
    best_effort_context: int = 0
    adapter_read: float = 0.0  # one read of the dearest adapter's weights (``LatencyModel.adapter_block_s``)
    adapter_reads_per_step: float = 0.0  # while adapted rows run: a partial block per adapter, best effort's

    def segment_seconds(self, steps: int, seqs: int, context: int, prefill: int, attention: int,
                        op_by_op: bool = True, adapted_seqs: int = 0, adapted_prefill: int = 0) -> float:
        """``steps`` alike steps of ``seqs`` sequences at ``context`` positions, carrying ``prefill``
        tokens of ``attention`` work among them (charged once, less the room the roofline leaves
        above a step's other terms, as ``finish_bounds`` takes it); ``op_by_op``: the steps may pass the
        CPU kernel's limits, so their op-by-op terms are charged. ``adapted_seqs`` of the sequences
        and ``adapted_prefill`` of the tokens are under LoRA adapters."""
        seqs += self.best_effort_seqs
        context += self.best_effort_context
        op = bool(prefill) and op_by_op
        linear = (self.fixed + (self.per_seq + self.per_head_row) * seqs + self.per_context * context
                  + ((self.op_by_op + self.op_by_op_context * context) if op else 0.0))
        floor = self.model.roofline.seconds(StepFeatures(0, seqs, context)) if self.model.roofline else 0.0
        step = max(linear, floor)
        if self.adapter_read and (adapted_seqs or adapted_prefill or self.adapter_reads_per_step):
            step += self.adapter_read * (adapted_seqs / ADAPTER_ROWS_PER_BLOCK + self.adapter_reads_per_step)
        extra = max(self.op_by_op_prefill_token, self.kernel_prefill_token) if op else self.kernel_prefill_token
        prefill_s = ((self.per_prefill_token + extra) * prefill
                     + (self.per_attention + self.op_by_op_attention * op) * attention)
        return (steps * step + max(prefill_s - max(floor - linear, 0.0), 0.0)  # prefill rides on the floor's read
                + self.adapter_read * adapted_prefill / ADAPTER_ROWS_PER_BLOCK)


def step_cost(model: LatencyModel, best_effort, best_effort_chunk: int, works: list = ()) -> StepCost:
    """The fit's terms, with ``best_effort`` (a ``BestEffortLoad``) charged on every step, and the
    adapter reads of ``works`` and of best effort."""
    a, b, c, d, e, f, g, h, k, j, x = model.coefficients
    fixed = a
    chunk = best_effort_chunk if best_effort.longest_pending else 0
    if chunk:  # charged as if its steps ran op by op, each token at the dearer of the two ways' prices
        fixed += (b + max(g, x)) * chunk + (e + h) * min(chunk * best_effort.longest_pending, model.kernel_prefill_work)
        d += j
    adapters = len({w.adapter for w in works if w.adapter is not None})
    best_effort_reads = (best_effort.adapted + chunk) / ADAPTER_ROWS_PER_BLOCK + 1 if best_effort.adapted else 0.0
    return StepCost(fixed, c, d, b, e, f, g, h, k, j, x, model, best_effort.seqs, best_effort.context,
                    model.adapter_block_s, best_effort_reads if not adapters else best_effort_reads + adapters)


@dataclass
class Decoding:
    """The requests past their prefill: when each finishes (in steps), and the sums that give the
    positions the batch reads at any step without visiting each request. A request at context
    ``final - (end - step)`` reads at most ``share · (final - (end - step)) + window`` (``Work.
    whole_share``, ``Work.window_reads``): its whole-context groups follow its context, its sliding
    groups are charged what they read at its final context."""

    ends: list = field(default_factory=list)  # heap of (end step, index)
    final_sum: float = 0  # Σ share · final context
    end_sum: float = 0  # Σ share · end step
    share_sum: float = 0  # Σ share
    window_sum: float = 0  # Σ window reads
    adapted: int = 0  # of them, under LoRA adapters

    def join(self, index: int, end_step: int, work, adapted: bool = False) -> None:
        heapq.heappush(self.ends, (end_step, index))
        self.add(work, end_step, 1)
        self.adapted += adapted

    def add(self, work, end_step: int, sign: int) -> None:
        share = work.whole_share
        self.final_sum += sign * share * work.final_context
        self.end_sum += sign * share * end_step
        self.share_sum += sign * share
        self.window_sum += sign * work.window_reads

    def context_at(self, step: int) -> float:
        return self.final_sum - self.end_sum + self.share_sum * step + self.window_sum

    def next_end(self) -> float:
        return self.ends[0][0] if self.ends else math.inf


@dataclass
class PrefillQueue:
    """Prefill left, in the order the scheduler gives it budget: ``order`` indexes ``works``."""

    order: list[int]
    left: list[int]
    head: int = 0

    def steps_to_next_done(self, per_step: int) -> float:
        if self.head >= len(self.order) or per_step <= 0:
            return math.inf
        return math.ceil(self.left[self.order[self.head]] / per_step)

    def take(self, tokens: int) -> list[tuple[int, int, bool]]:
        """Run ``tokens`` prefill tokens in order: ``(index, tokens it got, its prefill is done)``."""
        taken = []
        while tokens > 0 and self.head < len(self.order):
            index = self.order[self.head]
            got = min(self.left[index], tokens)
            self.left[index] -= got
            tokens -= got
            taken.append((index, got, self.left[index] == 0))
            self.head += self.left[index] == 0
        return taken


@dataclass
class Plan:
    """The schedule run forward: fitted seconds elapsed at the end of step ``step``."""

    works: list
    cost: StepCost
    budget: "TokenBudget"
    decoding: Decoding = field(default_factory=Decoding)
    finish_seconds: list = field(default_factory=list)
    step: int = 0
    seconds: float = 0.0
    first_step_seconds: float = 0.0  # at least the first step's: one step of the first segment with all its prefill

    def run(self, queue: PrefillQueue) -> list[float]:
        while True:
            per_step = self.budget.prefill_per_step(len(self.decoding.ends))
            steps = min(queue.steps_to_next_done(per_step), self.decoding.next_end() - self.step)
            if steps == math.inf:
                return self.finish_seconds
            self.segment(queue, int(steps), per_step)

    def segment(self, queue: PrefillQueue, steps: int, per_step: int) -> None:
        """``steps`` alike steps; then the requests whose prefill is done decode, and those done leave."""
        end = self.step + steps
        taken = queue.take(steps * max(per_step, 0))
        prefill = sum(got for _, got, _ in taken)
        attention = sum(got * self.works[i].reads(self.attends(i)) for i, got, _ in taken)
        context = self.decoding.context_at(end) + sum(self.works[i].reads(self.attends(i), min(got, per_step) - 1)
                                                      for i, got, _ in taken)
        seqs = len(self.decoding.ends) + len(taken)
        adapted = [(i, got) for i, got, _ in taken if self.works[i].adapter is not None]
        def seconds(count: int) -> float:
            return self.cost.segment_seconds(count, seqs, context, prefill, attention,
                                             self.may_run_op_by_op(taken, per_step),
                                             self.decoding.adapted + len(adapted), sum(g for _, g in adapted))

        if self.step == 0:
            self.first_step_seconds = seconds(1)
        self.seconds += seconds(steps)
        self.step = end
        self.leave_at(end)
        for index, _, done in taken:
            if done:
                self.start_decoding(index, first_sampled_by_prefill(self.works[index]))

    def may_run_op_by_op(self, taken: list[tuple[int, int, bool]], per_step: int) -> bool:
        """Whether a step of the segment may pass the CPU kernel's limits: its chunk (at most
        ``per_step`` tokens, and the best-effort chunk) at the widest context the chunk attends to."""
        if not taken:
            return False
        tokens = min(per_step, sum(got for _, got, _ in taken)) + self.budget.best_effort_chunk
        widest = max(self.attends(i) for i, _, _ in taken)
        return runs_op_by_op(StepFeatures(tokens, 0, 0, tokens * widest), self.cost.model.kernel_limits)

    def attends(self, index: int) -> int:
        """The most positions a prefill chunk of ``works[index]`` attends to: all but the tokens
        its decode steps still add."""
        work = self.works[index]
        return work.final_context - work.decode_left

    def start_decoding(self, index: int, sampled: int = 0) -> None:
        """``sampled``: the step that ended its prefill sampled one of its ``decode_left`` tokens."""
        work = self.works[index]
        if work.decode_left - sampled == 0:
            self.finish_seconds[index] = self.seconds
        else:
            self.decoding.join(index, self.step + work.decode_left - sampled, work, work.adapter is not None)

    def leave_at(self, step: int) -> None:
        decoding = self.decoding
        while decoding.ends and decoding.ends[0][0] <= step:
            end, index = heapq.heappop(decoding.ends)
            decoding.add(self.works[index], end, -1)
            decoding.adapted -= self.works[index].adapter is not None
            self.finish_seconds[index] = self.seconds


def prefill_order(works: list) -> list[int]:
    """Running prefills first, then waiting ones, each by deadline (``works`` is EDF-sorted)."""
    pending = [i for i, w in enumerate(works) if w.prefill_left > 0]
    return sorted(pending, key=lambda i: not works[i].running)


@dataclass
class TokenBudget:
    """What a step leaves admitted prefill: ``max_num_batched_tokens`` less one token per decoding
    sequence (admitted and best effort: decodes are served first) and the best-effort chunk (a
    running best-effort prefill is served before a waiting request is seated), no more than the
    pace cap less that chunk."""

    tokens: int
    cap: int
    best_effort_seqs: int
    best_effort_chunk: int

    def prefill_per_step(self, decoding: int) -> int:
        by_budget = self.tokens - decoding - self.best_effort_seqs - self.best_effort_chunk
        return min(by_budget, self.cap - self.best_effort_chunk)


def schedule_bounds(works: list, model: LatencyModel, token_budget: int, now: float, best_effort,
                    busy_s: float = 0.0, best_effort_chunk: int = 0, after_idle: bool = False,
                    follow_last_step: bool = False, prefill_cap: int | None = None) -> list[float]:
    """Upper bounds on finish times, in the order of ``works`` (EDF-sorted ``Work``), with the
    arguments of ``finish_bounds`` (``best_effort`` a ``BestEffortLoad``); ``prefill_cap``: the pace
    cap on a step's prefill tokens. ``math.inf`` for a request the plan never reaches."""
    chunk = best_effort_chunk if best_effort.longest_pending else 0
    budget = TokenBudget(token_budget, prefill_cap or token_budget, best_effort.seqs, chunk)
    plan = Plan(works, step_cost(model, best_effort, best_effort_chunk, works), budget)
    plan.finish_seconds = [UNREACHED] * len(works)
    for index, work in enumerate(works):
        if work.prefill_left == 0:
            plan.start_decoding(index)
    seconds = plan.run(PrefillQueue(prefill_order(works), [w.prefill_left for w in works]))
    multiplier = model.bound_multiplier(follow_last_step and not after_idle)
    first_step = model.after_idle_charge(plan.first_step_seconds) if after_idle else 0.0
    counts = step_counts(works, prefill_cap or token_budget, best_effort.seqs)
    return [now + busy_s + multiplier * s + model.reserve(steps - after_idle, multiplier * s / max(steps, 1))
            + first_step for s, (_, steps) in zip(seconds, counts)]


def step_counts(works: list, token_budget: int, best_effort_rows: int = 0) -> list[tuple[int, int]]:
    """For each request (EDF-sorted ``Work``), at most how many steps until its prefill is done and
    until it finishes: the prefill of it and of everything ahead (running prefills are served before
    waiting ones, whatever their deadlines) in chunks of ``token_budget`` less
    the rows that may decode beside it (the scheduler seats decodes first, one token of the budget
    each: every request with a decode step past the one its prefill samples, and the
    ``best_effort_rows``), then its decode steps, the first of which its last prefill step samples.
    Whatever shares a step, no schedule takes more, so a request this puts at one step is served by one."""
    counts, running_ahead, waiting_ahead = [], 0, 0
    running_all = sum(w.prefill_left for w in works if w.running)
    decoding = sum(1 for w in works if w.decode_left - first_sampled_by_prefill(w) > 0) + best_effort_rows
    per_step = max(token_budget - decoding, 1)
    for work in works:
        if work.running:
            running_ahead += work.prefill_left
        else:
            waiting_ahead += work.prefill_left
        prefill_ahead = running_ahead if work.running else running_all + waiting_ahead
        prefill_steps = math.ceil(prefill_ahead / per_step)
        counts.append((prefill_steps, prefill_steps + work.decode_left - first_sampled_by_prefill(work)))
    return counts


def first_sampled_by_prefill(work) -> int:
    """1 when the step that ends a request's prefill samples its next token (then one decode step
    fewer is left), else 0."""
    return int(work.prefill_left > 0 and work.decode_left > 0)
