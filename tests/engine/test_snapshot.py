"""``LLMEngine.snapshot()`` is the one place the engine's numbers are gathered: the KV cache, the
queues, admission's counts, deadlines and slack, and the report a replay records all come from it."""

from __future__ import annotations

from ricllm.config import EngineConfig
from ricllm.engine.llm_engine import LLMEngine
from ricllm.sampling_params import SamplingParams


def test_the_snapshot_holds_what_admission_did(tiny_gguf):
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", kv_cache_budget=64 * 16 * 512,
                                    admission={"policy": "deadline", "safety_margin": 0.0}))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, deadline_ms=60_000, ignore_eos=True))
    refused = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, deadline_ms=0.001, ignore_eos=True))
    assert refused.rejection is not None
    while engine.has_unfinished():
        engine.step()
    snap = engine.snapshot()
    assert (snap.admitted, snap.rejected, snap.deadlines_met, snap.deadlines_missed) == (
        1, {"DEADLINE_INFEASIBLE": 1}, 1, 0)
    assert len(snap.slack_ms) == 1 and 0 < snap.slack_ms[0] < 60_000
    assert snap.kv_cache.used_blocks == 0 and snap.steps >= 2 and snap.caps
    report = snap.admission_report()
    assert report["deadlines"] == {"met": 1, "missed": 0, "ended_early": 0}
    assert report["slack_ms"]["p50"] == snap.slack_ms[0] and report["rejected"] == {"DEADLINE_INFEASIBLE": 1}
    assert report["caps"] == snap.caps and report["slowdowns"] == []


def test_no_other_stats_builder(tiny_gguf):
    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32"))
    assert not hasattr(engine, "admission_stats") and not hasattr(engine, "kv_cache_stats")
    assert engine.snapshot().admission_report()["policy"] == "off"
