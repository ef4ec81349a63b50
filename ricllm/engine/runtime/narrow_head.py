"""The LM head where a constraint allows few tokens: a constrained row gets the logits of the
tokens its grammar allows next, not the vocabulary's.

A constrained row's sampler needs only its allowed tokens' logits (``sample_allowed``: the first
maximum when greedy, else one uniform draw over them in vocabulary order). The packed head is laid
out in tiles of 16 output rows (``kernels/cpu_quant_gemm.c``), so a step's constrained rows are
computed together on the union of the tiles that hold their allowed tokens
(``ricllm_quant_gemm_tiles``), and each of those logits is the whole head's, bit for bit: an
output's sums run over its own weight row and its activation row only. Unconstrained rows get the
whole head. A head that cannot promise that (a dense one, whose BLAS picks its blocking by the
product's shape; a 4-bit head whose path changes with the row count, on AMX) computes every row
whole, and its constrained rows' allowed logits are gathered from it: the sampler sees the same
thing either way.

The k-wide head is used while the union of allowed tiles is at most ``MAX_TILE_SHARE`` of the
head's tiles, scaled by the constrained rows' part of the step's sampled rows. Each tile costs
what it costs in the whole head (the same loop over the same bytes), so where every row is
constrained a narrow step saves the skipped tiles' share of the head (on SmolLM2's head, one row,
best of 60 calls on two busy cores: 0.24 of the whole head's time at a quarter of the tiles, 0.59
at half, 0.86 at three quarters; ``benchmarks/bench_constrained_head.py``); past half the saving shrinks toward the cost of the
second call and the gathered columns, and a grammar that allows that much is free text (a JSON
string's content allows most of the vocabulary), where the whole head is the plain choice. Where
unconstrained rows share the step, the whole head is read for them anyway and the narrow pass reads
its tiles a second time: it pays only in proportion to the rows it takes off the whole head.
A JSON choice allows a few tiles of thousands, and is narrowed in any batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

TILE = 16  # output rows per tile of a packed head
MAX_TILE_SHARE = 0.5


@dataclass(frozen=True)
class AllowedLogits:
    """A constrained row's allowed token ids (ascending, int64) and their logits (fp32, the runtime's
    array type), whichever head computed them: what its sampler draws from."""

    ids: np.ndarray
    logits: Any


@dataclass
class StepLogits:
    """The logits of a step's sampled rows (numbered in the runner's ``rows`` order).

    ``full [len(full_rows), vocab]`` holds the rows computed over the whole vocabulary: every
    unconstrained row, and the constrained ones when the step did not narrow. ``allowed[row]``
    holds every constrained row's allowed ids and logits."""

    full: Any | None
    full_rows: list[int]
    allowed: dict[int, AllowedLogits]
    head_rows: float = 0.0  # the rows the head computed, each by its share of the head's columns (``HeadPlan``)

    def unconstrained(self) -> tuple[list[int], Any | None]:
        """The unconstrained rows and their full logits (None when there are none)."""
        at = [i for i, row in enumerate(self.full_rows) if row not in self.allowed]
        if not at:
            return [], None
        rows = [self.full_rows[i] for i in at]
        return rows, self.full if len(at) == len(self.full_rows) else self.full[at]


@dataclass(frozen=True)
class HeadPlan:
    """Which sampled rows a step computes over the whole vocabulary, and which on ``tiles`` only
    (int32, ascending: the union of those rows' allowed tiles)."""

    full_rows: list[int]
    narrow_rows: list[int]
    tiles: np.ndarray
    num_tiles: int  # the head's

    @property
    def head_rows(self) -> float:
        """Rows computed, each counted by the share of the head's columns it gets: the latency
        model's head term (``StepFeatures.head_rows``)."""
        return len(self.full_rows) + len(self.narrow_rows) * self.tiles.size / self.num_tiles


def plan_head(allowed: list[np.ndarray | None], num_tiles: int, narrows: bool) -> HeadPlan:
    """The step's plan: the constrained rows narrowed when the head ``narrows`` exactly and their
    allowed tiles are at most ``MAX_TILE_SHARE`` of its ``num_tiles``, times the constrained rows'
    part of the rows; every row whole otherwise."""
    constrained = [row for row, ids in enumerate(allowed) if ids is not None]
    everything = HeadPlan(list(range(len(allowed))), [], np.empty(0, np.int32), num_tiles)
    if not narrows or not constrained:
        return everything
    tiles = np.unique(np.concatenate([allowed[row] // TILE for row in constrained])).astype(np.int32)
    if tiles.size > MAX_TILE_SHARE * num_tiles * len(constrained) / len(allowed):
        return everything
    return HeadPlan([row for row, ids in enumerate(allowed) if ids is None], constrained, tiles, num_tiles)


def step_logits(plan: HeadPlan, allowed: list[np.ndarray | None], full, narrow,
                take: Callable[[Any, int, np.ndarray], Any]) -> StepLogits:
    """The step's logits from the plan's products: ``full [len(full_rows), vocab]`` and ``narrow
    [len(narrow_rows), 16·len(tiles)]``; ``take(matrix, row, columns)`` picks one row's columns."""
    by_row = {row: AllowedLogits(allowed[row], take(full, i, allowed[row]))
              for i, row in enumerate(plan.full_rows) if allowed[row] is not None}
    for j, row in enumerate(plan.narrow_rows):
        ids = allowed[row]
        columns = np.searchsorted(plan.tiles, ids // TILE) * TILE + ids % TILE
        by_row[row] = AllowedLogits(ids, take(narrow, j, columns))
    return StepLogits(full, plan.full_rows, by_row, plan.head_rows)
