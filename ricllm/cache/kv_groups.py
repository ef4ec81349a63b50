"""KV cache groups: a model's layers grouped by attention type, all served from one pool of blocks.

A group is a set of layers that attend alike: every layer sees the whole sequence (``window``
0), or every layer sees the last ``window`` tokens (a sliding-window layer, Gemma 3's local
layers). Each sequence has one block table per group; a block belongs to one group at a time.

Invariants
- Every group has the same number of layers, ``group_size`` (the greatest common divisor of the
  counts of each attention type), so a block holds ``2·group_size·block_size·n_kv`` rows whichever
  group takes it: the pool's blocks are of equal bytes and any free block serves any group.
- The KV store holds ``group_size`` (K, V) slots; the ``j``-th layer of every group reads and
  writes slot ``j``, through its own group's block table, so no two groups touch one block.
- Full-attention groups come first; group 0 is the one whose block table is ``Sequence.block_table``
  and carries the prefix-cache hashes and a request's own ``kv_window`` (a model without
  full-attention layers has a sliding-window group 0, which then keeps the whole sequence: correct,
  not the least memory). A model whose layers all
  attend alike (the Llama family) is one group of every layer: one slot per layer, exactly the
  store and tables of a cache without groups.
- A sliding-window group keeps, of each sequence, only the blocks a later query of its window can
  read (``ricllm.kv_window``); its older blocks go back to the pool as the sequence advances.

    M_KV = Σ_groups 2·L_g·n_kv·d_h·b·tokens_g     tokens_g ≤ window + chunk for a sliding group
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ricllm.model.spec import ModelSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that attend alike, each with its slot in the store: ``layers[j]`` uses slot ``j``."""

    layers: tuple[int, ...]
    window: int  # 0: the layers attend to the whole sequence; else their sliding window in tokens

    @property
    def sliding(self) -> bool:
        return self.window > 0


def kv_cache_groups(spec: ModelSpec) -> tuple[KVCacheGroup, ...]:
    """The model's groups: full-attention layers first, then each window's layers, in layer order,
    cut into groups of ``group_size`` layers."""
    by_window: dict[int, list[int]] = {}
    for layer in range(spec.num_layers):
        by_window.setdefault(spec.layer_window(layer), []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    groups = []
    for window in sorted(by_window):  # 0 (full attention) first
        layers = by_window[window]
        groups += [KVCacheGroup(tuple(layers[i:i + size]), window) for i in range(0, len(layers), size)]
    return tuple(groups)


def group_size(groups: tuple[KVCacheGroup, ...]) -> int:
    """Layers per group (the same in every group): the store's number of (K, V) slots."""
    return len(groups[0].layers)


def layer_slots(groups: tuple[KVCacheGroup, ...], num_layers: int) -> list[int]:
    """Each layer's slot in the store."""
    slots = [0] * num_layers
    for group in groups:
        for slot, layer in enumerate(group.layers):
            slots[layer] = slot
    return slots


def layer_groups(groups: tuple[KVCacheGroup, ...], num_layers: int) -> list[int]:
    """Each layer's group index."""
    index = [0] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layers:
            index[layer] = g
    return index


def sliding_windows(groups: tuple[KVCacheGroup, ...]) -> tuple[int, ...]:
    """The windows of groups 1.. (what ``Sequence.group_windows`` is made from); 0 where a later
    group attends to the whole sequence."""
    return tuple(group.window for group in groups[1:])
