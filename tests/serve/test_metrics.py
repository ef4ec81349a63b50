"""``/ric/v1/metrics`` after real requests: vLLM's series under ``ricxapp_ricllm_``,
labelled with the served model and the request's deadline class, moved by ZeroMQ and OpenAI HTTP
requests alike by exactly what the replies report; admission outcomes by code; the process
collector; the deprecated first names still there, marked so."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ricllm.client import RejectedError, RicClient
from tests.serve.test_server import Dealer, generate, http_get, metric_values, wait_for

MODEL = "tiny-random-llama"  # the tiny GGUF's general.name: what /v1/models reports
P = "ricxapp_ricllm_"


def labels(cls: str, **more: str) -> tuple:
    return tuple(sorted({"model_name": MODEL, "deadline_class": cls, **more}.items()))


def post_completion(base_url: str, **body) -> tuple[int, dict]:
    request = urllib.request.Request(base_url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": MODEL, "temperature": 0, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Deltas:
    """Series values now, less what they were at the start."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.before = metric_values(base_url)
        self.after = self.before

    def refresh(self) -> Deltas:
        self.after = metric_values(self.base_url)
        return self

    def __call__(self, name: str, key: tuple = ()) -> float:
        return self.after.get((name, key), 0.0) - self.before.get((name, key), 0.0)


def test_vllm_series_move_by_what_zeromq_and_http_replies_report(server):
    deltas = Deltas(server.http_url)
    with RicClient(server.endpoint, timeout_s=30) as client:
        near = [client.generate(f"near {i}", max_tokens=3, ignore_eos=True, deadline_ms=900.0) for i in range(2)]
        best = client.generate("no deadline", max_tokens=4, ignore_eos=True)
        with pytest.raises(RejectedError):
            client.generate("too late", max_tokens=64, deadline_ms=5.0)
    status, http = post_completion(server.http_url, prompt="over HTTP", max_tokens=5, ignore_eos=True,
                                   deadline_ms=60_000)
    assert status == 200
    refused, error = post_completion(server.http_url, prompt="too late", max_tokens=64, deadline_ms=5)
    assert refused == 429 and error["error"]["code"] == "DEADLINE_INFEASIBLE"
    # the engine thread counts a result just after sending it
    wait_for(lambda: deltas.refresh()(P + "e2e_request_latency_seconds_count", labels("non_rt")) == 1, 5,
             "the HTTP request counted")

    counted = {"near_rt": near, "best_effort": [best]}
    for cls, results in counted.items():
        assert deltas(P + "prompt_tokens_total", labels(cls)) == sum(r.num_prompt_tokens for r in results)
        assert deltas(P + "generation_tokens_total", labels(cls)) == sum(len(r.token_ids) for r in results)
        assert deltas(P + "inter_token_latency_seconds_count", labels(cls)) == sum(
            len(r.token_ids) - 1 for r in results)
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert deltas(P + histogram + "_count", labels(cls)) == len(results), (histogram, cls)
        assert deltas(P + "admission_decisions_total", labels(cls, code="admitted")) == len(results)
        assert deltas(P + "request_success_total", labels(cls, finished_reason="length")) == len(results)
    assert deltas(P + "e2e_request_latency_seconds_sum", labels("near_rt")) == pytest.approx(
        sum(r.timings.e2e_s for r in near), rel=1e-6)
    assert deltas(P + "prompt_tokens_total", labels("non_rt")) == http["usage"]["prompt_tokens"]
    assert deltas(P + "generation_tokens_total", labels("non_rt")) == http["usage"]["completion_tokens"] == 5
    assert deltas(P + "inter_token_latency_seconds_count", labels("non_rt")) == 4
    assert deltas(P + "admission_decisions_total", labels("near_rt", code="DEADLINE_INFEASIBLE")) == 2
    assert deltas(P + "deadlines_total", labels("near_rt", result="met")) + deltas(
        P + "deadlines_total", labels("near_rt", result="missed")) == 2


def test_the_engine_series_carry_the_served_model_name(server):
    status, listed = http_get(server.http_url + "/v1/models")
    assert status == 200 and json.loads(listed)["data"][0]["id"] == MODEL
    with RicClient(server.endpoint, timeout_s=30) as client:
        result = client.generate("cache me", max_tokens=2, ignore_eos=True)
        kv = client.stats().kv_cache
    model = (("model_name", MODEL),)
    # the snapshot is published between steps: wait for one taken after the request (an idle one from
    # before it has running 0 too), or fail when none comes
    values = wait_for(lambda: _idle_after(server.http_url, result.num_prompt_tokens), 5,
                      "an idle engine snapshot that counts the request's prompt")
    assert values[(P + "num_requests_running", model)] == values[(P + "num_requests_waiting", model)] == 0
    assert 0 <= values[(P + "kv_cache_usage_perc", model)] <= 1
    assert values[(P + "kv_cache_blocks", (*model, ("state", "total")))] == kv.num_blocks
    queries = values[(P + "prefix_cache_queries_total", model)]
    assert queries >= result.num_prompt_tokens and values[(P + "prefix_cache_hits_total", model)] <= queries
    assert (P + "num_preemptions_total", model) in values and (P + "inbound_queue_length", model) in values
    for kind in ("decode", "prefill", "after_idle"):  # what the bounds charge, per kind of step
        assert values[(P + "latency_model_step_multiplier", (*model, ("step_kind", kind)))] > 0


def _idle_after(base_url: str, prompt_tokens: int) -> dict | None:
    values = _idle(base_url)
    queried = values and values.get((P + "prefix_cache_queries_total", (("model_name", MODEL),)), 0)
    return values if queried and queried >= prompt_tokens else None


def _idle(base_url: str) -> dict | None:
    values = metric_values(base_url)
    running = values.get((P + "num_requests_running", (("model_name", MODEL),)))
    return values if running == 0 else None


def test_histograms_keep_every_vllm_bucket_and_resolve_the_near_rt_range(server):
    from ricllm.serve.metrics import VLLM_ITL_BUCKETS, VLLM_REQUEST_BUCKETS, VLLM_TTFT_BUCKETS

    values = metric_values(server.http_url)

    def bounds(histogram: str) -> set[float]:
        return {float(dict(key)["le"]) for name, key in values if name == P + histogram + "_bucket"
                and dict(key)["deadline_class"] == "near_rt"}

    for histogram, vllm in (("time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                            ("inter_token_latency_seconds", VLLM_ITL_BUCKETS),
                            ("e2e_request_latency_seconds", VLLM_REQUEST_BUCKETS),
                            ("request_queue_time_seconds", VLLM_REQUEST_BUCKETS)):
        have = bounds(histogram)
        assert set(vllm) <= have, histogram
        near_rt = [b for b in have if 0.01 <= b <= 1.0]
        assert len(near_rt) >= 8 and min(have) <= 0.001, (histogram, sorted(have))


def test_the_process_collector_and_the_deprecated_names(server):
    status, text = http_get(server.http_url + "/ric/v1/metrics")
    assert status == 200
    values = metric_values(server.http_url)
    assert values[("process_resident_memory_bytes", ())] > 10 * 2**20
    assert any(name == "python_info" for name, _ in values)
    for old in ("ricxapp_ttft_seconds", "ricxapp_e2e_seconds", "ricxapp_admissions_total",
                "ricxapp_requests_running", "ricxapp_kv_cache_usage_ratio"):
        help_line = next(line for line in text.splitlines() if line.startswith(f"# HELP {old} "))
        assert "DEPRECATED: use ricxapp_ricllm_" in help_line, help_line
    for old in (P + "latency_model_correction", "ricxapp_latency_model_correction"):  # one factor for every step
        help_line = next(line for line in text.splitlines() if line.startswith(f"# HELP {old} "))
        assert f"DEPRECATED: use {P}latency_model_step_multiplier instead" in help_line, help_line



def test_a_refusal_the_socket_thread_answers_is_counted_by_code_and_class(start_server):
    """``DRAINING`` comes from the socket thread, not the engine's admission: counted all the same."""
    from prometheus_client.parser import text_string_to_metric_families

    running = start_server()
    dealer = Dealer(running.endpoint)
    try:
        dealer.send(generate("long", prompt="keep going", max_tokens=400, ignore_eos=True))
        assert dealer.recv().type == "accepted"
        running.server.drain(timeout_s=30)
        dealer.send(generate("late", prompt="too late", max_tokens=2, priority="non_rt"))
        assert dealer.until_final("late")[-1].code == "DRAINING"
    finally:
        dealer.close()

    def count() -> float:  # read in-process: the HTTP port closes once the drain ends
        body, _ = running.server.metrics.render()
        return sum(s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples
                   if s.name == P + "admission_decisions_total" and s.labels == {
                       "model_name": MODEL, "deadline_class": "non_rt", "code": "DRAINING"})

    wait_for(lambda: count() == 1, 5, "the DRAINING refusal counted")


@pytest.mark.parametrize(("priority", "deadline_ms", "expected"), [
    ("non_rt", 50.0, "non_rt"), (None, 50.0, "near_rt"), (None, 5000.0, "non_rt"), (None, None, "best_effort"),
    ("made_up", None, "other")])
def test_the_deadline_class_label_is_the_class_the_engine_schedules_and_stays_bounded(priority, deadline_ms,
                                                                                     expected):
    from types import SimpleNamespace

    from ricllm.serve.metrics import deadline_class

    assert deadline_class(SimpleNamespace(priority=priority, deadline_ms=deadline_ms)) == expected
