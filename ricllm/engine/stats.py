"""One engine snapshot (:class:`EngineStats`): what the engine holds and has done, at one moment.

``LLMEngine.snapshot()`` is the only place these numbers are gathered; the offline API's
``kv_cache_stats``, the server's ``stats`` reply and Prometheus metrics, and the replay timeline
and report (``EngineStats.admission_report``) all read it. The dataclasses import nothing heavy,
so the wire protocol carries them as they are (``ricllm.protocol.ServerStats``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVCacheStats:
    """The block pool: ``used_blocks + free_blocks == num_blocks`` (cached free blocks are free)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int  # 2·L_g·block_size·n_kv·(d_h·b + s), L_g a cache group's layers: int8 rows count their scales
    budget_bytes: int
    allocated_bytes: int
    used_blocks: int
    free_blocks: int
    cached_free_blocks: int
    pinned_blocks: int
    peak_used_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    preemptions: int
    waits: int
    kv_cache_dtype: str = "bfloat16"  # the pool's element type: the activations' or "int8"
    # a hybrid cache's groups (ricllm.cache.kv_groups), group 0 first: each group's layers' window
    # (0: the whole sequence) and the distinct blocks running sequences hold in it; empty for one group
    group_windows: tuple[int, ...] = ()
    group_used_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class LatencyStats:
    """How far the step-latency model's predictions were from measured steps (relative errors), and
    what admission's bounds add to the fit now (``StepErrors``): the multipliers (measured / fitted)
    of decode steps, of prefill steps and of the first step after an idle gap.
    ``correction``, the larger multiplier, is kept one release for clients that read it."""

    steps: int
    median_abs_error: float | None
    p95_abs_error: float | None
    correction: float  # deprecated: max(decode_multiplier, prefill_multiplier); removed in the next release
    # None only in a reply from a server that predates the error model
    decode_multiplier: float | None = None
    prefill_multiplier: float | None = None
    after_idle_multiplier: float | None = None


@dataclass(frozen=True)
class SlowdownEvent:
    """The slowdown detector changed its mind at ``time`` (engine clock): the typical step ran
    ``slowdown`` times as long as the recent past's typical step (``slow``: at least the detector's
    threshold), ``typical_ratio`` times its fitted prediction, and admission's larger busy-step
    multiplier (a high quantile of that ratio, of decode or of prefill steps) was ``step_multiplier``."""

    time: float
    slow: bool
    slowdown: float
    typical_ratio: float
    step_multiplier: float


@dataclass(frozen=True)
class AdapterStats:
    """A LoRA adapter the engine holds: under ``name`` in runtime slot ``slot``; ``requests`` are the
    unfinished requests (and pins) under it now."""

    name: str
    slot: int
    rank: int
    nbytes: int  # its parameters as read (fp32)
    content_hash: str  # sha256 of what its updates compute (``LoraAdapter.content_hash``)
    path: str
    requests: int


@dataclass(frozen=True)
class EngineStats:
    """The engine at one moment. ``latency`` is None without admission (no latency model), and so
    are ``caps`` and ``admission`` (the controller's own account: paced steps, promises in flight,
    the latency model's fit and errors)."""

    kv_cache: KVCacheStats
    running: int
    waiting: int
    policy: str  # admission policy: off, deadline or fcfs
    reserved_blocks: int  # KV blocks admission holds for admitted requests
    admitted: int
    rejected: dict[str, int] = field(default_factory=dict)  # by code
    deadlines_met: int = 0
    deadlines_missed: int = 0
    latency: LatencyStats | None = None
    steps: int = 0  # steps run since start
    degraded: int = 0  # admitted with fewer tokens than asked (the degrade policy)
    deadlines_ended_early: int = 0  # answered at their deadline with what they had (on_late: end_early)
    slack_ms: tuple[float, ...] = ()  # deadline − finish of the latest finished deadline requests, ms
    best_effort_paused_steps: int = 0  # steps some best effort sat out so admitted requests stay on time
    rescue_prefill_steps: int = 0  # steps whose prefill ran only for admitted requests at risk
    slowdowns: tuple[SlowdownEvent, ...] = ()  # the slowdown detector's verdicts, oldest first
    caps: list[dict] | None = None  # the tightest deadline class's largest batch per context
    admission: dict[str, Any] | None = None
    adapters: tuple[AdapterStats, ...] = ()  # the LoRA adapters served, by name
    max_loras: int = 0  # the runtime's adapter slots

    def slack_percentiles(self) -> dict[str, float | None]:
        """p5, p50 and p95 of ``slack_ms`` (None before any deadline request finished)."""
        slack = sorted(self.slack_ms)

        def pct(q: float) -> float | None:
            return slack[min(len(slack) - 1, int(q * len(slack)))] if slack else None

        return {"p5": pct(0.05), "p50": pct(0.5), "p95": pct(0.95)}

    def admission_report(self) -> dict[str, Any]:
        """What admission did, as the replay report records it: admitted and rejected by reason,
        deadlines met, missed and ended early, slack, rescues, slowdowns, caps and the controller's
        own account."""
        base = self.admission if self.admission is not None else {"policy": "off"}
        return {**base, "deadlines": {"met": self.deadlines_met, "missed": self.deadlines_missed,
                                      "ended_early": self.deadlines_ended_early},
                "best_effort_paused_steps": self.best_effort_paused_steps,
                "rescue_prefill_steps": self.rescue_prefill_steps,
                "slowdowns": [asdict(e) for e in self.slowdowns],
                "slack_ms": self.slack_percentiles(), "caps": self.caps}
