"""Prometheus metrics of ``ricllm serve``, namespace ``ricxapp`` (the xApp descriptor's), own registry.

Two kinds of series:

- counted as replies go out, by the socket thread (refusals it answers itself) and the engine
  thread (the rest), in thread-safe ``prometheus_client`` objects: admission
  decisions by reason, deadlines met and missed, final replies by outcome, and the TTFT, TPOT and
  end-to-end histograms (seconds, from the server's receipt of the request);
- read from the engine: the engine thread publishes an :class:`EngineSnapshot` (the engine's own
  ``snapshot()`` and the inbound queue length, a frozen value,
  swapped atomically) and a collector turns the latest one into gauges and counters at scrape
  time, so the HTTP thread never touches engine state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ricllm.engine.stats import EngineStats, LatencyStats

NAMESPACE = "ricxapp"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's snapshot at one moment, with the server's inbound queue as the engine thread saw it."""

    engine: EngineStats
    inbound: int


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self._metrics.snapshot
        if snap is None:  # the model is still loading
            return
        engine, kv = snap.engine, snap.engine.kv_cache
        yield _gauge("requests_running", "Requests in the running batch", engine.running)
        yield _gauge("requests_waiting", "Admitted requests waiting to be scheduled", engine.waiting)
        yield _gauge("inbound_queue_length", "Requests received but not yet seen by the engine thread", snap.inbound)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                     kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
        blocks = GaugeMetricFamily(f"{NAMESPACE}_kv_cache_blocks", "KV-cache blocks by state", labels=["state"])
        for state, value in (("total", kv.num_blocks), ("used", kv.used_blocks), ("free", kv.free_blocks),
                             ("cached_free", kv.cached_free_blocks), ("pinned", kv.pinned_blocks)):
            blocks.add_metric([state], value)
        yield blocks
        yield CounterMetricFamily(f"{NAMESPACE}_prefix_cache_queries_tokens",
                                  "Prompt tokens looked up in the prefix cache", value=kv.prefix_cache_queries_tokens)
        yield CounterMetricFamily(f"{NAMESPACE}_prefix_cache_hits_tokens",
                                  "Prompt tokens served from the prefix cache", value=kv.prefix_cache_hits_tokens)
        yield CounterMetricFamily(f"{NAMESPACE}_preemptions", "Sequences preempted for KV blocks",
                                  value=kv.preemptions)
        yield from _latency_gauges(engine.latency)


def _latency_gauges(latency: LatencyStats | None) -> Iterator[Metric]:
    if latency is None:
        return
    for name, value, text in (
            ("latency_model_median_abs_error", latency.median_abs_error,
             "Median |relative error| of the step-latency model"),
            ("latency_model_p95_abs_error", latency.p95_abs_error,
             "95th percentile |relative error| of the step-latency model"),
            ("latency_model_correction", latency.correction,
             "Online correction factor (measured / fitted step time)")):
        if value is not None:
            yield _gauge(name, text, value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", documentation, value=value)


class ServerMetrics:
    """All series of one server; ``render()`` is the body of ``GET /ric/v1/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot: EngineSnapshot | None = None
        self._lock = threading.Lock()
        self._admission_counts: dict[str, int] = {}
        self._deadline_counts = {"met": 0, "missed": 0}
        common = dict(namespace=NAMESPACE, registry=self.registry)
        self.admissions = Counter("admissions", "Admission decisions by reason (admitted or a reject code)",
                                  ["reason"], **common)
        self.deadlines_met = Counter("deadlines_met", "Finished requests that met their deadline", **common)
        self.deadlines_missed = Counter("deadlines_missed", "Finished requests that missed their deadline", **common)
        self.replies = Counter("requests", "Final replies to generate requests by outcome", ["outcome"], **common)
        self.ttft = Histogram("ttft_seconds", "Time to first token from receipt", buckets=LATENCY_BUCKETS, **common)
        self.tpot = Histogram("tpot_seconds", "Mean time per output token after the first", buckets=TPOT_BUCKETS,
                              **common)
        self.e2e = Histogram("e2e_seconds", "Receipt to final token", buckets=LATENCY_BUCKETS, **common)
        self.registry.register(_EngineCollector(self))

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def admission(self, reason: str) -> None:
        """One decision: ``admitted`` or a reject code."""
        self.admissions.labels(reason).inc()
        with self._lock:
            self._admission_counts[reason] = self._admission_counts.get(reason, 0) + 1

    def outcome(self, outcome: str) -> None:
        """One final reply to a generate: ``result``, ``rejected`` or ``error``."""
        self.replies.labels(outcome).inc()

    def result(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float, deadline_met: bool | None) -> None:
        """A finished generate's timings (seconds from receipt) and whether it met its deadline."""
        self.outcome("result")
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)
        if deadline_met is not None:
            (self.deadlines_met if deadline_met else self.deadlines_missed).inc()
            with self._lock:
                self._deadline_counts["met" if deadline_met else "missed"] += 1

    def counts(self) -> dict[str, dict[str, int]]:
        """Admission and deadline counts, for ``stats``."""
        with self._lock:
            return {"admission": dict(self._admission_counts), "deadlines": dict(self._deadline_counts)}

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
