"""A scheduled batch laid out flat, as plain lists: what both runtimes' runners turn into arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

from ricllm.engine.scheduler import ScheduledBatch


@dataclass
class FlatBatch:
    """``T`` tokens of ``B`` sequences (names as in ``AttentionMetadata``)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]  # B + 1
    context_lens: list[int]
    block_tables: list[list[int]]  # B rows, padded with 0 to the widest
    logits_rows: list[int]  # the flat rows whose logits are sampled
    max_query_len: int
    prefill_rows: int
    prefill_products: int
    kv_sinks: list[int] | None = None  # per sequence, when one of them keeps a window (window 0: exact)
    kv_windows: list[int] | None = None
    # (start row, end row, adapter slot): consecutive sequences of one slot share a segment; rows of
    # sequences without an adapter lie in none. Empty when no sequence has one.
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)
    # cache groups 1.. of a hybrid model: each group's slots and block tables, as ``slot_mapping`` and
    # ``block_tables`` are group 0's (``ricllm.cache.kv_groups``)
    group_slot_mappings: list[list[int]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)


def flatten(batch: ScheduledBatch, block_size: int) -> FlatBatch:
    """A sequence gets logits only when this step computes its last known token (decode, or the
    final chunk of a prefill); earlier prefill chunks only fill the cache."""
    input_ids, positions, slots, starts, context_lens, logits_rows = [], [], [], [0], [], []
    for seq, num_new in batch.items:
        start = seq.num_computed_tokens
        end = start + num_new
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += _slots(seq.block_table, start, end, block_size)
        starts.append(starts[-1] + num_new)
        context_lens.append(end)
        if end == seq.num_tokens:
            logits_rows.append(starts[-1] - 1)
    seqs = [seq for seq, _ in batch.items]
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    num_groups = len(seqs[0].group_tables)
    group_tables = [[s.group_tables[g] + [0] * (width - len(s.group_tables[g])) for s in seqs]
                    for g in range(num_groups)]
    group_slots = [[slot for seq, num_new in batch.items
                    for slot in _slots(seq.group_tables[g], seq.num_computed_tokens,
                                       seq.num_computed_tokens + num_new, block_size)]
                   for g in range(num_groups)]
    windowed = any(s.kv_window is not None for s in seqs)
    return FlatBatch(
        input_ids, positions, slots, starts, context_lens, tables, logits_rows,
        max_query_len=max(n for _, n in batch.items),
        prefill_rows=sum(n for _, n in batch.items if n > 1),
        prefill_products=sum(n * length for (_, n), length in zip(batch.items, context_lens) if n > 1),
        kv_sinks=[s.kv_window.sinks if s.kv_window else 0 for s in seqs] if windowed else None,
        kv_windows=[s.kv_window.window if s.kv_window else 0 for s in seqs] if windowed else None,
        lora_segments=_lora_segments(batch, starts), group_slot_mappings=group_slots, group_block_tables=group_tables)


def _lora_segments(batch: ScheduledBatch, starts: list[int]) -> list[tuple[int, int, int]]:
    segments: list[tuple[int, int, int]] = []
    for (seq, _), start, end in zip(batch.items, starts, starts[1:]):
        if seq.adapter is None or start == end:
            continue
        if segments and segments[-1][1] == start and segments[-1][2] == seq.adapter.slot:
            segments[-1] = (segments[-1][0], end, seq.adapter.slot)
        else:
            segments.append((start, end, seq.adapter.slot))
    return segments


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
