"""Full garbage collections wait for the engine loop's idle rounds: one that fires between two steps
stalls every request in them (``ricllm/engine/collector.py``)."""

from __future__ import annotations

import gc
import time

from ricllm import SamplingParams
from ricllm.config import EngineConfig
from ricllm.engine.async_engine import EngineThread
from ricllm.engine.collector import FullCollections
from tests.helpers import output_tail, python_with_env


def full_collections_seen() -> list[int]:
    """Generation-2 collections, as they end."""
    seen: list[int] = []
    gc.callbacks.append(lambda phase, info: seen.append(info["collected"])
                        if phase == "stop" and info["generation"] == 2 else None)
    return seen


def survivors(count: int) -> list:
    """Objects that live on (each with a cycle), as a request's records do: they age into the old
    generation until its growth sets off a full collection."""
    kept = []
    for _ in range(count):
        node: dict = {}
        node["self"] = node
        kept.append(node)
    return kept


def in_a_fresh_interpreter(check: str) -> None:
    """Runs ``check``, a function of this module, in a child: a test's process may hold engine loops
    that other tests left running, and those collect on their own threads at their idle rounds."""
    done = python_with_env({}, "-c", f"import tests.test_collector as t; t.{check}()", timeout=120)
    assert done.returncode == 0, output_tail(done)


def automatic_full_collections_wait_for_an_idle_round() -> None:
    full_collections = full_collections_seen()
    gc.collect()
    growth = len(gc.get_objects(generation=2)) // 4 + 100_000
    full_collections.clear()
    unheld = survivors(growth)
    assert full_collections, "this much growth sets off a full collection on its own"
    gc.collect()
    full_collections.clear()
    growth = len(gc.get_objects(generation=2)) // 4 + 100_000
    loop = FullCollections(deferred_limit=10**9)
    before = gc.get_threshold()
    loop.hold()
    try:
        held = survivors(growth)
        loop.after_round(idle=False)
        assert full_collections == []
        loop.after_round(idle=True)
        assert len(full_collections) == 1 and loop.collections == 1
    finally:
        loop.release()
    assert gc.get_threshold() == before
    del unheld, held


def a_loop_that_is_never_idle_still_collects_after_the_deferred_limit() -> None:
    full_collections = full_collections_seen()
    loop = FullCollections(deferred_limit=3)
    loop.hold()
    try:
        kept = []
        while gc.get_count()[2] < 3:
            kept += survivors(1_000)
        assert full_collections == []
        loop.after_round(idle=False)
        assert len(full_collections) == 1 and gc.get_count()[2] == 0
    finally:
        loop.release()


def test_automatic_full_collections_wait_for_an_idle_round():
    in_a_fresh_interpreter("automatic_full_collections_wait_for_an_idle_round")


def test_a_loop_that_is_never_idle_still_collects_after_the_deferred_limit():
    in_a_fresh_interpreter("a_loop_that_is_never_idle_still_collects_after_the_deferred_limit")


def test_the_engine_loop_holds_full_collections_while_it_runs_and_gives_them_back(tiny_gguf):
    before = gc.get_threshold()
    worker = EngineThread(EngineConfig(model=str(tiny_gguf), dtype="float32"))
    try:
        out = worker.submit("hello", SamplingParams(max_tokens=4, ignore_eos=True)).result(timeout=60)
        assert len(out.token_ids) == 4
        assert worker.call(lambda engine: gc.get_threshold()[2]).result(timeout=30) > 10**9
        kept = survivors(50_000)  # ages some objects: an idle round collects them
        time.sleep(0.3)
        assert gc.get_count()[2] == 0
    finally:
        worker.stop(timeout=30)
    assert gc.get_threshold() == before
    del kept
