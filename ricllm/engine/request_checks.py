"""What a request must be to enter the engine: well formed, within the model's context, and able
to fit the KV budget beside the pinned prefixes; and what room a new pin may take."""

from __future__ import annotations

from ricllm.cache.block_pool import Block
from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.config import EngineConfig
from ricllm.errors import CapacityError, InvalidRequestError
from ricllm.kv_window import KVWindow, group_window, most_blocks, pinned_blocks_held, window_of
from ricllm.lora_request import AdapterSlot
from ricllm.sampling_params import SamplingParams
from ricllm.units import format_bytes


class RequestChecks:
    """Each check raises ``InvalidRequestError`` (malformed) or ``CapacityError`` (can never fit)
    with a message naming the numbers; none changes anything."""

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, num_blocks: int,
                 cache: KVCacheManager) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.cache = cache

    def well_formed(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty (0 tokens)")
        for position, token in enumerate(prompt_token_ids):
            if not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token!r} at position {position} is outside the vocabulary [0, {self.vocab_size})")

    def fits(self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterSlot | None = None) -> None:
        """Raise for a prompt that can never fit the context or the KV budget (served under ``adapter``)."""
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise CapacityError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens")
        windows, block_size = self.kv_windows_of(params), self.config.block_size
        pinned, shared, _ = self.prefix_share(prompt_token_ids, adapter, windows[1:])
        needed = sum(most_blocks(total, window, block_size, self.config.max_num_batched_tokens) for window in windows)
        needed -= sum(pinned_blocks_held(shared, window, block_size) for window in windows)
        available = self.num_blocks - pinned
        if needed > available:
            raise CapacityError(
                f"request needs {needed} KV blocks ({total} tokens: prompt + max_tokens, "
                f"{block_size} tokens per block) but the KV budget of {format_bytes(self.config.kv_cache_budget)} "
                f"holds {available} blocks ({available * block_size} tokens)"
                + (f" besides {pinned} pinned blocks" if pinned else ""))

    def kv_window_of(self, params: SamplingParams) -> KVWindow | None:
        """The request's sink + window retention: its own, else the engine's (None: exact)."""
        window = self.config.kv_window if params.kv_window is None else params.kv_window
        sinks = self.config.kv_sinks if params.kv_sinks is None else params.kv_sinks
        return window_of(sinks, window)

    def kv_windows_of(self, params: SamplingParams, pinning: bool = False) -> tuple[KVWindow | None, ...]:
        """What each cache group keeps of the request, group 0 first (``kv_window.group_window``):
        the request's own window applies to the full-attention layers, and narrows the
        sliding-window layers' where it is narrower. A request that pins a template keeps every
        block until it is pinned (the pin then keeps what a hit reads)."""
        own = None if pinning else self.kv_window_of(params)
        return (own, *(None if pinning else group_window(w, own) for w in self.cache.group_windows))

    def prefix_share(self, token_ids: list[int], adapter: AdapterSlot | None = None,
                     group_windows: tuple[KVWindow | None, ...] | None = None) -> tuple[int, int, list[Block]]:
        """(blocks pinned in all, leading cached blocks of ``token_ids`` under ``adapter`` that are
        pinned, every such leading cached block: pinned or not; with several cache groups, those
        every group holds for a sequence keeping ``group_windows``)."""
        pinned_ids = {b for pin in self.cache.pins.values() for b in pin.block_ids}
        hits = self.cache.find_cached_prefix(token_ids, adapter, group_windows)
        return len(pinned_ids), sum(1 for b in hits if b.block_id in pinned_ids), hits

    def pin_fits(self, token_ids: list[int], reserved: int) -> None:
        """The one rule for room: pins may not take blocks that admitted requests reserved
        (``reserved``), nor the last free block (decoding needs one)."""
        if not token_ids:
            raise InvalidRequestError("prefix to pin is empty")
        needed = self.cache.blocks_to_pin(len(token_ids))
        room = self.num_blocks - self.cache.num_pinned_blocks - reserved - 1
        if self.cache.group_windows:  # the pinning request computes the prefix whole in every cache group
            whole = self.cache.blocks_for_tokens(len(token_ids) + 1) * (1 + len(self.cache.group_windows))
            if whole > self.num_blocks - self.cache.num_pinned_blocks:
                raise CapacityError(
                    f"pinning {len(token_ids)} tokens computes them in each of the {1 + len(self.cache.group_windows)} "
                    f"KV cache groups at once: {whole} blocks, but the pool holds "
                    f"{self.num_blocks - self.cache.num_pinned_blocks} besides {self.cache.num_pinned_blocks} pinned")
        if needed > room:
            raise CapacityError(
                f"pinning {len(token_ids)} tokens needs {needed} full KV blocks, but only {room} can be pinned "
                f"now ({self.cache.num_pinned_blocks} already pinned, {reserved} reserved by admitted requests, "
                f"one kept for decoding)")
