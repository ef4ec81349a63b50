"""The hardware reaches admission, the scheduler and the latency model only as the capabilities a
runtime reports: the C kernels' limits where they run, none where every step runs alike."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from ricllm import LLM, SamplingParams
from ricllm.attention import cpu_policy
from ricllm.engine.admission import BestEffortLoad, Work, finish_bounds
from ricllm.engine.latency_model import LatencyModel
from ricllm.engine.runtime.capabilities import C_KERNEL_CAPABILITIES, C_KERNEL_LIMITS, NO_LIMITS
from ricllm.engine.runtime.torch_runtime import capabilities_of
from ricllm.engine.schedule_bound import schedule_bounds
from ricllm.engine.scheduler import StepFeatures
from ricllm.errors import ConfigError
from tests.helpers import require
from tests.test_admission import make_engine, prompt

ROOT = Path(__file__).resolve().parent.parent
POLICY = "ricllm.attention.cpu_policy"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_best_effort_prefill_is_held_to_the_kernel_limits_only_where_the_runtime_reports_them(tiny_gguf, backend):
    """Beside a promise, a best-effort prompt joins with the chunk admission allows: held to the C
    kernel's attention work with the ``cpu`` backend, the whole chunk with the torch reference."""
    if backend == "cpu":
        require(shutil.which("cc") is not None, "no C compiler (cc)")
    engine, _ = make_engine(tiny_gguf, attention_backend=backend, best_effort_chunk=256,
                            max_num_batched_tokens=512)
    limits = C_KERNEL_LIMITS if backend == "cpu" else None
    assert engine.runtime.attention_backend == backend
    assert engine.runtime.capabilities.kernel_limits == limits and engine.admission.latency.kernel_limits == limits
    promise = engine.add_request(prompt(8, 1), SamplingParams(max_tokens=40, deadline_ms=60_000, ignore_eos=True))
    engine.step()
    bulk = engine.add_request(prompt(400, 2), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert promise.promised and not bulk.promised
    held = 256 if limits is None else max(m for m in range(257) if m * m <= limits.prefill_work)
    assert bulk.num_computed_tokens == held
    assert (held < 256) == (backend == "cpu")


def test_without_kernel_limits_no_bound_charges_op_by_op_terms_or_caps_best_effort_work():
    work = Work(deadline=1.0, prefill_left=600, decode_left=3, final_context=603)
    load = BestEffortLoad(2, 8000, longest_pending=4000)  # 32 x 4000 > the C kernel's work
    for limits, op_steps, chunk_work in ((C_KERNEL_LIMITS, 2, 64 * 512), (None, 0, 32 * 4000)):
        only_op = LatencyModel([0.0, 0.0, 0.0, 0.0, 0.0, 0.05], kernel_limits=limits)
        assert only_op.predict(StepFeatures(600, 0, 600, 600 * 600)) == pytest.approx(0.05 * bool(op_steps))
        assert finish_bounds([work], only_op, 512, 0.0) == pytest.approx([op_steps * 0.05])
        assert schedule_bounds([work], only_op, 512, 0.0, BestEffortLoad()) == pytest.approx([op_steps * 0.05])
        attention = LatencyModel([0.0, 0.0, 0.0, 0.0, 1e-7], kernel_limits=limits)
        decoding = Work(deadline=1.0, prefill_left=0, decode_left=10, final_context=100)
        bound = finish_bounds([decoding], attention, 512, 0.0, best_effort=load, best_effort_chunk=32)[0]
        assert bound == pytest.approx(10 * chunk_work * 1e-7)


def test_only_the_cpu_backend_gives_the_torch_runtime_kernel_limits():
    assert capabilities_of("cpu") == C_KERNEL_CAPABILITIES
    for backend in ("torch", "triton", "cuda"):
        assert capabilities_of(backend) == NO_LIMITS and NO_LIMITS.kernel_limits is None


def test_the_native_runtime_reports_the_c_kernels_limits(tiny_native_gguf):
    try:
        llm = LLM(str(tiny_native_gguf), weights="int4", runtime="native", weight_cache=False, kv_cache_budget="4MiB")
    except ConfigError as exc:
        pytest.skip(str(exc))
    assert llm.engine.runtime.capabilities == C_KERNEL_CAPABILITIES


def policy_importers() -> set[str]:
    """Every file under ricllm/ that imports ``cpu_policy``, or one of its names from wherever
    (``attention.backends`` passes them on), at any depth of its code."""
    policy_names = {name for name in vars(cpu_policy) if not name.startswith("_") and name != "annotations"}
    found = set()
    for path in sorted((ROOT / "ricllm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if POLICY in names or isinstance(node, ast.ImportFrom) and policy_names & {a.name for a in node.names}:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_only_the_runtimes_and_attention_read_the_cpu_kernels_policy():
    importers = policy_importers()
    assert {"ricllm/engine/runtime/capabilities.py", "ricllm/attention/backends.py"} <= importers  # it sees them
    strays = sorted(p for p in importers if not p.startswith(("ricllm/engine/runtime/", "ricllm/attention/")))
    assert not strays, f"cpu_policy reaches the engine past the runtimes' capabilities: {strays}"
