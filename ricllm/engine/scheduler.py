"""Continuous batching: every step, running sequences continue and waiting ones join.

Each step has a token budget (``max_num_batched_tokens``) shared by decode tokens (one per
running sequence) and prefill chunks (a long prompt is split over several steps). Running
sequences are served first, oldest first; when the pool cannot give a running sequence its next
block, the newest running sequence is preempted (its blocks freed, to be recomputed later,
mostly from the prefix cache). Waiting sequences join in arrival order while blocks, budget and
``max_num_seqs`` allow. Nothing is ever allocated beyond the pool, and since every request was
checked to fit the pool alone, the oldest running sequence can always progress: no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class StepFeatures:
    """The inputs of the step-latency model."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int  # Σ over the batch of the positions each sequence attends to
    prefill_attention: int = 0  # Σ over prefill chunks of chunk length × positions attended


@dataclass
class ScheduledBatch:
    """The step's work: ``(sequence, number of its tokens to compute)``, in batch order."""

    items: list[tuple[Sequence, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def features(self) -> "StepFeatures":
        """What the step costs: prefill tokens, decode sequences, and K/V positions read."""
        prefill = decode = context = attention = 0
        for seq, num_new in self.items:
            is_decode = num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            attended = seq.num_computed_tokens + num_new
            decode += is_decode
            context += attended
            if not is_decode:
                prefill += num_new
                attention += num_new * attended
        return StepFeatures(prefill, decode, context, attention)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_waits = 0  # steps on which a waiting sequence could not get blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items, preempted = self._schedule_running(budget)
        budget -= sum(n for _, n in items)
        if not preempted:
            items += self._schedule_waiting(budget)
        return ScheduledBatch(items)

    def _schedule_running(self, budget: int) -> tuple[list[tuple[Sequence, int]], bool]:
        items: list[tuple[Sequence, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.cache.allocate(seq, num_new):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                items.append((seq, num_new))
                budget -= num_new
                index += 1
        return items, preempted

    def _schedule_waiting(self, budget: int) -> list[tuple[Sequence, int]]:
        items: list[tuple[Sequence, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.cache.find_cached_prefix(seq.token_ids) if seq.num_computed_tokens == 0 else []
            num_new = min(seq.num_tokens - len(hits) * self.cache.block_size, budget)
            if not self.cache.allocate(seq, num_new, hits):
                self.num_waits += 1
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append((seq, num_new))
            budget -= num_new
        return items

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue first: it resumes by recomputing prompt + outputs."""
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        if seq.pin_on_finish is not None:
            self.cache.pin(seq, seq.pin_on_finish)
        self.cache.free(seq)
