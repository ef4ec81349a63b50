"""Continuous batching: every step, running sequences continue and waiting ones join.

Each step has a token budget (``max_num_batched_tokens``) shared by decode tokens (one per
running sequence, served first so no running sequence skips a step) and prefill chunks (a long
prompt is split over several steps), in priority order: earliest deadline first, then
best-effort requests first come first served. With admission, the prefill part is further
capped so running deadline decodes keep their pace (``AdmissionController.prefill_token_cap``).
When the pool cannot give a sequence its next block, best-effort sequences are preempted newest
first (their blocks freed, to be recomputed later, mostly from the prefix cache); with admission
on, a promised (deadline) sequence is never preempted, because admission reserved its worst
case. Nothing is ever allocated beyond the pool, and since every request was checked to fit the
pool alone, the oldest running sequence can always progress: no deadlock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.kv_window import mean_positions_read
from ricllm.sequence import Sequence, SequenceStatus

NEVER = float("inf")
# rows of one adapter the CPU LoRA kernel updates per read of its weights (ROWS_AT_ONCE, kernels/cpu_lora.c)
ADAPTER_ROWS_PER_BLOCK = 4


@dataclass(frozen=True)
class StepFeatures:
    """The inputs of the step-latency model.

    Context and attention are counted per KV cache group (``ricllm.cache.kv_groups``) and averaged
    over the groups, which have as many layers each: a sliding-window group's layers read at most
    their window, a full-attention group's the whole context (``kv_window.mean_positions_read``).
    With one group of every layer (the Llama family) they are the positions each sequence attends
    to. The LM head is a term of its own: the rows it computes, each counted by the share of the
    vocabulary's columns computed (a whole row 1; a row of the k-wide constrained head its tiles'
    share)."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: float  # Σ over the batch of the K/V positions read, averaged over the cache groups
    prefill_attention: float = 0  # Σ over prefill chunks of chunk length × positions read, averaged alike
    adapter_blocks: int = 0  # Σ over the step's adapters of ⌈its rows / ADAPTER_ROWS_PER_BLOCK⌉: reads of their weights
    head_rows: float | None = None  # None: one whole row per decode sequence
    # Σ over prefill chunks of chunk length × positions attended, every layer whole: the measure the
    # runtime's kernel limits are stated in (None: ``prefill_attention``)
    prefill_products: int | None = None

    def __post_init__(self) -> None:
        if self.head_rows is None:
            object.__setattr__(self, "head_rows", self.num_decode_seqs)
        if self.prefill_products is None:
            object.__setattr__(self, "prefill_products", self.prefill_attention)


@dataclass
class ScheduledBatch:
    """The step's work: ``(sequence, number of its tokens to compute)``, in batch order."""

    items: list[tuple[Sequence, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def pins_only(self) -> bool:
        """Every sequence in the step is computing a prefix to pin: no request is served by it."""
        return all(seq.pin_on_finish is not None for seq, _ in self.items)

    def features(self) -> "StepFeatures":
        """What the step costs: prefill tokens, decode sequences, K/V positions read (per cache
        group), the head's rows (each sequence that samples: a whole row, until the runner says
        how much of the head it computed) and the reads of LoRA adapters' weights."""
        prefill = decode = products = head = context = attention = 0
        adapter_rows: dict[int, int] = {}
        for seq, num_new in self.items:
            if seq.adapter is not None:
                adapter_rows[seq.adapter.slot] = adapter_rows.get(seq.adapter.slot, 0) + num_new
            is_decode = num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            attended = seq.num_computed_tokens + num_new
            reaches = seq.group_reaches
            decode += is_decode
            head += attended == seq.num_tokens
            context += mean_positions_read(attended, reaches, num_new - 1)
            if not is_decode:
                prefill += num_new
                attention += num_new * mean_positions_read(attended, reaches)
                products += num_new * attended
        blocks = sum(-(-rows // ADAPTER_ROWS_PER_BLOCK) for rows in adapter_rows.values())
        return StepFeatures(prefill, decode, context, attention, blocks, head, products)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """``gate`` is the admission controller (None: plain continuous batching, everything FCFS)."""

    def __init__(self, cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, gate=None,
                 jump_forward: bool = True, order: str = "edf"):
        self.jump_forward = jump_forward  # off: known output tokens (forced ones) are computed one per step
        # edf: promised requests by deadline, then other deadlines, then best effort by arrival; fcfs: arrival
        self.order_key = Sequence.arrival_key if order == "fcfs" else Sequence.priority_key
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gate = gate
        self.waiting: list[Sequence] = []  # kept in priority order
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_waits = 0  # steps on which a waiting sequence could not get blocks
        self._best_effort_left: int | None = None  # best-effort prefill tokens the step may still take
        self._best_effort_work_left = 0  # and the attention work (chunk x positions) they may still do
        self.num_paused_steps = 0  # steps some best effort sat out so that admitted requests stay on time
        self.num_rescue_prefill_steps = 0  # steps whose prefill ran only for admitted requests at risk
        self._prefill_until = NEVER  # during a rescue: only promised requests due by then prefill

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self.order_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float = 0.0) -> ScheduledBatch:
        """Decodes first (one token each, so no running sequence misses a step), then prefill
        chunks in priority order, then waiting sequences while budget, blocks and seats last.

        With a gate, the prefill tokens of a step are capped so that the running decodes keep
        the pace their deadlines need (``gate.prefill_token_cap``), and when an admitted request's
        bound has slipped past its deadline (the machine slowed down) the gate's rescue applies:
        best-effort sequences sit the step out (paused, not preempted), and if that is not enough
        only the requests at risk, and those due before them, prefill.
        """
        self._seat_promises()
        order = self._apply_rescue(sorted(self.running, key=self.order_key), now)
        items: list[tuple[Sequence, int]] = []
        budget, preempted = self._continue([s for s in order if s.in_decode], self.max_num_batched_tokens, items)
        prefilling = [s for s in order if not s.in_decode and self._may_prefill(s)]
        if self.gate is not None and budget > 0 and (prefilling or self.waiting):
            first = (prefilling or self.waiting)[0]
            budget = min(budget, self.gate.prefill_token_cap(now, [s for s, _ in items], first, budget,
                                                             self._running_best_effort()))
        budget, more_preempted = self._continue(prefilling, budget, items)
        if not (preempted or more_preempted) or not items:  # a step never stays empty while requests wait
            seated = self._schedule_waiting(budget, now)
            # a promise seated now may have preempted best effort this step already carried: it leaves the step
            items = [(s, n) for s, n in items if s.status is SequenceStatus.RUNNING] + seated
        return ScheduledBatch(_by_adapter(items))

    def _apply_rescue(self, order: list[Sequence], now: float) -> list[Sequence]:
        """Set the step's best-effort allowance; drop the sequences a rescue pauses from ``order``."""
        self._best_effort_left = self.gate.best_effort_prefill_allowance() if self.gate is not None else None
        self._best_effort_work_left = self.gate.best_effort_work_allowance() if self.gate is not None else NEVER
        self._prefill_until = NEVER
        rescue = self.gate.rescue(now, self._running_best_effort()) if self.gate is not None else None
        if rescue is None:
            return order
        self._best_effort_left = 0  # nothing new from best effort while a promise is at risk
        self.num_paused_steps += bool(rescue.paused)
        if rescue.prefill_until is not None:
            self._prefill_until = rescue.prefill_until
            self.num_rescue_prefill_steps += 1
        paused = set(rescue.paused)
        return [s for s in order if s not in paused]

    def _may_prefill(self, seq: Sequence) -> bool:
        return not seq.promised or seq.deadline <= self._prefill_until

    def _continue(self, seqs: list[Sequence], budget: int, items: list) -> tuple[int, bool]:
        """Schedule running sequences in order while the budget lasts; appends to ``items``."""
        preempted = False
        for seq in seqs:
            if budget <= 0:
                break
            if seq not in self.running:
                continue  # preempted earlier in this step
            num_new = self._chunk(seq, min(seq.num_uncomputed_tokens, budget), start=seq.num_computed_tokens)
            num_new = self._hold_best_effort(seq, num_new, start=seq.num_computed_tokens)
            if num_new == 0:
                continue
            if self._allocate_or_preempt(seq, num_new, {s for s, _ in items}):
                items.append((seq, num_new))
                budget -= num_new
            else:
                preempted = True
        return budget, preempted

    def _chunk(self, seq: Sequence, num_new: int, start: int) -> int:
        """Without jump-forward, output tokens are computed one per step, as if each were decoded
        (``start``: the first position this step computes, past any prefix-cache hit)."""
        if self.jump_forward:
            return num_new
        return min(num_new, max(seq.num_prompt_tokens - start, 1))

    def _hold_best_effort(self, seq: Sequence, num_new: int, start: int) -> int:
        """A best-effort prefill chunk, while promises are in flight, within the step's allowance
        and the attention work the admission bound charges for it (0: not this step)."""
        if seq.promised or self._best_effort_left is None or (num_new == 1 and seq.in_decode):
            return num_new
        num_new = self.gate.best_effort_prefill_cap(start, min(num_new, self._best_effort_left),
                                                    self._best_effort_work_left)
        self._best_effort_left -= num_new
        self._best_effort_work_left -= num_new * (start + num_new)
        return num_new

    def _running_best_effort(self) -> list[Sequence]:
        return [s for s in self.running if not s.promised]

    def _schedule_waiting(self, budget: int, now: float) -> list[tuple[Sequence, int]]:
        items: list[tuple[Sequence, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not (self._best_effort_may_join(seq, now) if not seq.promised else self._may_prefill(seq)):
                break
            hits = (self.cache.find_cached_prefix(seq.token_ids, seq.adapter, seq.group_windows)
                    if seq.num_computed_tokens == 0 else [])
            cached = seq.num_computed_tokens + len(hits) * self.cache.block_size  # held since admission, or hit now
            num_new = self._hold_best_effort(seq, self._chunk(seq, min(seq.num_tokens - cached, budget), start=cached),
                                             start=cached)
            if num_new == 0:
                break
            allocated = (self._allocate_or_preempt(seq, num_new, {s for s, _ in items}, hits) if seq.promised
                         else self._within_unreserved(seq, num_new, hits) and self._allocate(seq, num_new, hits))
            if not allocated:
                self.num_waits += 1
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append((seq, num_new))
            budget -= num_new
        return items

    def _seat_promises(self) -> None:
        """Promised sequences waiting for a seat (``max_num_seqs``) take those of best-effort ones,
        preempted newest first, before the step is built: admission counted seats for promises only."""
        promised_waiting = sum(1 for s in self.waiting if s.promised)
        while promised_waiting and len(self.running) > self.max_num_seqs - promised_waiting:
            victim = self._victim(exclude=set(), best_effort_only=True)
            if victim is None:
                return
            self.running.remove(victim)
            self._preempt(victim)

    def _best_effort_may_join(self, seq: Sequence, now: float) -> bool:
        if self.gate is None:
            return True
        if self._best_effort_left == 0:  # a rescue is on: best effort adds nothing this step
            return False
        return self.gate.best_effort_may_join(now, self._running_best_effort(), seq)

    def _within_unreserved(self, seq: Sequence, num_new: int, hits=()) -> bool:
        """Best effort may only take blocks that no admitted request has reserved."""
        if self.gate is None:
            return True
        return self.cache.new_blocks(seq, num_new, hits) <= self.cache.pool.num_free - self.gate.outstanding_reservation()

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, scheduled: set, hits=()) -> bool:
        """Allocate, preempting others as needed: best effort first, newest first.

        A promised sequence only ever preempts best-effort ones (its reservation guarantees
        that suffices); a best-effort one that cannot get blocks is preempted itself.
        """
        while True:
            if (seq.promised or self._within_unreserved(seq, num_new, hits)) and self._allocate(seq, num_new, hits):
                return True
            victim = self._victim(exclude=scheduled | {seq}, best_effort_only=seq.promised or self.gate is not None)
            if victim is None:
                if seq.status is SequenceStatus.RUNNING:
                    self.running.remove(seq)
                    self._preempt(seq)
                return False
            self.running.remove(victim)
            self._preempt(victim)

    def _allocate(self, seq: Sequence, num_new: int, hits=()) -> bool:
        """Blocks for ``num_new`` more tokens (after ``hits``), recorded in ``seq``; False if the pool is short."""
        grant = self.cache.allocate(seq, num_new, hits)
        if grant is not None:
            seq.take_blocks(grant)
        return grant is not None

    def _victim(self, exclude: set, best_effort_only: bool) -> Sequence | None:
        candidates = [s for s in self.running if s not in exclude and not (best_effort_only and s.promised)]
        return max(candidates, key=lambda s: (not s.promised, s.arrival_time), default=None)

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue: it resumes by recomputing prompt + outputs."""
        self.cache.free(seq)
        seq.drop_blocks()
        seq.num_computed_tokens = seq.prefix_hit_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.add(seq)
        self.num_preemptions += 1

    def take_prefixes_cached_since(self) -> None:
        """Waiting promised sequences take the blocks cached since they took their prefix at
        admission, where those continue it (``KVCacheManager.extend_held_prefix``): of a burst of one
        prompt, what the first request's prefill computed serves the others seated in later steps."""
        for seq in self.waiting:
            if seq.promised:
                grant = self.cache.extend_held_prefix(seq)
                if grant is not None:
                    seq.take_blocks(grant)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.pin_on_finish is not None:
            self.cache.pin(seq, seq.pin_on_finish)
        self.cache.free(seq)
        seq.drop_blocks()


def _by_adapter(items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """The step's rows of one adapter side by side (base-model rows first), each group in scheduling
    order: the runtime then reads each adapter's weights once per block of its rows, not once per
    request."""
    if all(seq.adapter is None for seq, _ in items):
        return items
    return sorted(items, key=lambda item: -1 if item[0].adapter is None else item[0].adapter.slot)
