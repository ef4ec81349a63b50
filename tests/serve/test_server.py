"""``ricllm serve`` end to end: real ZeroMQ sockets (tcp on 127.0.0.1, ipc in a tmp dir) and HTTP,
the tiny random model, a stored latency fit; the server in-process, or a real subprocess for
SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from ricllm import protocol as p
from ricllm.client import AsyncRicClient, RejectedError, RicClient, ServerError
from tests.helpers import require_module
from tests.serve.conftest import free_port

LONG_SYSTEM = ("You are a RAN configuration assistant for the O-RAN near-RT RIC. Answer in one short "
               "sentence about PRB usage, throughput and handover settings of the cell named.")
ROOT = Path(__file__).parents[2]


# ------------------------------------------------------------------------------ helpers

class Dealer:
    """A raw DEALER socket: send any frame, collect replies by id."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(endpoint)

    def send(self, frame: bytes | dict) -> None:
        self.socket.send(frame if isinstance(frame, bytes) else msgpack.packb(frame, use_bin_type=True))

    def recv(self, timeout_s: float = 10.0):
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply within {timeout_s} s")
        return p.decode_reply(self.socket.recv())

    def until_final(self, request_id: str | None, timeout_s: float = 10.0) -> list:
        replies = []
        while True:
            reply = self.recv(timeout_s)
            if reply.id == request_id:
                replies.append(reply)
                if p.is_final(reply):
                    return replies

    def close(self) -> None:
        self.socket.close(linger=0)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_values(base_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every series."""
    require_module("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http_get(base_url + "/ric/v1/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(condition, timeout_s: float = 5.0, what: str = "condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def generate(rid: str, **fields) -> dict:
    return {"v": 1, "type": "generate", "id": rid, **fields}


# ------------------------------------------------------------------------------ generate

def test_generate_ping_and_timings(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        pong = client.ping()
        assert pong.version and abs(pong.server_time - time.time()) < 60
        result = client.generate("hello world", max_tokens=6, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    assert result.num_prompt_tokens > 0 and result.deadline_met is None
    t = result.timings
    assert 0 <= t.queue_s <= t.ttft_s <= t.e2e_s and t.tpot_s is not None


def test_accepted_leaves_before_the_model_step_runs(start_server, monkeypatch):
    """Admission runs between steps; its reply must not wait for the step that follows it."""
    from ricllm.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def slow_step(engine):
        time.sleep(0.5)
        return step(engine)

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    running = start_server()
    dealer = Dealer(running.endpoint)
    try:
        sent = time.monotonic()
        dealer.send(generate("slow", prompt="hello", max_tokens=1))
        accepted = dealer.recv()
        accepted_after = time.monotonic() - sent
        result = dealer.until_final("slow")[-1]
        result_after = time.monotonic() - sent
    finally:
        dealer.close()
    assert accepted.type == "accepted" and result.type == "result"
    assert accepted_after < 0.25 < 0.5 <= result_after, (accepted_after, result_after)


def test_deadline_request_meets_it_and_reports_a_prediction(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("dl", prompt="cell 17", max_tokens=4, ignore_eos=True, deadline_ms=60_000.0,
                             priority="non_rt"))
        accepted, result = dealer.until_final("dl", 30)
    finally:
        dealer.close()
    assert accepted.type == "accepted" and 0 < accepted.bound_ms < 60_000
    assert result.type == "result" and result.deadline_met is True


def test_concurrent_threads_each_get_their_own_results(server):
    results: dict[str, p.Result] = {}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            with RicClient(server.endpoint, timeout_s=60) as client:
                for i in range(2):
                    rid = f"thread-{worker}-{i}"
                    results[rid] = client.generate(f"worker {worker} asks {i}", max_tokens=5, ignore_eos=True,
                                                   request_id=rid)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors
    assert sorted(results) == sorted(f"thread-{w}-{i}" for w in range(4) for i in range(2))
    assert all(r.id == rid and len(r.token_ids) == 5 for rid, r in results.items())


def test_async_client_many_requests_in_flight(server):
    async def run() -> list[p.Result]:
        async with AsyncRicClient(server.endpoint, timeout_s=60) as client:
            return await asyncio.gather(*(client.generate(f"question {i}", max_tokens=3 + i % 3, ignore_eos=True)
                                          for i in range(12)))

    results = asyncio.run(run())
    assert [len(r.token_ids) for r in results] == [3 + i % 3 for i in range(12)]
    assert len({r.id for r in results}) == 12


def test_stream_sends_tokens_then_the_result(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        replies = list(client.stream("stream me", max_tokens=8, ignore_eos=True))
    tokens, result = replies[:-1], replies[-1]
    assert all(r.type == "token" for r in tokens) and result.type == "result"
    assert [t.index for t in tokens] == list(range(8))
    assert [t.token_id for t in tokens] == result.token_ids
    assert "".join(t.text for t in tokens) == result.text


def test_stream_never_sends_the_stop_string(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        free = client.generate("stop here", max_tokens=24, ignore_eos=True)
        text = free.text
        if len(text) < 6:
            pytest.skip("the random model produced too little text to cut")
        stop = text[3:5]
        replies = list(client.stream("stop here", max_tokens=24, ignore_eos=True, stop=[stop]))
    result = replies[-1]
    streamed = "".join(r.text for r in replies[:-1])
    assert streamed == result.text and stop not in streamed
    assert [r.token_id for r in replies[:-1]] == result.token_ids


# ------------------------------------------------------------------------------ templates

def test_template_registration_and_reuse(server):
    user = [{"role": "user", "content": "PRB usage 92% on cell 17"}]
    with RicClient(server.endpoint, timeout_s=30) as client:
        registered = client.register_template(LONG_SYSTEM, template_id="ran-config")
        assert registered.template_id == "ran-config"
        assert registered.num_tokens > 16 and registered.num_pinned_tokens > 0
        assert registered.num_pinned_tokens % 16 == 0 and registered.num_pinned_tokens <= registered.num_tokens
        first = client.generate(messages=user, template_id="ran-config", max_tokens=3, ignore_eos=True)
        second = client.generate(messages=user, template_id="ran-config", max_tokens=3, ignore_eos=True)
        assert second.num_cached_tokens >= registered.num_pinned_tokens > 0
        assert first.num_cached_tokens >= registered.num_pinned_tokens
        # the template is the system message: same prompt as spelling it out
        spelled = client.generate(messages=[{"role": "system", "content": LONG_SYSTEM}, *user], max_tokens=3,
                                  ignore_eos=True)
        assert spelled.num_prompt_tokens == second.num_prompt_tokens and spelled.token_ids == second.token_ids
        raw = client.generate("and the throughput?", template_id="ran-config", max_tokens=2, ignore_eos=True)
        assert raw.num_cached_tokens >= registered.num_pinned_tokens
        again = client.register_template(LONG_SYSTEM, template_id="ran-config")  # the same: a no-op
        assert (again.num_tokens, again.num_pinned_tokens) == (registered.num_tokens, registered.num_pinned_tokens)
        with pytest.raises(ServerError) as other_text:
            client.register_template("a different prompt", template_id="ran-config")
        assert other_text.value.code == "VALIDATION" and "template_id" in other_text.value.message
        assigned = client.register_template("Short system prompt.")
        assert assigned.template_id and assigned.template_id != "ran-config"
        stats = client.stats().model_dump()
        assert stats["templates"]["ran-config"]["pinned"] is True
        assert client.unregister_template("ran-config").template_id == "ran-config"
        client.unregister_template(assigned.template_id)
        with pytest.raises(ServerError) as gone:
            client.generate(messages=user, template_id="ran-config", max_tokens=2)
        assert gone.value.code == "UNKNOWN_TEMPLATE"
        with pytest.raises(ServerError) as again:
            client.unregister_template("ran-config")
        assert again.value.code == "UNKNOWN_TEMPLATE"
        assert client.stats().model_dump()["kv_cache"]["pinned_blocks"] == 0


def test_unknown_template_is_an_error(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        with pytest.raises(ServerError) as error:
            client.generate("x", template_id="never-registered")
    assert error.value.code == "UNKNOWN_TEMPLATE" and "never-registered" in error.value.message


def test_template_with_its_own_system_message_is_refused(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        client.register_template(LONG_SYSTEM, template_id="sys")
        with pytest.raises(ServerError) as error:
            client.generate(messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
                            template_id="sys")
        client.unregister_template("sys")
    assert error.value.code == "VALIDATION" and "messages" in error.value.message


# ------------------------------------------------------------------------------ refusals

def test_infeasible_deadline_is_rejected_with_numbers(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        with pytest.raises(RejectedError) as rejected:
            client.generate("urgent", max_tokens=64, deadline_ms=5.0, priority="near_rt")
    assert rejected.value.code == "DEADLINE_INFEASIBLE"
    numbers = rejected.value.numbers
    assert numbers["deadline_ms"] <= 5.0
    if "bound_ms" in numbers:  # admission's verdict (otherwise 5 ms passed in the queue already)
        assert numbers["bound_ms"] > numbers["deadline_ms"]
        assert "ms" in rejected.value.message


def test_context_too_long_is_rejected(server):
    with RicClient(server.endpoint, timeout_s=30) as client:
        with pytest.raises(RejectedError) as rejected:
            client.generate("long", max_tokens=600)
    assert rejected.value.code == "CONTEXT_TOO_LONG"
    assert rejected.value.numbers["max_model_len"] == 512 and rejected.value.numbers["max_tokens"] == 600


def test_degrade_admits_a_shorter_answer_and_says_so(start_server):
    from ricllm.cli.client import _timing_line

    running = start_server(engine={"admission": {"policy": "deadline", "degrade": True}})
    dealer = Dealer(running.endpoint)
    try:
        dealer.send(generate("short", prompt="cell 17 overloaded", max_tokens=64, ignore_eos=True,
                             deadline_ms=30.0, priority="near_rt"))
        accepted, result = dealer.until_final("short", 30)
    finally:
        dealer.close()
    degraded = accepted.degraded
    assert degraded.code == "DEADLINE_INFEASIBLE" and degraded.requested_max_tokens == 64
    assert 1 <= degraded.granted_max_tokens < 64 and degraded.message.startswith("max_tokens 64 -> ")
    assert result.type == "result" and result.degraded == degraded
    assert result.finish_reason == "length" and len(result.token_ids) == degraded.granted_max_tokens
    assert f"degraded: max_tokens 64 -> {degraded.granted_max_tokens} (DEADLINE_INFEASIBLE)" in _timing_line(result)
    samples = metric_values(running.http_url)
    assert samples[("ricxapp_admissions_total", (("reason", "degraded"),))] == 1


def test_bad_fields_are_validation_errors(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("typo", prompt="x", max_new_tokens=3))
        [typo] = dealer.until_final("typo")
        dealer.send(generate("vocab", token_ids=[10**6]))
        [vocab] = dealer.until_final("vocab")
        dealer.send(generate("prio", prompt="x", priority="near_rt"))
        [prio] = dealer.until_final("prio")
    finally:
        dealer.close()
    assert typo.code == "VALIDATION" and "max_new_tokens" in typo.message
    assert vocab.code == "VALIDATION" and "token_ids" in vocab.message
    assert prio.code == "VALIDATION" and "deadline_ms" in prio.message


def test_a_request_chooses_its_kv_window_over_zeromq(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("windowed", token_ids=list(range(3, 103)), max_tokens=6, ignore_eos=True,
                             kv_window=24, kv_sinks=2))
        windowed = dealer.until_final("windowed", 30)[-1]
        dealer.send(generate("negative", prompt="x", kv_window=-3))
        [negative] = dealer.until_final("negative")
    finally:
        dealer.close()
    assert windowed.type == "result" and len(windowed.token_ids) == 6
    assert negative.code == "VALIDATION" and "kv_window" in negative.message


def test_duplicate_id_in_flight_is_refused(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("dup", prompt="first", max_tokens=20, ignore_eos=True))
        dealer.send(generate("dup", prompt="second", max_tokens=2))
        replies = dealer.until_final("dup", 30)
        if replies[-1].type == "error":  # the error came first; the result follows
            replies += dealer.until_final("dup", 30)
        dealer.send(generate("dup", prompt="again", max_tokens=2, ignore_eos=True))  # no longer in flight
        after = dealer.until_final("dup", 30)
    finally:
        dealer.close()
    kinds = [r.type for r in replies]
    assert kinds.count("error") == 1 and kinds.count("result") == 1
    error = next(r for r in replies if r.type == "error")
    assert error.code == "DUPLICATE_ID"
    result = next(r for r in replies if r.type == "result")
    assert len(result.token_ids) == 20
    assert after[-1].type == "result" and len(after[-1].token_ids) == 2


def test_same_id_from_two_clients_is_fine(server):
    with RicClient(server.endpoint, timeout_s=30) as a, RicClient(server.endpoint, timeout_s=30) as b:
        results = []
        threads = [threading.Thread(target=lambda c=c: results.append(
            c.generate("shared id", max_tokens=3, ignore_eos=True, request_id="same"))) for c in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert [r.id for r in results] == ["same", "same"]


def test_cancel_ends_the_request_with_cancelled(server):
    async def run():
        async with AsyncRicClient(server.endpoint, timeout_s=30) as client:
            stream = client.stream("a long answer", max_tokens=400, ignore_eos=True, request_id="long-one")
            first = await stream.__anext__()
            assert first.type == "token"
            cancelled = await client.cancel("long-one")
            rest = [reply async for reply in stream]
            with pytest.raises(ServerError) as unknown:
                await client.cancel("long-one")
            return cancelled, rest, unknown.value

    cancelled, rest, unknown = asyncio.run(run())
    assert cancelled.target_id == "long-one"
    result = rest[-1]
    assert result.type == "result" and result.finish_reason == "cancelled"
    assert 1 <= len(result.token_ids) < 400
    assert unknown.code == "UNKNOWN_REQUEST"


def test_cancel_is_per_client(server):
    dealer, other = Dealer(server.endpoint), Dealer(server.endpoint)
    try:
        dealer.send(generate("mine", prompt="x", max_tokens=30, ignore_eos=True))
        other.send({"v": 1, "type": "cancel", "id": "c1", "target_id": "mine"})
        [refused] = other.until_final("c1")
        replies = dealer.until_final("mine", 30)
    finally:
        dealer.close()
        other.close()
    assert refused.code == "UNKNOWN_REQUEST"
    assert replies[-1].finish_reason == "length"


def test_vanished_client_does_not_hurt_the_server(server):
    dealer = Dealer(server.endpoint)
    dealer.send(generate("gone", prompt="talk to nobody", max_tokens=30, ignore_eos=True, stream=True))
    dealer.recv(30)  # accepted: the request is in the engine
    dealer.close()
    with RicClient(server.endpoint, timeout_s=30) as client:
        assert client.generate("still here", max_tokens=2, ignore_eos=True).finish_reason == "length"
        wait_for(lambda: client.stats().model_dump()["queues"]["in_flight"] == 0, 30, "the orphan to finish")


def test_stats_reply(server):
    """Typed on both sides (the engine's snapshot inside), with the wire keys it always had."""
    from ricllm.engine.stats import KVCacheStats
    from ricllm.protocol import ServerStats

    with RicClient(server.endpoint, timeout_s=30) as client:
        typed = client.stats()
    assert isinstance(typed, ServerStats) and isinstance(typed.kv_cache, KVCacheStats)
    stats = typed.model_dump()
    assert stats["kv_cache"]["num_blocks"] == 512 and stats["kv_cache"]["block_size"] == 16
    assert stats["admission"]["policy"] == "deadline" and stats["admission"]["counts"]["admitted"] >= 1
    assert set(stats["deadlines"]) == {"met", "missed"}
    assert stats["latency_model"]["steps"] >= 1 and stats["latency_model"]["median_abs_error"] is not None
    assert {"inbound", "running", "waiting", "in_flight"} <= set(stats["queues"])
    assert stats["draining"] is False
    model = stats["model"]
    assert model["name"] == "tiny-random-llama" and model["path"].endswith(".gguf") and model["dtype"] == "float32"
    assert model["weights"] == {"layers": "dense", "head": "dense"} and model["attention_backend"] == "cpu"


# ------------------------------------------------------------------------------ HTTP

def test_health_and_metrics(server):
    assert http_get(server.http_url + "/ric/v1/health/alive")[0] == 200
    assert http_get(server.http_url + "/ric/v1/health/ready")[0] == 200
    assert http_get(server.http_url + "/nope")[0] == 404
    before = metric_values(server.http_url)
    with RicClient(server.endpoint, timeout_s=30) as client:
        results = [client.generate(f"metrics {i}", max_tokens=3, ignore_eos=True) for i in range(3)]
        met = client.generate("in time", max_tokens=2, ignore_eos=True, deadline_ms=60_000.0)
        with pytest.raises(RejectedError):
            client.generate("too late", max_tokens=64, deadline_ms=5.0)
        stats = client.stats().model_dump()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    after = metric_values(server.http_url)
    assert delta("ricxapp_admissions_total", reason="admitted") == 4
    assert delta("ricxapp_admissions_total", reason="DEADLINE_INFEASIBLE") == 1
    assert delta("ricxapp_requests_total", outcome="result") == 4
    assert delta("ricxapp_requests_total", outcome="rejected") == 1
    assert delta("ricxapp_ttft_seconds_count") == 4 and delta("ricxapp_e2e_seconds_count") == 4
    assert delta("ricxapp_tpot_seconds_count") == 4
    assert delta("ricxapp_e2e_seconds_sum") == pytest.approx(
        sum(r.timings.e2e_s for r in [*results, met]), rel=1e-6)
    assert delta("ricxapp_deadlines_met_total") + delta("ricxapp_deadlines_missed_total") == 1
    assert delta("ricxapp_deadlines_met_total") == (1 if met.deadline_met else 0)

    def settled() -> dict | None:
        """The snapshot once the engine is idle again (it publishes one when it goes idle)."""
        values = metric_values(server.http_url)
        queries = values[("ricxapp_prefix_cache_queries_tokens_total", ())]
        idle = values[("ricxapp_requests_running", ())] == 0 and values[("ricxapp_requests_waiting", ())] == 0
        return values if idle and queries >= before[("ricxapp_prefix_cache_queries_tokens_total", ())] + sum(
            r.num_prompt_tokens for r in [*results, met]) else None

    now = wait_for(settled, 5, "the engine snapshot")
    assert now[("ricxapp_kv_cache_blocks", (("state", "total"),))] == stats["kv_cache"]["num_blocks"] == 512
    assert now[("ricxapp_requests_running", ())] == 0 and now[("ricxapp_requests_waiting", ())] == 0
    assert 0 <= now[("ricxapp_kv_cache_usage_ratio", ())] <= 1
    assert now[("ricxapp_prefix_cache_hits_tokens_total", ())] <= now[("ricxapp_prefix_cache_queries_tokens_total", ())]
    assert now[("ricxapp_latency_model_median_abs_error", ())] >= 0


def test_the_engine_is_built_and_stepped_on_the_engine_thread(server):
    """One thread builds and steps the engine: a second OpenMP pool would slow every step (async_engine)."""
    with RicClient(server.endpoint, timeout_s=30) as client:
        client.generate("hello", max_tokens=2, ignore_eos=True)
    engine_thread = next(t for t in server.server._threads if t.name == "ricllm-engine")
    engine = server.server._worker.engine
    assert engine._built_on == engine._stepping_on == engine_thread.ident


def test_ready_only_after_the_model_is_loaded(start_server, monkeypatch):
    from ricllm.serve.worker import Worker

    release = threading.Event()
    real_load = Worker.load_engine
    monkeypatch.setattr(Worker, "load_engine", lambda self: release.wait(30) and real_load(self))
    running = start_server(ready=False)
    assert http_get(running.http_url + "/ric/v1/health/alive")[0] == 200
    assert http_get(running.http_url + "/ric/v1/health/ready")[0] == 503
    with RicClient(running.endpoint, timeout_s=30) as client:
        assert client.ping().type == "pong"  # answered by the socket thread while the model loads
        results: list = []
        early = threading.Thread(target=lambda: results.append(client.generate("early", max_tokens=2)))
        early.start()
        time.sleep(0.2)
        assert not results  # it waits in the inbound queue
        release.set()
        early.join(30)
    assert results and results[0].type == "result"
    assert running.server.wait_ready(30)
    assert http_get(running.http_url + "/ric/v1/health/ready")[0] == 200
    running.server.drain()
    assert wait_for(lambda: http_get(running.http_url + "/ric/v1/health/ready")[0] == 503, 5, "503 while draining")


def test_a_model_that_fails_to_load_answers_what_waited(start_server, tmp_path, monkeypatch):
    from ricllm.errors import ModelLoadError
    from ricllm.serve.worker import Worker

    release = threading.Event()
    real_load = Worker.load_engine
    monkeypatch.setattr(Worker, "load_engine", lambda self: release.wait(30) and real_load(self))
    running = start_server(ready=False, engine={"model": str(tmp_path / "absent.gguf")})
    dealer = Dealer(running.endpoint)
    try:
        dealer.send(generate("waiting", prompt="x", max_tokens=2))
        dealer.send({"v": 1, "type": "stats", "id": "stats"})
        time.sleep(0.2)
        release.set()
        with pytest.raises(ModelLoadError):
            running.server.wait_ready(30)
        [waiting] = dealer.until_final("waiting")
        [stats] = dealer.until_final("stats")
    finally:
        dealer.close()
    assert waiting.type == stats.type == "error" and waiting.code == stats.code == "INTERNAL"
    assert "absent.gguf" in waiting.message
    assert running.server.wait(30)


# ------------------------------------------------------------------------------ bounds

def test_ipc_and_thousands_of_requests_each_get_one_answer(start_server, tmp_path):
    running = start_server(zmq_endpoint=f"ipc://{tmp_path}/ricllm.sock", inbound_queue_size=16, http_port=None,
                           engine={"admission": {"policy": "deadline", "max_queue": 8}})
    assert running.endpoint.startswith("ipc://")
    dealer = Dealer(running.endpoint)
    finals: dict[str, list] = {}
    total = 2000

    def take(timeout_s: float) -> None:
        while dealer.socket.poll(int(timeout_s * 1000)):
            reply = p.decode_reply(dealer.socket.recv())
            if p.is_final(reply):
                finals.setdefault(reply.id, []).append(reply)
            timeout_s = 0

    try:
        for i in range(total):
            dealer.send(generate(f"r{i}", prompt="flood", max_tokens=1))
            take(0)
        end = time.monotonic() + 60
        while len(finals) < total and time.monotonic() < end:
            take(0.2)
        with RicClient(running.endpoint, timeout_s=30) as client:
            assert client.ping().type == "pong"
    finally:
        dealer.close()
    assert len(finals) == total and all(len(replies) == 1 for replies in finals.values())
    kinds = [replies[0].type for replies in finals.values()]
    assert set(kinds) <= {"result", "rejected"} and kinds.count("result") >= 1
    assert {r[0].code for r in finals.values() if r[0].type == "rejected"} <= {"QUEUE_FULL"}


def test_oversized_frames(start_server):
    running = start_server(max_message_bytes=4096, http_port=None)
    dealer = Dealer(running.endpoint)
    try:
        dealer.send(b"\x00" * 5000)  # above the limit, below libzmq's hard cap: answered
        [too_large] = dealer.until_final(None)
        dealer.send({"v": 1, "type": "ping", "id": "ok", "pad": "x" * 3000})
        [small] = dealer.until_final("ok")
    finally:
        dealer.close()
    assert too_large.code == "TOO_LARGE" and "4096" in too_large.message
    assert small.code == "VALIDATION" and "pad" in small.message
    hostile = Dealer(running.endpoint)
    try:
        hostile.send(b"\x00" * 20000)  # above ZMQ_MAXMSGSIZE: libzmq drops the connection, no reply
        with pytest.raises(TimeoutError):
            hostile.recv(0.5)
    finally:
        hostile.close()
    with RicClient(running.endpoint, timeout_s=30) as client:
        assert client.ping().type == "pong"


# ------------------------------------------------------------------------------ the wire, fuzzed

def test_fuzzed_frames_get_errors_and_the_server_lives(server):
    require_module("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    wire_ints = st.integers(-2**63, 2**64 - 1)  # what msgpack can carry
    scalars = st.one_of(st.none(), st.booleans(), wire_ints, st.floats(),
                        st.text(max_size=20), st.binary(max_size=20))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
    keys = st.sampled_from(["v", "type", "id", "prompt", "max_tokens", "target_id", "template_id", "stream"])
    messages = st.dictionaries(st.one_of(keys, st.text(max_size=10)), values, max_size=6).map(
        lambda d: {"v": 1, **d} if d.get("type") is None else d)
    typed = st.fixed_dictionaries({"v": st.sampled_from([1, 1, 2, "1"]),
                                   "type": st.sampled_from(["ping", "stats", "cancel", "unregister_template",
                                                            "bogus", "generate"]),
                                   "id": st.one_of(st.text(min_size=1, max_size=12), wire_ints, st.none())},
                                  optional={"max_tokens": values, "target_id": values, "template_id": values,
                                            "prompt": wire_ints})
    frames = st.one_of(st.binary(max_size=64),
                       st.one_of(messages, typed).map(lambda d: msgpack.packb(d, use_bin_type=True)))
    dealer = Dealer(server.endpoint)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(frame=frames)
    def check(frame: bytes) -> None:
        try:
            request = p.decode_request(frame)
        except p.ProtocolError as exc:
            dealer.send(frame)
            [reply] = dealer.until_final(exc.request_id, 5)
            assert reply.type == "error" and reply.code == exc.code
            return
        dealer.send(frame)  # a valid request: ping, stats, cancel, unregister...
        replies = dealer.until_final(request.id, 30)
        assert sum(p.is_final(r) for r in replies) == 1

    try:
        check()
    finally:
        dealer.close()
    with RicClient(server.endpoint, timeout_s=30) as client:
        assert client.ping().type == "pong"
        assert client.generate("after the fuzz", max_tokens=2, ignore_eos=True).finish_reason == "length"


# ------------------------------------------------------------------------------ CURVE

def test_curve_admits_authorized_keys_only(start_server, tmp_path):
    from ricllm.serve.keys import create_key_pair

    server_public, server_secret = create_key_pair(tmp_path / "server", "server")
    client_public, client_secret = create_key_pair(tmp_path / "client", "client")
    _, stranger_secret = create_key_pair(tmp_path / "stranger", "stranger")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes(client_public.read_bytes())
    from ricllm.config import CurveOptions

    running = start_server(curve=CurveOptions(str(server_secret), str(authorized)), http_port=None)
    with RicClient(running.endpoint, timeout_s=30, curve_server_key=server_public,
                   curve_client_keys=client_secret) as client:
        assert client.ping().type == "pong"
        assert client.generate("over curve", max_tokens=2, ignore_eos=True).finish_reason == "length"
    # An unauthorized client gets no service. RicClient reports it as a timeout, except when the
    # refused handshake tears its pipe down between its POLLOUT check and the send (zmq.Again).
    no_service = (TimeoutError, zmq.Again)
    with RicClient(running.endpoint, timeout_s=0.5, curve_server_key=server_public,
                   curve_client_keys=stranger_secret) as stranger:
        with pytest.raises(no_service):
            stranger.ping()
    with RicClient(running.endpoint, timeout_s=0.5) as plain:  # no CURVE at all
        with pytest.raises(no_service):
            plain.ping()


def test_curve_off_serves_plain_clients_only(server, tmp_path):
    from ricllm.serve.keys import create_key_pair

    public, secret = create_key_pair(tmp_path, "server")
    with RicClient(server.endpoint, timeout_s=0.5, curve_server_key=public) as curve_client:
        with pytest.raises((TimeoutError, zmq.Again)):
            curve_client.ping()
    with RicClient(server.endpoint, timeout_s=30) as plain:
        assert plain.ping().type == "pong"


# ------------------------------------------------------------------------------ the command line

def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "CONFIG_FILE"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "ricllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=environment, cwd=ROOT)


def test_client_command_does_not_import_torch(server):
    code = ("import sys; from ricllm.cli import main; rc = main(['client', 'ping', '--endpoint', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, server.endpoint], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "pong from" in result.stdout


def test_client_command_exit_codes(server, capsys):
    from ricllm.cli import main

    assert main(["client", "generate", "hello", "--max-tokens", "4", "--ignore-eos", "--endpoint",
                 server.endpoint]) == 0
    out = capsys.readouterr()
    assert "4 generated, finish: length" in out.err and "TTFT" in out.err
    assert main(["client", "generate", "hi", "--stream", "--max-tokens", "3", "--ignore-eos", "--json",
                 "--endpoint", server.endpoint]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "length"
    assert main(["client", "generate", "urgent", "--max-tokens", "64", "--deadline-ms", "5", "--endpoint",
                 server.endpoint]) == 3
    assert "rejected: DEADLINE_INFEASIBLE" in capsys.readouterr().err
    assert main(["client", "generate", "x", "--template-id", "nope", "--endpoint", server.endpoint]) == 2
    assert "UNKNOWN_TEMPLATE" in capsys.readouterr().err
    assert main(["client", "register-template", LONG_SYSTEM, "--template-id", "cli", "--endpoint",
                 server.endpoint]) == 0
    assert capsys.readouterr().out.startswith("cli  (")
    assert main(["client", "unregister-template", "cli", "--endpoint", server.endpoint]) == 0
    assert main(["client", "cancel", "nothing", "--endpoint", server.endpoint]) == 2
    assert "UNKNOWN_REQUEST" in capsys.readouterr().err
    assert main(["client", "stats", "--json", "--endpoint", server.endpoint]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache"]["num_blocks"] == 512
    silent = f"tcp://127.0.0.1:{free_port()}"
    assert main(["client", "ping", "--timeout", "0.3", "--endpoint", silent]) == 4
    assert "timeout: " in capsys.readouterr().err


def test_keys_command(tmp_path, capsys):
    from ricllm.cli import main

    assert main(["keys", str(tmp_path), "--name", "client"]) == 0
    assert (tmp_path / "client.key").is_file() and (tmp_path / "client.key_secret").is_file()
    assert main(["keys", str(tmp_path), "--name", "client"]) == 2
    assert "already exist" in capsys.readouterr().err
    assert main(["keys", str(tmp_path), "--name", "client", "--force"]) == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_gguf, latency_fit, tmp_path):
    require_module("prometheus_client")
    endpoint, port = f"ipc://{tmp_path}/serve.sock", free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ricllm.cli", "serve", "--zmq", endpoint, "--http-port", str(port), "--model",
         str(tiny_gguf), "--latency-fit", str(latency_fit), "--kv-cache-budget", "4MiB", "--threads", "2",
         "--max-num-seqs", "1", "--drain-timeout", "120", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "CONFIG_FILE"})
    ready_url = f"http://127.0.0.1:{port}/ric/v1/health/ready"
    try:
        wait_for(lambda: _probe(ready_url) == 200 or process.poll() is not None, 90, "the server to be ready")
        assert process.poll() is None
        dealer = Dealer(endpoint)
        ids = [f"drain-{i}" for i in range(4)]
        # Long enough (4 x 400 decode steps, one request at a time) that the drain outlasts the probe
        # loop and the late request by a wide margin however fast the machine decodes: 40 tokens once
        # finished before the probe saw the 503, and 4 x 400 batched once drained before "late" came.
        # The 120 s drain timeout keeps a slow, busy machine from cancelling them instead.
        for rid in ids:
            dealer.send(generate(rid, prompt=f"{rid} keeps talking", max_tokens=400, ignore_eos=True,
                                 **({"deadline_ms": 60_000.0} if rid.endswith("0") else {})))
        accepted, finals = set(), {}
        while accepted != set(ids):  # all admitted: now they are in flight
            reply = dealer.recv(30)
            if p.is_final(reply):
                finals[reply.id] = reply
            else:
                accepted.add(reply.id)
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: _probe(ready_url) == 503, 10, "readiness to drop")
        dealer.send(generate("late", prompt="too late", max_tokens=2))
        while len(finals) < len(ids) + 1:
            reply = dealer.recv(60)
            if p.is_final(reply):
                finals[reply.id] = reply
        dealer.close()
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=30)
    assert finals["late"].type == "rejected" and finals["late"].code == "DRAINING"
    for rid in ids:
        assert finals[rid].type == "result" and len(finals[rid].token_ids) == 400, stderr[-2000:]
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    done = {e["id"]: e for e in events if e.get("event") == "request_done"}
    assert set(done) == {*ids, "late"}
    assert done["drain-0"]["admitted"] is True and done["drain-0"]["deadline_met"] is True
    assert done["late"]["admitted"] is False and done["late"]["reason"] == "DRAINING"
    assert {"e2e_ms", "ttft_ms", "queue_ms", "template"} <= set(done["drain-1"])


def _probe(url: str) -> int | None:
    try:
        return http_get(url)[0]
    except OSError:
        return None


def test_the_native_runtime_serves_templates_deadlines_and_streams(start_server, tiny_native_gguf):
    """The service on the native runtime (no torch in the engine): template reuse, a deadline
    promise kept, a stream, and stats that name the runtime."""
    server = start_server(engine=dict(model=str(tiny_native_gguf), dtype="auto", weights="int4", runtime="native",
                                      weight_cache=False))
    user = [{"role": "user", "content": "PRB usage 92% on cell 17"}]
    with RicClient(server.endpoint, timeout_s=30) as client:
        assert client.stats().model_dump()["model"]["runtime"] == "native"
        registered = client.register_template(LONG_SYSTEM, template_id="ran-config")
        client.generate(messages=user, template_id="ran-config", max_tokens=3, ignore_eos=True)
        second = client.generate(messages=user, template_id="ran-config", max_tokens=4, ignore_eos=True,
                                 deadline_ms=5000)
        assert second.num_cached_tokens >= registered.num_pinned_tokens > 0
        assert second.deadline_met is True and len(second.token_ids) == 4
        replies = list(client.stream("hello", max_tokens=5, ignore_eos=True))
    assert [r.token_id for r in replies[:-1]] == replies[-1].token_ids and len(replies) == 6
