"""A request inside the engine: its tokens, how many have K/V in the cache, and its blocks.

Admission, the scheduler and the cache manager all hold it, so it lies below the three of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ricllm.kv_window import EVICTED, KVWindow, most_blocks, pinned_blocks_held, reach
from ricllm.lora_request import AdapterSlot
from ricllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class BlockGrant:
    """Blocks the KV cache manager grants a sequence (``KVCacheManager.allocate`` and ``hold_prefix``),
    for it to record (``Sequence.take_blocks``): ``block_ids`` go to the end of its block table in
    order, the first ``len(hit_hashes)`` of them prefix-cache hits whose K/V is computed already
    (then ``num_computed_tokens`` is what it has computed with them). ``num_cached_tokens`` is the
    prefix hit counted at its first allocation (None on later ones). ``group_block_ids[g - 1]`` go to
    the end of cache group ``g``'s table (``ricllm.cache.kv_groups``), as many as ``block_ids``,
    ``EVICTED`` at a hit's positions that group's window does not read."""

    block_ids: list[int]
    hit_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int | None = None
    num_cached_tokens: int | None = None
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(eq=False)  # identity semantics: sequences live in sets and lists by identity
class Sequence:
    """``token_ids`` = prompt + generated tokens; the first ``num_computed_tokens`` have K/V cached.

    In decode the newest sampled token is not computed yet, so ``num_tokens - num_computed_tokens``
    is 1. After a preemption ``num_computed_tokens`` drops to 0 and the whole sequence, outputs
    included, is prefilled again (mostly from the prefix cache).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float  # when it reached the engine, on the engine's clock (its one clock stamps every request)
    prompt: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    block_table: list[int] = field(default_factory=list)  # EVICTED (-1) where a window let a block go
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full computed blocks
    kv_window: KVWindow | None = None  # sink + window retention; None: every token's K/V kept
    adapter: AdapterSlot | None = None  # the LoRA adapter it is served under; None: the base model
    num_evicted_blocks: int = 0  # block_table entries the window let go
    # cache groups 1.. of a hybrid model (``ricllm.cache.kv_groups``; group 0's are the three fields
    # above): what each keeps of this sequence, its block table (as long as ``block_table``, EVICTED
    # where its window let a block go) and how many entries it let go
    group_windows: tuple[KVWindow | None, ...] = ()
    group_tables: list[list[int]] = field(default_factory=list)
    group_evicted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output_text: str = ""
    detokenizer: object = None
    generator: object = None  # a seeded torch.Generator or numpy Generator (the runtime's) for sampled requests
    pin_on_finish: object = None  # a PinHandle to fill with this sequence's full prompt blocks
    deadline: float | None = None  # absolute, on the engine clock
    reserved_blocks: int = 0  # worst-case blocks set aside by admission
    promised: bool = False  # admitted against a deadline: never preempted, never waits for memory
    pinned_prefix_tokens: int = 0  # leading prompt tokens held by pinned blocks (never recomputed)
    prefix_hit_tokens: int = 0  # leading prompt tokens cached at admission: an admitted request holds them
    guide: object = None  # a ricllm.structured.guide.Guide when the answer is constrained
    confidence: float | None = None  # a constrained answer's decision confidence so far (ricllm.structured.fallback)
    model_text: str | None = None  # the model's own answer, when its fallback replaced it
    num_forced_tokens: int = 0  # output tokens the grammar forced: appended without sampling
    num_forced_at_arrival: int = 0  # of those, the answer's forced start, prefilled with the prompt
    min_output_tokens: int = 1  # the shortest complete answer (its grammar's); degrading never goes below
    rejection: object = None  # ricllm.outputs.Rejection when admission refused it
    degradation: object = None  # ricllm.outputs.Degradation when admission shrank max_tokens
    predicted_finish: float | None = None  # the finish bound it was promised at admission (engine clock)
    promised_finish: float | None = None  # its bound at the last admission that counted it (its own or a later one's)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if len(self.group_tables) != len(self.group_windows):
            self.group_tables = [[] for _ in self.group_windows]
            self.group_evicted = [0 for _ in self.group_windows]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def windows(self) -> tuple[KVWindow | None, ...]:
        """What each cache group keeps of it, group 0 first (None: every token)."""
        return (self.kv_window, *self.group_windows)

    @property
    def group_reaches(self) -> tuple[int, ...]:
        """The most positions a query of cache groups 1.. reads (0: every position): what a step's
        layers read of it (``kv_window.mean_positions_read``)."""
        return tuple(reach(window) for window in self.group_windows)

    # the KV cache manager hands back what a sequence takes and gives up; the sequence records it

    def take_blocks(self, grant: BlockGrant) -> None:
        self.block_table += grant.block_ids
        self.block_hashes += grant.hit_hashes
        if grant.num_computed_tokens is not None:
            self.num_computed_tokens = grant.num_computed_tokens
        if grant.num_cached_tokens is not None:
            self.num_cached_tokens = grant.num_cached_tokens
        for g, block_ids in enumerate(grant.group_block_ids):
            self.group_tables[g] += block_ids
            self.group_evicted[g] += block_ids.count(EVICTED)

    def evict_blocks(self, positions: list[int]) -> None:
        """Its window let these block-table positions go (``KVCacheManager.evict_outside_window``)."""
        for i in positions:
            self.block_table[i] = EVICTED
        self.num_evicted_blocks += len(positions)

    def evict_group_blocks(self, positions: list[list[int]]) -> None:
        """The windows of cache groups 1.. let these positions go, per group
        (``KVCacheManager.evict_outside_group_windows``)."""
        for g, gone in enumerate(positions):
            for i in gone:
                self.group_tables[g][i] = EVICTED
            self.group_evicted[g] += len(gone)

    def drop_blocks(self) -> None:
        """It holds no block any more (``KVCacheManager.free`` released them)."""
        self.block_table = []
        self.block_hashes = []
        self.num_evicted_blocks = 0
        self.group_tables = [[] for _ in self.group_windows]
        self.group_evicted = [0 for _ in self.group_windows]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_held_blocks(self) -> int:
        """Blocks this sequence holds a reference on (its tables less what their windows evicted)."""
        return (len(self.block_table) - self.num_evicted_blocks
                + sum(len(t) for t in self.group_tables) - sum(self.group_evicted))

    def most_blocks(self, block_size: int, chunk: int) -> int:
        """The most blocks it can hold at once, prompt + ``max_tokens`` computed in steps of up to
        ``chunk`` tokens, summed over its cache groups: each group's every block, or what its window
        keeps resident."""
        total = self.num_prompt_tokens + self.params.max_tokens
        return sum(most_blocks(total, window, block_size, chunk) for window in self.windows)

    def pinned_blocks_held(self, pinned_hits: int, block_size: int) -> int:
        """Of its ``pinned_hits`` leading pinned blocks, those it holds at its most, summed over its
        groups (a sliding-window group's move out of its window: none counts)."""
        return sum(pinned_blocks_held(pinned_hits, window, block_size) for window in self.windows)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled (the rest of the output the grammar forced)."""
        return self.num_output_tokens - self.num_forced_tokens

    @property
    def decode_steps_left(self) -> int:
        """Steps that may still sample a token for it: the tokens left to ``max_tokens``, and for a
        constrained answer with a known bound no more than its grammar's most decisions left (forced
        tokens ride in the step of the decision before them, computed as one chunk)."""
        tokens_left = self.params.max_tokens - self.num_output_tokens
        most = self.guide.grammar.max_decisions if self.guide is not None else None
        return tokens_left if most is None else max(min(tokens_left, most - self.num_sampled_tokens), 0)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_uncomputed_tokens == 1

    def priority_key(self) -> tuple:
        """Promised (admitted) requests first, earliest deadline first; then unpromised ones with a
        deadline, earliest first; then best-effort requests, first come first served."""
        if self.deadline is None:
            return (2, self.arrival_time, 0.0)
        return (0 if self.promised else 1, self.deadline, self.arrival_time)

    def arrival_key(self) -> tuple:
        """First come first served."""
        return (self.arrival_time,)
