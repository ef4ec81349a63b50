"""Which admitted request computes which prompt blocks, so that a burst of one prompt is prefilled once.

Cells at the same levels send the same prompt in the same moment. Of admitted requests whose prompts
share full blocks that nobody has computed yet, the one due first computes them (their owner); the
others (its followers) take them from it:

- admission charges a follower only the rest of its prompt, and not before the step after its
  owner's prefill is done (``schedule_bound``);
- the scheduler does not seat a follower while its owner has not computed those blocks
  (``Sequence.waits_for_owner``), and lets the requests behind it start only whole prefills then;
- after the step that caches them, the follower holds them (``KVCacheManager.extend_held_prefix``).

Promised requests only (they are never preempted, so an owner's prefill does happen), on a cache of
one group, without a request's own KV window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.sequence import Sequence


@dataclass(frozen=True)
class PrefixShare:
    owner: Sequence
    tokens: int  # the follower's leading prompt tokens, whole blocks, held or taken from the owner


class PrefixOwners:
    """Invariant: ``computes[h]`` is the first-admitted unfinished promised request that computes the full
    prompt block of chained hash ``h`` itself (neither held at its admission nor taken from an owner)."""

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.computes: dict[int, Sequence] = {}
        self._chains: dict[str, list[int]] = {}  # registered requests' prompt block hashes
        self._asking: tuple[Sequence, list[int]] | None = None  # the last request asked about, and its hashes

    def share_for(self, seq: Sequence, held_blocks: int) -> PrefixShare | None:
        """The owner of ``seq``'s prompt blocks past its ``held_blocks``, due no later than ``seq``, and
        how far ``seq``'s prompt runs on its blocks; None when nobody pending computes the next one."""
        if not self._shareable(seq):
            return None
        chain = self._chain(seq)
        self._asking = (seq, chain)
        if held_blocks >= len(chain):
            return None
        owner = self.computes.get(chain[held_blocks])
        if owner is None or (owner.deadline, owner.arrival_time) > (seq.deadline, seq.arrival_time):
            return None
        end = held_blocks
        while end < len(chain) and self.computes.get(chain[end]) is owner:
            end += 1
        return PrefixShare(owner, end * self.cache.block_size)

    def add(self, seq: Sequence) -> None:
        """A promised request, just admitted: it computes its prompt's blocks past what it holds and takes."""
        if not self._shareable(seq):
            return
        chain = self._chains[seq.request_id] = self._chain(seq)
        self._asking = None
        first = max(seq.prefix_hit_tokens, seq.pinned_prefix_tokens, seq.shared_prefix_tokens) // self.cache.block_size
        for block_hash in chain[first:]:
            self.computes.setdefault(block_hash, seq)

    def remove(self, seq: Sequence) -> None:
        """It ended (or was refused): it computes nothing more."""
        for block_hash in self._chains.pop(seq.request_id, ()):
            if self.computes.get(block_hash) is seq:
                del self.computes[block_hash]

    def _shareable(self, seq: Sequence) -> bool:
        return (self.cache.enable_prefix_caching and not self.cache.group_windows and seq.kv_window is None
                and seq.deadline is not None)

    def _chain(self, seq: Sequence) -> list[int]:
        if self._asking is not None and self._asking[0] is seq:
            return self._asking[1]
        full = (seq.num_prompt_tokens - 1) // self.cache.block_size  # the last token is always computed
        return self.cache.hash_chain(seq.token_ids, full, seq.adapter)
