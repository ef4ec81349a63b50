"""Prometheus metrics of ``ricllm serve``, namespace ``ricxapp`` (the xApp descriptor's), own registry.

The series are vLLM's, under ``ricxapp_ricllm_`` (docs/serve.md lists them): a serving engineer's
dashboards and alerts for ``vllm:time_to_first_token_seconds`` and the like work with the prefix
changed. Every request series is labelled ``model_name`` (the served model's name, as ``/v1/models``
reports it; empty only for a refusal answered before the model has loaded) and ``deadline_class``
(the request's ``priority``, or the class its ``deadline_ms`` implies, as the engine schedules it:
``near_rt``, ``non_rt`` or ``best_effort``; the protocol admits no other value, and any other would
be counted as ``other``, so the label's values stay bounded). ZeroMQ and OpenAI HTTP requests meet
in the same socket and engine threads, so both are counted alike.

Three kinds of series:

- counted as replies go out, by the socket thread (refusals it answers itself) and the engine
  thread (the rest), in thread-safe ``prometheus_client`` objects: admission decisions by code,
  errors by code, finished requests by reason, tokens, deadlines met and missed, and the latency
  histograms (seconds, from the server's receipt of the request). The inter-token histogram is
  observed once per step that brings a request new tokens, as vLLM does (a step that appends
  several grammar-forced tokens is one interval); everything else once per request;
- read from the engine: the engine thread publishes an :class:`EngineSnapshot` (the engine's own
  ``snapshot()`` and the inbound queue length, a frozen value, swapped atomically) and a collector
  turns the latest one into gauges and counters at scrape time, so the HTTP thread never touches
  engine state;
- the process (``process_resident_memory_bytes``, CPU seconds, open files) and the interpreter
  (``python_info``), from ``prometheus_client``'s own collectors, also at scrape time.

Histogram buckets are vLLM's, with finer ones added where vLLM's are too coarse for a near-RT
control loop (10 ms to 1 s): every vLLM boundary is kept, so a query on one of its ``le`` values
works unchanged. TTFT adds 2.5 ms and 150/200/300/400 ms (vLLM jumps 100 -> 250 -> 500 ms);
inter-token adds 1, 2.5, 5 and 7.5 ms (vLLM starts at 10 ms, above a CPU decode step of a small
model); end-to-end and queue time add 1 ms to 250 ms (vLLM starts at 300 ms: a whole near-RT
budget would land in its first bucket).

Deprecated (kept for one release, their HELP says so, removed in the next): the first names,
``ricxapp_ttft_seconds``, ``ricxapp_tpot_seconds``, ``ricxapp_e2e_seconds``,
``ricxapp_admissions_total``, ``ricxapp_requests_total``, ``ricxapp_deadlines_met_total``,
``ricxapp_deadlines_missed_total``, ``ricxapp_requests_running``, ``ricxapp_requests_waiting``,
``ricxapp_inbound_queue_length``, ``ricxapp_kv_cache_usage_ratio``, ``ricxapp_kv_cache_blocks``,
``ricxapp_prefix_cache_*_tokens_total``, ``ricxapp_preemptions_total`` and
``ricxapp_latency_model_*``; and ``ricxapp_ricllm_latency_model_correction`` (one factor for every
step), now ``ricxapp_ricllm_latency_model_step_multiplier{step_kind}`` (decode, prefill, after_idle).
The engine's are re-read from the same snapshot at scrape time (no cost to the engine); the request
ones cost one more observation per request (a microsecond or two), never per token: the old ``tpot``
histogram takes each request's mean, not its steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ricllm import protocol as p
from ricllm.engine.stats import EngineStats, KVCacheStats, LatencyStats
from ricllm.sampling_params import PRIORITIES, default_priority

NAMESPACE = "ricxapp"
SUBSYSTEM = "ricllm"
PREFIX = f"{NAMESPACE}_{SUBSYSTEM}"
OTHER_CLASS = "other"  # a class outside PRIORITIES (the protocol refuses them; never a new label value)
NO_MODEL = ""  # a refusal before the model has loaded names no model

VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = tuple(sorted({*VLLM_TTFT_BUCKETS, 0.0025, 0.15, 0.2, 0.3, 0.4}))
ITL_BUCKETS = tuple(sorted({*VLLM_ITL_BUCKETS, 0.001, 0.0025, 0.005, 0.0075}))
REQUEST_BUCKETS = tuple(sorted({*VLLM_REQUEST_BUCKETS, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                0.15, 0.2, 0.25}))

# the deprecated histograms' buckets (unchanged, so their series stay comparable until removed)
OLD_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OLD_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DEPRECATED = " DEPRECATED: use {} instead; removed in the next release."


def deadline_class(request: p.GenerateRequest) -> str:
    """The ``deadline_class`` label of a generate: its priority, else the one its deadline implies."""
    name = request.priority or default_priority(request.deadline_ms)
    return name if name in PRIORITIES else OTHER_CLASS


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's snapshot at one moment, with the server's inbound queue as the engine thread saw it."""

    engine: EngineStats
    inbound: int


@dataclass(frozen=True)
class FinishedRequest:
    """What a generate's final ``result`` reports, for the per-request series."""

    deadline_class: str
    finish_reason: str  # stop, length, deadline, cancelled or fallback
    prompt_tokens: int
    generation_tokens: int
    timings: p.Timings
    deadline_met: bool | None
    adapter: str | None = None  # the LoRA adapter it was served under; None: the base model


# ------------------------------------------------------------------------------ the engine's series

class _EngineCollector:
    """The latest :class:`EngineSnapshot` as series, at scrape time: the new names (labelled
    ``model_name``), then the deprecated ones from the same numbers."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self._metrics.snapshot
        if snap is None:  # the model is still loading
            return
        model = self._metrics.model_name
        yield from _engine_series(snap, model)
        yield from _kv_series(snap.engine.kv_cache, model)
        yield from _latency_gauges(snap.engine.latency, model)
        yield from _deprecated_engine_series(snap)


def _engine_series(snap: EngineSnapshot, model: str) -> Iterator[Metric]:
    engine = snap.engine
    yield _gauge("num_requests_running", "Number of requests in the running batch", engine.running, model)
    yield _gauge("num_requests_waiting", "Number of admitted requests waiting to be scheduled", engine.waiting,
                 model)
    yield _gauge("inbound_queue_length", "Requests received but not yet seen by the engine thread", snap.inbound,
                 model)
    yield _gauge("lora_adapters_resident", "LoRA adapters the engine holds (lora_modules)", len(engine.adapters),
                 model)
    yield _gauge("lora_adapters_max", "LoRA adapters the engine can hold at once (max_loras)", engine.max_loras, model)


def _kv_series(kv: KVCacheStats, model: str) -> Iterator[Metric]:
    yield _gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _usage(kv), model)
    blocks = GaugeMetricFamily(f"{PREFIX}_kv_cache_blocks", "KV-cache blocks by state",
                               labels=["model_name", "state"])
    for state, value in _block_states(kv):
        blocks.add_metric([model, state], value)
    yield blocks
    if kv.group_windows:
        groups = GaugeMetricFamily(f"{PREFIX}_kv_cache_group_blocks",
                                   "KV-cache blocks running requests hold, by cache group (window 0: full attention)",
                                   labels=["model_name", "group", "window"])
        for group, (window, used) in enumerate(zip(kv.group_windows, kv.group_used_blocks)):
            groups.add_metric([model, str(group), str(window)], used)
        yield groups
    yield _counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                   kv.prefix_cache_queries_tokens, model)
    yield _counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                   kv.prefix_cache_hits_tokens, model)
    yield _counter("num_preemptions", "Cumulative number of preemptions (sequences preempted for KV blocks).",
                   kv.preemptions, model)


def _latency_gauges(latency: LatencyStats | None, model: str | None) -> Iterator[Metric]:
    """The step-latency model's accuracy and what admission's bounds add to the fit, per kind of
    step; ``model`` None: the deprecated unlabelled names."""
    if latency is None:
        return
    for name, value, text in (
            ("latency_model_median_abs_error", latency.median_abs_error,
             "Median |relative error| of the step-latency model"),
            ("latency_model_p95_abs_error", latency.p95_abs_error,
             "95th percentile |relative error| of the step-latency model")):
        if value is None:
            continue
        yield _gauge(name, text, value, model) if model is not None else _old_gauge(name, name, text, value)
    if model is None:
        yield _old_gauge("latency_model_correction", "latency_model_step_multiplier",
                         "Online correction factor (measured / fitted step time)", latency.correction)
        return
    yield from _step_error_gauges(latency, model)


def _step_error_gauges(latency: LatencyStats, model: str) -> Iterator[Metric]:
    multipliers = GaugeMetricFamily(f"{PREFIX}_latency_model_step_multiplier",
                                    "Measured / fitted step time that admission's bounds charge, by step kind",
                                    labels=["model_name", "step_kind"])
    for kind, value in (("decode", latency.decode_multiplier), ("prefill", latency.prefill_multiplier),
                        ("after_idle", latency.after_idle_multiplier)):
        multipliers.add_metric([model, kind], value)
    yield multipliers
    yield _gauge("latency_model_correction", "The larger step multiplier" + DEPRECATED.format(
        f"{PREFIX}_latency_model_step_multiplier"), latency.correction, model)


def _deprecated_engine_series(snap: EngineSnapshot) -> Iterator[Metric]:
    engine, kv = snap.engine, snap.engine.kv_cache
    yield _old_gauge("requests_running", "num_requests_running", "Requests in the running batch", engine.running)
    yield _old_gauge("requests_waiting", "num_requests_waiting", "Admitted requests waiting to be scheduled",
                     engine.waiting)
    yield _old_gauge("inbound_queue_length", "inbound_queue_length",
                     "Requests received but not yet seen by the engine thread", snap.inbound)
    yield _old_gauge("kv_cache_usage_ratio", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use", _usage(kv))
    blocks = GaugeMetricFamily(f"{NAMESPACE}_kv_cache_blocks", _old_help("KV-cache blocks by state", "kv_cache_blocks"),
                               labels=["state"])
    for state, value in _block_states(kv):
        blocks.add_metric([state], value)
    yield blocks
    for name, new, text, value in (
            ("prefix_cache_queries_tokens", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
             kv.prefix_cache_queries_tokens),
            ("prefix_cache_hits_tokens", "prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
             kv.prefix_cache_hits_tokens),
            ("preemptions", "num_preemptions_total", "Sequences preempted for KV blocks", kv.preemptions)):
        yield CounterMetricFamily(f"{NAMESPACE}_{name}", _old_help(text, new), value=value)
    yield from _latency_gauges(snap.engine.latency, None)


def _usage(kv: KVCacheStats) -> float:
    return kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0


def _block_states(kv: KVCacheStats) -> tuple[tuple[str, int], ...]:
    return (("total", kv.num_blocks), ("used", kv.used_blocks), ("free", kv.free_blocks),
            ("cached_free", kv.cached_free_blocks), ("pinned", kv.pinned_blocks))


def _gauge(name: str, documentation: str, value: float, model: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, documentation: str, value: float, model: str) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _old_gauge(name: str, new: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", _old_help(documentation, new), value=value)


def _old_help(documentation: str, new: str) -> str:
    return documentation + DEPRECATED.format(f"{PREFIX}_{new}")


# ------------------------------------------------------------------------------ the server's series

REQUEST_LABELS = ["model_name", "deadline_class"]


class ServerMetrics:
    """All series of one server; ``render()`` is the body of ``GET /ric/v1/metrics``. The socket and
    engine threads count through the methods; ``model_name`` is set once the model has loaded."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot: EngineSnapshot | None = None
        self.model_name = NO_MODEL
        self._lock = threading.Lock()
        self._admission_counts: dict[str, int] = {}
        self._deadline_counts = {"met": 0, "missed": 0}
        self._request_series({"namespace": NAMESPACE, "subsystem": SUBSYSTEM, "registry": self.registry})
        self._deprecated_series({"namespace": NAMESPACE, "registry": self.registry})
        self.registry.register(_EngineCollector(self))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open fds
        PlatformCollector(registry=self.registry)  # python_info: a constant, read once

    def _request_series(self, common: dict[str, Any]) -> None:
        labels = REQUEST_LABELS
        self.ttft = Histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds (from "
                              "receipt).", labels, buckets=TTFT_BUCKETS, **common)
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds (one interval per engine "
            "step that brought a request tokens).", labels, buckets=ITL_BUCKETS, **common)
        self.e2e = Histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds (receipt "
                             "to final token).", labels, buckets=REQUEST_BUCKETS, **common)
        self.queue_time = Histogram("request_queue_time_seconds", "Histogram of time from receipt to first "
                                    "scheduling in seconds.", labels, buckets=REQUEST_BUCKETS, **common)
        self.prompt_tokens = Counter("prompt_tokens", "Number of prefill tokens processed (each finished "
                                     "request's prompt, cached tokens included).", labels, **common)
        self.generation_tokens = Counter("generation_tokens", "Number of generation tokens processed.", labels,
                                         **common)
        self.request_success = Counter("request_success", "Count of finished requests by finished_reason (stop, "
                                       "length, deadline, cancelled).", [*labels, "finished_reason"], **common)
        self.admission_decisions = Counter("admission_decisions", "Admission decisions by code: admitted, "
                                           "degraded, or the rejection code.", [*labels, "code"], **common)
        self.request_errors = Counter("request_errors", "Generate requests answered with an error, by code.",
                                      [*labels, "code"], **common)
        self.deadlines = Counter("deadlines", "Finished deadline requests by result, met or missed (cancelled "
                                 "ones not counted).", [*labels, "result"], **common)
        self.lora_requests = Counter("lora_requests", "Finished requests served under a LoRA adapter, by "
                                     "adapter name.", ["model_name", "lora_name"], **common)

    def _deprecated_series(self, common: dict[str, Any]) -> None:
        self.old_admissions = Counter("admissions", _old_help("Admission decisions by reason (admitted or a reject "
                                      "code)", "admission_decisions_total"), ["reason"], **common)
        self.old_deadlines_met = Counter("deadlines_met", _old_help("Finished requests that met their deadline",
                                                                    "deadlines_total"), **common)
        self.old_deadlines_missed = Counter("deadlines_missed", _old_help(
            "Finished requests that missed their deadline", "deadlines_total"), **common)
        self.old_replies = Counter("requests", _old_help("Final replies to generate requests by outcome",
                                                         "request_success_total"), ["outcome"], **common)
        self.old_ttft = Histogram("ttft_seconds", _old_help("Time to first token from receipt",
                                                            "time_to_first_token_seconds"),
                                  buckets=OLD_LATENCY_BUCKETS, **common)
        self.old_tpot = Histogram("tpot_seconds", _old_help("Mean time per output token after the first",
                                                            "inter_token_latency_seconds"),
                                  buckets=OLD_TPOT_BUCKETS, **common)
        self.old_e2e = Histogram("e2e_seconds", _old_help("Receipt to final token", "e2e_request_latency_seconds"),
                                 buckets=OLD_LATENCY_BUCKETS, **common)

    # -- the engine thread

    def set_model_name(self, name: str) -> None:
        """The served model's name (as ``/v1/models`` gives it); each class's series appear at zero."""
        self.model_name = name
        for cls in PRIORITIES:
            for series in (self.ttft, self.inter_token_latency, self.e2e, self.queue_time, self.prompt_tokens,
                           self.generation_tokens):
                series.labels(name, cls)

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def inter_token(self, cls: str) -> Any:
        """The inter-token histogram of one class (a request keeps it: the label lookup once, not per step)."""
        return self.inter_token_latency.labels(self.model_name, cls)

    def admitted(self, code: str, cls: str) -> None:
        """Admitted, ``code`` ``admitted`` or ``degraded``."""
        self._admission(code, cls)

    def rejected(self, code: str, cls: str) -> None:
        """A generate refused (its final reply ``rejected``), by the socket or the engine thread."""
        self._admission(code, cls)
        self.old_replies.labels("rejected").inc()

    def error(self, code: str, cls: str) -> None:
        """A generate answered with an error."""
        self.request_errors.labels(self.model_name, cls, code).inc()
        self.old_replies.labels("error").inc()

    def _admission(self, code: str, cls: str) -> None:
        self.admission_decisions.labels(self.model_name, cls, code).inc()
        self.old_admissions.labels(code).inc()
        with self._lock:
            self._admission_counts[code] = self._admission_counts.get(code, 0) + 1

    def finished(self, request: FinishedRequest) -> None:
        """A generate's final ``result``: its tokens and reason; unless cancelled, its timings and deadline."""
        labels = (self.model_name, request.deadline_class)
        self.prompt_tokens.labels(*labels).inc(request.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(request.generation_tokens)
        self.request_success.labels(*labels, request.finish_reason).inc()
        if request.adapter is not None:
            self.lora_requests.labels(self.model_name, request.adapter).inc()
        if request.finish_reason == "cancelled":
            self.old_replies.labels("cancelled").inc()
            return
        self._observe_timings(labels, request.timings)
        if request.deadline_met is not None:
            self._deadline(labels, request.deadline_met)

    def _observe_timings(self, labels: tuple[str, str], timings: p.Timings) -> None:
        self.old_replies.labels("result").inc()
        if timings.ttft_s is not None:
            self.ttft.labels(*labels).observe(timings.ttft_s)
            self.old_ttft.observe(timings.ttft_s)
        if timings.tpot_s is not None:
            self.old_tpot.observe(timings.tpot_s)
        self.e2e.labels(*labels).observe(timings.e2e_s)
        self.old_e2e.observe(timings.e2e_s)
        if timings.queue_s is not None:
            self.queue_time.labels(*labels).observe(timings.queue_s)

    def _deadline(self, labels: tuple[str, str], met: bool) -> None:
        result = "met" if met else "missed"
        self.deadlines.labels(*labels, result).inc()
        (self.old_deadlines_met if met else self.old_deadlines_missed).inc()
        with self._lock:
            self._deadline_counts[result] += 1

    # -- readers

    def counts(self) -> dict[str, dict[str, int]]:
        """Admission and deadline counts, for ``stats``."""
        with self._lock:
            return {"admission": dict(self._admission_counts), "deadlines": dict(self._deadline_counts)}

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
