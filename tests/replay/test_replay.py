"""End-to-end replays with the tiny random model and a stored latency fit (no calibration):
in-process, interrupted by Ctrl-C, and over ZeroMQ against a real ``ricllm serve``. Each report's
aggregates are recomputed here from its own ``requests`` records, and the HTML must show them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ricllm.cli import main
from tests.helpers import IN_CI, cache_with_kernels, require_module

ROOT = Path(__file__).parents[2]
FIT = [0.003, 2e-5, 2e-4, 1e-7, 0.0]  # 3 ms a step: a 1 ms deadline is never feasible

SCENARIO = """\
name: tiny-e2e
seed: 3
trace:
  generator: {{cells: 3, duration_s: 4, interval_s: 0.5, seed: 1}}
pacing: {{speed: {speed}, drain_timeout_s: 30}}
triggers:
  - every_row
classes:
  near_rt: {{deadline_ms: 2000, max_tokens: 4, weight: 3, ignore_eos: true}}
  non_rt: {{deadline_ms: 8000, max_tokens: 8, weight: 1, ignore_eos: true}}
  impossible: {{deadline_ms: 1, max_tokens: 8, weight: 1}}
{extra_classes}prompts:
  templates:
    alpha: "You are a tiny RAN assistant for congestion. Answer with one short word, please."
    beta: "You are a tiny RAN assistant for energy saving. Answer with one short word, please."
  user_prompt: "cell {{{{ entity }}}} prb {{{{ kpi['RRU.PrbTotDl'] | fmt(0) }}}}"
engine:
  model: {model}
  latency_fit: {fit}
  dtype: float32
  kv_cache_budget: 2MiB
targets:
  overall: ["met_of_admitted >= 0.5", "met_of_sent >= 0.99"]
"""


@pytest.fixture(scope="module")
def fit_file(tmp_path_factory) -> Path:
    from ricllm.engine.latency_model import LatencyModel

    path = tmp_path_factory.mktemp("fit") / "fit.json"
    LatencyModel(list(FIT)).save(path)
    return path


def scenario_file(folder: Path, model: Path, fit: Path, speed: float = 4.0, extra_classes: str = "",
                  duration_s: float = 4, cells: int = 3) -> Path:
    text = SCENARIO.format(model=model, fit=fit, speed=speed, extra_classes=extra_classes)
    path = folder / "tiny.yaml"
    path.write_text(text.replace("duration_s: 4,", f"duration_s: {duration_s},").replace("cells: 3,", f"cells: {cells},"))
    return path


@pytest.fixture(scope="module")
def replayed(tiny_gguf, fit_file, tmp_path_factory) -> tuple[int, Path]:
    """One in-process replay (about 2 s of arrivals) shared by the report tests."""
    folder = tmp_path_factory.mktemp("replay")
    path = scenario_file(folder, tiny_gguf, fit_file)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(folder / "cache"))
        code = main(["replay", str(path), "--out", str(folder / "report"), "--no-progress"])
    return code, folder / "report"


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered) / 100) - 1)]


def recompute(requests: list[dict], wall_s: float) -> dict:
    """The aggregates from the records alone, written independently of ricllm.report.aggregate."""
    admitted = [r for r in requests if r["admitted"]]
    met = [r for r in requests if r["met"]]
    completed = [r for r in requests if r["status"] == "completed"]
    e2e = [r["server_e2e_s"] for r in completed]
    return {"sent": len(requests), "admitted": len(admitted), "met": len(met),
            "rejected_by_reason": dict(Counter(r["rejection_code"] for r in requests if r["status"] == "rejected")),
            "met_of_admitted": len(met) / len(admitted), "met_of_sent": len(met) / len(requests),
            "goodput_rps": len(met) / wall_s, "p95_e2e_s": nearest_rank(e2e, 95),
            "p50_ttft_s": nearest_rank([r["server_ttft_s"] for r in completed], 50),
            "prefix_cache_hit_rate": (sum(r["cached_tokens"] for r in completed)
                                      / sum(r["prompt_tokens"] for r in completed)),
            **bound_figures(completed)}


def bound_figures(completed: list[dict]) -> dict:
    """Admission's bound over the measured e2e, per promised request that completed."""
    ratios = [r["predicted_e2e_s"] / r["server_e2e_s"] for r in completed if r["predicted_e2e_s"] is not None]
    return {"bound_requests": len(ratios), "bound_below_actual": len([x for x in ratios if x < 1]),
            "bound_over_actual_p50": nearest_rank(ratios, 50), "bound_over_actual_p99": nearest_rank(ratios, 99)}


class PageText(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.images: list[str] = []

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"])


def parse_html(path: Path) -> PageText:
    page = PageText()
    page.feed(path.read_text())
    page.close()
    return page


def test_in_process_replay_report_agrees_with_its_records(replayed, tiny_gguf):
    code, folder = replayed
    report = json.loads((folder / "report.json").read_text())
    requests, overall = report["requests"], report["aggregates"]["overall"]
    assert code == 1 and report["compliant"] is False  # the impossible class makes met_of_sent >= 0.99 fail
    assert [t["passed"] for t in report["targets"]] == [True, False]
    assert report["schema_version"] == 1 and report["run"]["mode"] == "in_process"
    assert report["run"]["planned"] == report["run"]["sent"] == len(requests) == 24
    assert {r["status"] for r in requests} <= {"completed", "rejected"}
    impossible = [r for r in requests if r["deadline_class"] == "impossible"]
    assert impossible and all(r["rejection_code"] == "DEADLINE_INFEASIBLE" and r["met"] is False for r in impossible)
    expected = recompute(requests, report["run"]["wall_s"])
    for key, value in expected.items():
        assert overall[key] == pytest.approx(value), key
    for cls, summary in report["aggregates"]["classes"].items():
        own = [r for r in requests if r["deadline_class"] == cls]
        assert summary["sent"] == len(own) and summary["met"] == sum(1 for r in own if r["met"])
        finished = [r for r in own if r["status"] == "completed"]
        if finished:
            for key, value in bound_figures(finished).items():
                assert summary[key] == pytest.approx(value), (cls, key)
    completed = [r for r in requests if r["status"] == "completed"]
    assert overall["bound_requests"] == len(completed) > 0  # every completed request here was promised
    pinned = {name: t["pinned_tokens"] for name, t in report["scenario"]["templates"].items()}
    for r in requests:
        if r["status"] == "completed":
            assert r["output_tokens"] == r["max_tokens"] and r["cached_tokens"] >= pinned[r["template"]] > 0
            assert r["server_e2e_s"] <= r["client_e2e_s"] + 1e-3 and r["server_ttft_s"] <= r["server_e2e_s"]
            assert r["sent_s"] >= r["scheduled_s"] - 1e-6
    assert report["model"]["sha256"] == hashlib.sha256(Path(tiny_gguf).read_bytes()).hexdigest()
    assert report["machine"]["cores"] and report["machine"]["torch"]
    assert report["trace"]["load_stats"]["rows_kept"] == 24 and report["trace"]["series"]["entities"]
    samples = report["timeline"]
    assert samples and all(s["kv_num_blocks"] and s["kv_used_blocks"] >= s["kv_pinned_blocks"] > 0 for s in samples)
    assert overall["peak_kv_used_blocks"] >= max(s["kv_used_blocks"] for s in samples)


def test_html_is_self_contained_and_shows_the_numbers(replayed):
    _, folder = replayed
    report = json.loads((folder / "report.json").read_text())
    page = parse_html(folder / "report.html")
    text = " ".join(page.text)
    expected = recompute(report["requests"], report["run"]["wall_s"])
    for shown in (f"{expected['met_of_admitted'] * 100:.1f}%", f"{expected['met_of_sent'] * 100:.1f}%",
                  f"{expected['goodput_rps']:.3f}/s", f"{expected['p95_e2e_s'] * 1000:.1f} ms",
                  f"{expected['prefix_cache_hit_rate'] * 100:.1f}%", "DEADLINE_INFEASIBLE", "FAIL", "near_rt",
                  "finish bound / actual, p50", f"{expected['bound_over_actual_p50']:.3g}", "Refusals"):
        assert shown in text, shown
    refused = [r for r in report["requests"] if r["status"] == "rejected"]
    assert refused and all(r["rejection_message"] in text for r in refused)
    assert all(f"{r['rejection_numbers']['bound_ms']:.4f}" in text for r in refused
               if r["rejection_code"] == "DEADLINE_INFEASIBLE")
    assert len(page.images) == 3 and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert "http://" not in (folder / "report.html").read_text().replace("http://www.w3.org", "")
    for png in ("latency_cdf.png", "timeline.png", "trace.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rerenders_and_compares(replayed, tiny_gguf, fit_file, tmp_path, capsys):
    _, folder = replayed
    copy = tmp_path / "rendered"
    shutil.copytree(folder, copy)
    (copy / "report.html").unlink()
    (copy / "trace.png").unlink()
    assert main(["report", str(copy / "report.json")]) == 0
    assert "near_rt" in " ".join(parse_html(copy / "report.html").text) and (copy / "trace.png").is_file()
    assert "met % adm." in capsys.readouterr().out
    # prefix caching off: the same trace, the same requests, no cached tokens
    off = tmp_path / "off"
    scenario = scenario_file(tmp_path, tiny_gguf, fit_file)
    main(["replay", str(scenario), "--out", str(off), "--no-progress", "--set", "engine.enable_prefix_caching=false"])
    off_report = json.loads((off / "report.json").read_text())
    assert off_report["aggregates"]["overall"]["prefix_cache_hit_rate"] == 0
    assert main(["report", str(folder), str(off), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "prefix-cache hit rate" in out and "report" in out and "off" in out
    page = " ".join(parse_html(tmp_path / "cmp" / "comparison.html").text)
    hit = json.loads((folder / "report.json").read_text())["aggregates"]["overall"]["prefix_cache_hit_rate"]
    assert f"{hit * 100:.1f}%" in page and "0.0%" in page and f"{-hit * 100:+.1f} pp" in page


def test_report_errors_are_user_errors(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"schema_version": 99}')
    assert main(["report", str(tmp_path)]) == 2
    assert "schema_version 99" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_ctrl_c_still_writes_the_report(tiny_gguf, fit_file, tmp_path):
    # 100 cells a tick, mostly 300-token answers: ~25,000 tokens of work every 0.5 s keeps a queue on any
    # CPU, so requests are still outstanding when Ctrl-C comes, however fast the engine decodes.
    long_class = "  long: {deadline_ms: null, max_tokens: 300, weight: 20, ignore_eos: true}\n"
    scenario = scenario_file(tmp_path, tiny_gguf, fit_file, speed=1.0, extra_classes=long_class, duration_s=30,
                             cells=100)
    out = tmp_path / "report"
    env = {**os.environ, "RICLLM_CACHE_DIR": str(cache_with_kernels(tmp_path / "cache"))}
    process = subprocess.Popen([sys.executable, "-m", "ricllm.cli", "replay", str(scenario), "--out", str(out),
                                "--no-progress"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    for line in process.stderr:
        if line.startswith("replaying") or time.monotonic() > deadline:
            break
    time.sleep(2.0)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=60)
    assert process.returncode == 130, rest
    report = json.loads((out / "report.json").read_text())
    statuses = Counter(r["status"] for r in report["requests"])
    assert report["run"]["interrupted"] and 0 < report["run"]["sent"] < report["run"]["planned"]
    assert statuses["interrupted"] >= 1 and set(statuses) <= {"completed", "rejected", "interrupted"}
    assert report["aggregates"]["overall"]["interrupted"] == statuses["interrupted"]
    assert "interrupted" in " ".join(parse_html(out / "report.html").text).lower()


DECISIONS = """\
name: tiny-decisions
seed: 3
trace:
  generator: {{cells: 3, duration_s: 4, interval_s: 0.5, seed: 1, outages: 1}}
pacing: {{speed: 4, drain_timeout_s: 30}}
triggers:
  - every_row
classes:
  near_rt: {{deadline_ms: 4000, max_tokens: 16, temperature: 1.0}}
prompts:
  templates:
    congestion:
      system: "You are a tiny RAN assistant for congestion. Answer with one action."
      examples:
        - {{user: "cell cell9 prb 90 sinr 3.0", assistant: offload}}
        - {{user: "cell cell8 prb 10 sinr 9.0", assistant: hold}}
      choice: [offload, hold, escalate]
      expect:
        - when: "RRU.PrbTotDl > 50"
          then: {{answer: offload}}
        - when: "missing(L1M.DL-SS-SINR)"
          then: {{answer: escalate}}
        - otherwise: {{answer: hold}}
  user_prompt: "cell {{{{ entity }}}} prb {{{{ kpi['RRU.PrbTotDl'] | fmt(0) }}}} sinr {{{{ kpi['L1M.DL-SS-SINR'] | fmt(1) }}}}"
engine:
  model: {model}
  latency_fit: {fit}
  dtype: float32
  kv_cache_budget: 2MiB
targets:
  overall: ["valid_of_answered >= 1.0"]
"""


def policy_answer(kpis: dict) -> str:
    """DECISIONS' policy, written out again."""
    if kpis["RRU.PrbTotDl"] is not None and kpis["RRU.PrbTotDl"] > 50:
        return "offload"
    return "escalate" if kpis["L1M.DL-SS-SINR"] is None else "hold"


@pytest.fixture(scope="module")
def decisions_replayed(tiny_gguf, fit_file, tmp_path_factory) -> tuple[int, Path, Path]:
    """One in-process replay of DECISIONS: (exit code, scenario file, report folder)."""
    folder = tmp_path_factory.mktemp("decisions")
    path = folder / "decisions.yaml"
    path.write_text(DECISIONS.format(model=tiny_gguf, fit=fit_file))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(folder / "cache"))
        code = main(["replay", str(path), "--out", str(folder / "report"), "--no-progress"])
    return code, path, folder / "report"


def check_decisions(report: dict, scenario: Path) -> None:
    """Every answer one of the choices, each judged against the policy's answer for its own row."""
    from ricllm.replay.loading import load_scenario, load_scenario_trace

    assert report["compliant"], report["targets"]
    rows = {(r.entity, r.time_s): r.kpis for r in load_scenario_trace(load_scenario(scenario)).rows}
    requests = report["requests"]
    assert len(requests) == 24 and all(r["status"] == "completed" and r["finish_reason"] == "stop" for r in requests)
    for r in requests:
        expected = policy_answer(rows[(r["entity"], r["trace_time_s"])])
        assert r["valid"] is True and r["text"] in ("offload", "hold", "escalate") and r["answer"] == {"answer": r["text"]}
        assert r["expected"] == {"answer": expected} and r["correct"] is (r["text"] == expected)
        assert isinstance(r["num_forced_tokens"], int)
    assert {r["expected"]["answer"] for r in requests} >= {"escalate", "hold"}  # the outage's dark rows escalate
    overall = report["aggregates"]["overall"]
    assert overall["valid_of_answered"] == 1.0 and overall["answered"] == 24
    assert overall["correct_of_answered"] == sum(r["correct"] for r in requests) / 24
    matrix = overall["confusion"]["congestion"]["answer"]
    assert sum(sum(row.values()) for row in matrix.values()) == 24 and all("invalid" not in row for row in matrix.values())
    # the worked examples are pinned with the system prompt, and every request reuses them
    template = report["scenario"]["templates"]["congestion"]
    assert template["examples"] == 2 and template["constraint"] == "choice"
    assert all(r["cached_tokens"] >= template["pinned_tokens"] > 0 for r in requests)


def test_a_choice_template_gets_only_valid_answers_and_they_are_judged(decisions_replayed, capsys):
    """The random model, sampling at temperature 1, answers only with one of the choices once the engine
    applies the template's constraint; each answer is judged against the policy's answer for its row."""
    code, scenario, folder = decisions_replayed
    assert code == 0
    check_decisions(json.loads((folder / "report.json").read_text()), scenario)
    assert (folder / "decisions.png").read_bytes().startswith(b"\x89PNG")
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "valid % answ." in out and "100.0%" in out


def with_fallback(scenario: Path, folder: Path, min_confidence: float = 0.3) -> Path:
    """DECISIONS whose template answers escalate below ``min_confidence``, a level fixed here before any
    answer is scored (the random model's three-way decisions sit near 0.2 and near 0.33)."""
    text = scenario.read_text().replace("      choice: [offload, hold, escalate]\n", (
        f"      choice: [offload, hold, escalate]\n      min_confidence: {min_confidence}\n      fallback: escalate\n"))
    path = folder / "fallback.yaml"
    path.write_text(text)
    return path


def check_fallbacks(report: dict, min_confidence: float = 0.3) -> None:
    """Every answer carries its confidence; exactly those below min_confidence answered the fallback,
    judged as the answer and counted; accuracy by confidence is recomputed from the records."""
    requests = report["requests"]
    assert len(requests) == 24 and all(r["status"] == "completed" and r["valid"] for r in requests)
    fell_back = [r for r in requests if r["finish_reason"] == "fallback"]
    assert fell_back and len(fell_back) < 24  # both kinds, at this level
    for r in requests:
        assert 0 < r["confidence"] < 1 and (r["finish_reason"] == "fallback") is (r["confidence"] < min_confidence)
        expected = r["expected"]["answer"]
        assert r["correct"] is (r["text"] == expected)  # a fallback is judged as the answer
        own = r["model_text"] if r["finish_reason"] == "fallback" else r["text"]
        assert own in ("offload", "hold", "escalate") and r["model_correct"] is (own == expected)
    assert all(r["text"] == "escalate" for r in fell_back)
    assert all(r["model_text"] is None for r in requests if r["finish_reason"] == "stop")
    aggregates = report["aggregates"]
    assert aggregates["overall"]["fallback"] == len(fell_back) and aggregates["overall"]["answered"] == 24
    assert aggregates["overall"]["correct_of_answered"] == sum(r["correct"] for r in requests) / 24
    bins = aggregates["confidence"]["reliability"]
    assert sum(b["count"] for b in bins) == 24
    for b in bins:
        inside = [r for r in requests if b["low"] <= r["confidence"] < b["high"]]
        assert b["count"] == len(inside) and b["accuracy"] == sum(r["model_correct"] for r in inside) / len(inside)
    ranked = sorted(requests, key=lambda r: -r["confidence"])
    for level in aggregates["confidence"]["coverage"]:
        kept = ranked[:level["kept"]]
        assert level["kept"] == max(1, math.ceil(level["coverage"] * 24 - 1e-9))
        assert level["accuracy"] == sum(r["model_correct"] for r in kept) / len(kept)
    assert aggregates["confidence"]["coverage"][-1]["kept"] == 24
    template = report["scenario"]["templates"]["congestion"]
    assert (template["min_confidence"], template["fallback"]) == (min_confidence, "escalate")


def test_a_template_with_a_fallback_answers_it_below_min_confidence_and_the_report_counts_it(
        decisions_replayed, tmp_path, capsys):
    _, scenario, _ = decisions_replayed
    path, out = with_fallback(scenario, tmp_path), tmp_path / "report"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["replay", str(path), "--out", str(out), "--no-progress"]) == 0
    check_fallbacks(json.loads((out / "report.json").read_text()))
    printed = capsys.readouterr().out
    assert "fell back" in printed and "accuracy by confidence" in printed and "accuracy keeping the most confident" in printed
    page = " ".join(parse_html(out / "report.html").text)
    assert "Accuracy by confidence" in page and "Accuracy against coverage" in page


def test_zeromq_replay_path_imports_no_torch(tmp_path):
    code = ("import sys\n"
            "from ricllm.cli import build_parser\n"
            "from ricllm.replay import cli, engine_backend, reporting, runner, zmq_backend\n"
            "from ricllm.replay.loading import load_scenario, load_scenario_trace\n"
            "from ricllm.replay.planning import plan_requests\n"
            "from ricllm.report import aggregate, html, terminal, plots\n"
            "scenario = load_scenario('default')\n"
            "plan = plan_requests(scenario, load_scenario_trace(scenario))\n"
            "backend = zmq_backend.ZmqBackend('tcp://127.0.0.1:9', timeout_s=1)\n"
            "build_parser().parse_args(['replay', 'default', '--endpoint', 'tcp://127.0.0.1:9'])\n"
            "sys.exit('torch' in sys.modules)\n")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


# ------------------------------------------------------------------------------ over ZeroMQ

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"ricllm serve exited with {process.returncode}: {process.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout_s} s")


def server_available() -> None:
    """The replay needs a real server; outside CI a checkout without it skips with the reason."""
    if importlib.util.find_spec("ricllm.serve.server") is None:
        if IN_CI:
            pytest.fail("ricllm.serve.server is missing (CI=true: the ZeroMQ replay must run)")
        pytest.skip("ricllm.serve.server is not importable yet: the ZeroMQ replay needs `ricllm serve`")
    require_module("prometheus_client")


@pytest.fixture(scope="module")
def serve(tiny_gguf, fit_file, tmp_path_factory):
    """`ricllm serve` in a subprocess, configured by a descriptor file, on free ports; one server for
    the module's ZeroMQ replays, each of which registers its own templates."""
    server_available()
    tmp_path = tmp_path_factory.mktemp("serve")
    descriptor = json.loads((ROOT / "xapp_descriptor" / "config-file.json").read_text())
    descriptor["controls"].update(model=str(tiny_gguf), latency_fit=str(fit_file), dtype="float32",
                                  kv_cache_budget="2MiB", log_format="console", threads=1)
    config = tmp_path / "config-file.json"
    config.write_text(json.dumps(descriptor))
    zmq_port, http_port = free_port(), free_port()
    env = {**os.environ, "RICLLM_CACHE_DIR": str(cache_with_kernels(tmp_path / "cache"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "ricllm.cli", "serve", "--model", str(tiny_gguf), "--zmq", f"tcp://127.0.0.1:{zmq_port}",
         "--http-port", str(http_port), "--config", str(config)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{http_port}/ric/v1/health/ready", process, 120)
        yield f"tcp://127.0.0.1:{zmq_port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_replay_over_zeromq_against_ricllm_serve(serve, tiny_gguf, fit_file, tmp_path):
    scenario = scenario_file(tmp_path, tiny_gguf, fit_file)
    out = tmp_path / "report"
    code = ("import sys\nfrom ricllm.cli import main\n"
            f"code = main(['replay', {str(scenario)!r}, '--endpoint', {serve!r}, '--out', {str(out)!r}, "
            "'--no-progress'])\n"
            "print('torch loaded:', 'torch' in sys.modules)\nsys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stderr  # the impossible class misses met_of_sent >= 0.99
    assert "torch loaded: False" in result.stdout
    report = json.loads((out / "report.json").read_text())
    requests = report["requests"]
    assert report["run"]["mode"] == "zmq" and report["run"]["endpoint"] == serve and len(requests) == 24
    assert {r["status"] for r in requests} <= {"completed", "rejected"}
    assert all(r["rejection_code"] == "DEADLINE_INFEASIBLE" for r in requests if r["deadline_class"] == "impossible")
    assert {name: t["template_id"].split("-")[0] for name, t in report["scenario"]["templates"].items()} == {
        "alpha": "alpha", "beta": "beta"}
    completed = [r for r in requests if r["status"] == "completed"]
    assert completed and all(r["cached_tokens"] > 0 and r["server_e2e_s"] <= r["client_e2e_s"] for r in completed)
    for key, value in recompute(requests, report["run"]["wall_s"]).items():
        assert report["aggregates"]["overall"][key] == pytest.approx(value), key
    assert report["aggregates"]["overall"]["bound_requests"] == len(completed)  # carried over the wire
    assert any(s.get("kv_used_blocks") is not None for s in report["timeline"])
    assert report["engine"]["source"] == "server" and report["engine"]["server_stats"]


def uncompilable(scenario: Path, folder: Path) -> Path:
    """DECISIONS with a schema jsonschema accepts but the grammar engine cannot compile (``not``)."""
    text = scenario.read_text().replace("choice: [offload, hold, escalate]",
                                        "schema: {type: object, properties: {action: {not: {type: integer}}}}")
    text = text[:text.index("      expect:")] + text[text.index("  user_prompt:"):]
    path = folder / "uncompilable.yaml"
    path.write_text(text.replace("assistant: offload", "assistant: '{}'").replace("assistant: hold", "assistant: '{}'"))
    return path


def test_a_schema_the_engine_cannot_compile_stops_the_replay_naming_the_template(decisions_replayed, tmp_path,
                                                                                  capsys):
    _, scenario, _ = decisions_replayed
    path = uncompilable(scenario, tmp_path)
    engines_before = engine_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["replay", str(path), "--out", str(tmp_path / "report"), "--no-progress"]) == 2
    assert "template 'congestion': structured json cannot be compiled" in capsys.readouterr().err
    assert engine_threads() == engines_before  # the replay's engine stopped with it


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "ricllm-engine"}


def test_a_choice_template_over_zeromq(serve, decisions_replayed, tmp_path, capsys):
    """The server pins the same conversation (worked examples included) as the in-process engine, and
    its requests inherit the template's constraint: every answer valid. The same server then
    registers the template with a min_confidence and a fallback, and its results carry both."""
    _, scenario, in_process = decisions_replayed
    out = tmp_path / "report"
    assert main(["replay", str(scenario), "--endpoint", serve, "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    check_decisions(report, scenario)
    pinned = json.loads((in_process / "report.json").read_text())["scenario"]["templates"]["congestion"]
    template = report["scenario"]["templates"]["congestion"]
    assert template["template_id"].startswith("congestion-")
    assert (template["tokens"], template["pinned_tokens"]) == (pinned["tokens"], pinned["pinned_tokens"])
    out = tmp_path / "fallback-report"
    assert main(["replay", str(with_fallback(scenario, tmp_path)), "--endpoint", serve, "--out", str(out),
                 "--no-progress"]) == 0
    check_fallbacks(json.loads((out / "report.json").read_text()))
    # a template the server cannot compile: an error reply, named; the replay stops before sending anything
    capsys.readouterr()
    bad = uncompilable(scenario, tmp_path)
    assert main(["replay", str(bad), "--endpoint", serve, "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "template 'congestion': the server refused it:" in err and "cannot be compiled" in err, err


def test_a_class_chooses_its_kv_window_for_every_request_of_it(tiny_gguf, fit_file, tmp_path, monkeypatch):
    from ricllm.engine.llm_engine import LLMEngine

    windows = []
    original = LLMEngine.add_request

    def spy(self, prompt, params, *args, **kwargs):
        seq = original(self, prompt, params, *args, **kwargs)
        windows.append((params.max_tokens, seq.kv_window))
        return seq

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = scenario_file(tmp_path, tiny_gguf, fit_file, speed=8.0,
                         extra_classes="  windowed: {deadline_ms: 4000, max_tokens: 5, weight: 2, kv_window: 16,"
                                       " kv_sinks: 2}\n")
    main(["replay", str(path), "--out", str(tmp_path / "report"), "--no-progress"])
    windowed = [w for tokens, w in windows if tokens == 5]
    assert windowed and all(w is not None and (w.sinks, w.window) == (2, 16) for w in windowed)
    assert all(w is None for tokens, w in windows if tokens != 5)


ADAPTED = DECISIONS.replace("      choice: [offload, hold, escalate]\n", """      choice: [offload, hold, escalate]
      adapter:
        recipe: {{examples: 16, eval_examples: 8, steps: 3, batch_size: 4}}
""")


def test_a_template_with_an_adapter_recipe_trains_it_once_and_serves_under_it(tiny_gguf, fit_file, tmp_path, capsys):
    """The first replay trains the template's adapter (``ricllm adapt`` in a child process) and serves
    every request of the template under it, behind the adapter's own short system prompt pinned under
    it; the next replay finds it cached. ``--no-adapters`` serves the template as written."""
    require_module("peft")
    scenario = tmp_path / "adapted.yaml"
    scenario.write_text(ADAPTED.format(model=tiny_gguf, fit=fit_file))

    def replay(name: str, *flags: str) -> dict:
        assert main(["replay", str(scenario), "--out", str(tmp_path / name), "--no-progress", *flags]) == 0
        return json.loads((tmp_path / name / "report.json").read_text())

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
        first, second, plain = replay("first"), replay("second"), replay("plain", "--no-adapters")
    for report, trained in ((first, True), (second, False)):
        template = report["scenario"]["templates"]["congestion"]
        assert template["adapter"] == "congestion" and template["adapter_trained_now"] is trained
        assert template["examples"] == 0 and "congestion assistant" in template["system_prompt"]
        assert all(r["adapter"] == "congestion" for r in report["requests"])
        assert all(r["cached_tokens"] >= template["pinned_tokens"] > 0 for r in report["requests"])
    assert first["scenario"]["templates"]["congestion"]["adapter_folder"] == \
        second["scenario"]["templates"]["congestion"]["adapter_folder"]
    assert plain["scenario"]["templates"]["congestion"]["adapter"] is None
    assert all(r["adapter"] is None for r in plain["requests"])
    for report in (first, plain):
        table = report["aggregates"]["templates"]["congestion"]
        judged = [r for r in report["requests"] if r["expected"] is not None]
        majority = Counter(r["expected"]["answer"] for r in judged).most_common(1)[0][1]
        assert table["judged"] == len(judged) and table["majority_share"] == majority / len(judged)
        assert table["correct_of_judged"] == sum(r["correct"] for r in judged) / len(judged)
    assert "majority baseline" in capsys.readouterr().out


def test_an_adapter_made_for_other_text_is_refused_with_both_digests(tiny_gguf, fit_file, tmp_path, capsys):
    """An adapter folder's manifest names the template text and base model it was trained for: a
    template whose text differs stops the replay, naming both digests."""
    require_module("peft")
    trained = tmp_path / "adapter"
    assert main(["adapt", "default", "--template", "congestion", "--model", str(tiny_gguf), "--out", str(trained),
                 "--examples", "8", "--eval-examples", "4", "--steps", "1", "--batch-size", "4", "--no-progress"]) == 0
    scenario = tmp_path / "pathed.yaml"
    scenario.write_text(DECISIONS.format(model=tiny_gguf, fit=fit_file).replace(
        "      choice: [offload, hold, escalate]\n", f"      choice: [offload, hold, escalate]\n      adapter: {{path: {trained}}}\n"))
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
        code = main(["replay", str(scenario), "--out", str(tmp_path / "report"), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "trained for template text sha256" in err and "Traceback" not in err
    assert len(re.findall(r"\b[0-9a-f]{64}\b", err)) == 2
