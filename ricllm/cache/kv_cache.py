"""The KV store: one K and one V tensor per slot, allocated once from the byte budget.

    bytes_per_block = 2 · L_g · block_size · n_kv · (d_h · b + s)   (s: an int8 row's scale, else 0)
    num_blocks      = budget // bytes_per_block

``L_g`` is the layers of one cache group (``ricllm.cache.kv_groups``): every layer for the Llama
family (one slot per layer), three for Gemma 3 270M, whose six groups (one of full-attention
layers, five of sliding-window layers) share the pool block by block. Layer ``i`` reads and writes
slot ``layer_slots[i]`` through its group's block table.

These tensors are the only KV storage the engine ever holds; nothing grows after start-up.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ricllm.cache.kv_format import KVFormat
from ricllm.cache.kv_groups import KVCacheGroup, group_size, kv_cache_groups, layer_slots
from ricllm.errors import ConfigError
from ricllm.kernels.aligned import aligned_zeros
from ricllm.model.spec import ModelSpec
from ricllm.units import format_bytes

PAGE_BYTES = mmap.PAGESIZE

if TYPE_CHECKING:  # the torch runtime's store; the native one (``NativeKVCache``) is numpy
    import torch


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int
    kv_format: KVFormat
    groups: tuple[KVCacheGroup, ...] = ()  # empty: one group of every layer

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds in one group's blocks: the tokens of one sequence of a one-group cache."""
        return self.num_blocks * self.block_size

    @property
    def allocated_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_cache(spec: ModelSpec, budget_bytes: int, block_size: int, kv_format: KVFormat) -> CacheGeometry:
    """Blocks of ``kv_format`` rows that fit the budget; an error when not even one does."""
    if block_size < 1:
        raise ConfigError(f"block_size must be at least 1, got {block_size}")
    groups = kv_cache_groups(spec)
    per_token = kv_format.bytes_per_token(spec) * group_size(groups) // spec.num_layers
    bytes_per_block = per_token * block_size
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below one block: "
            f"a block of {block_size} {kv_format.name} tokens needs {bytes_per_block} B "
            f"(block_size·{kv_format.equation(spec, group_size(groups))} = {block_size}·{per_token})")
    return CacheGeometry(num_blocks, block_size, bytes_per_block, budget_bytes, kv_format,
                         groups if len(groups) > 1 else ())


def store_slots(spec: ModelSpec, geometry: CacheGeometry) -> tuple[int, list[int]]:
    """The store's (K, V) slots, and each layer's slot."""
    if not geometry.groups:
        return spec.num_layers, list(range(spec.num_layers))
    return group_size(geometry.groups), layer_slots(geometry.groups, spec.num_layers)


def cache_shape(spec: ModelSpec, geometry: CacheGeometry) -> tuple[int, int, int, int]:
    """One layer's K (or V): ``[num_blocks, block_size, n_kv, d_h]``, or ``d_h + 4`` bytes per int8 row."""
    last = geometry.kv_format.row_bytes(spec.head_dim) if geometry.kv_format.quantized else spec.head_dim
    return geometry.num_blocks, geometry.block_size, spec.num_kv_heads, last


class KVCache:
    """``layers[i] = (k, v)``, each ``[num_blocks, block_size, n_kv_heads, head_dim]`` in ``dtype``, or
    raw bytes ``uint8 [..., head_dim + 4]`` for an int8 pool (``ricllm.cache.kv_format``): layer
    ``i``'s slot (layers of different groups at one place in their groups share a slot, each through
    its own group's blocks).

    The whole budget is allocated and zeroed at start. The pages are resident from then on, so a
    node short of memory fails at start rather than under load. Zeros, not garbage, sit in the
    slots no step has written yet.
    """

    def __init__(self, spec: ModelSpec, geometry: CacheGeometry, dtype: torch.dtype, device: torch.device):
        import torch

        shape = cache_shape(spec, geometry)
        dtype = torch.uint8 if geometry.kv_format.quantized else dtype
        self.geometry = geometry
        num_slots, slot_of_layer = store_slots(spec, geometry)
        self.slots = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_slots)
        ]
        self.layers = [self.slots[slot] for slot in slot_of_layer]

    def total_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.slots)


class NativeKVCache:
    """The native runtime's store: the same shapes and invariants as ``KVCache``, one numpy array
    for the whole pool (bf16 as uint16 bit patterns, int8 rows as bytes), ``layers[i] = (k, v)``
    views into it, starting on a cache line (``ricllm.kernels.aligned``: numpy's own start is 16
    bytes off one, which cost the paged attention ~15% at 32 streams).
    Every page is written at start (zeroed memory alone would leave them unmapped until a step
    touches them), so a node short of memory fails at start here too. One byte per page does
    it: the pages come zeroed from the system (filling them all again takes twice as long)."""

    def __init__(self, spec: ModelSpec, geometry: CacheGeometry):
        shape = cache_shape(spec, geometry)
        self.geometry = geometry
        num_slots, slot_of_layer = store_slots(spec, geometry)
        self.pool = aligned_zeros((num_slots, 2, *shape), np.uint8 if geometry.kv_format.quantized else np.uint16)
        pool_bytes = self.pool.reshape(-1).view(np.uint8)
        pool_bytes[::PAGE_BYTES] = 0
        pool_bytes[-1:] = 0  # the pool starts inside a page (on a cache line), so its last page may be after the stride
        self.slots = [(self.pool[i, 0], self.pool[i, 1]) for i in range(num_slots)]
        self.layers = [self.slots[slot] for slot in slot_of_layer]

    def total_bytes(self) -> int:
        return self.pool.nbytes
