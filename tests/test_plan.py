"""The capacity planner: seed numbers, grid cells against the KV equation, boundaries, what-ifs, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ricllm.errors import RicllmError
from ricllm.plan import (
    adapters_bytes,
    NAMED_SHAPES, PlanError, format_size, kv_bytes_per_token, kv_cache_bytes, kv_product, parse_bandwidth, plan,
    render_text, resolve_model,
)

LLAMA3, LLAMA2_70B, SMOLLM2 = NAMED_SHAPES["llama-3-8b"], NAMED_SHAPES["llama-2-70b"], NAMED_SHAPES["smollm2-135m"]
GiB = 2**30


def ricllm(*args):
    return subprocess.run([sys.executable, "-m", "ricllm.cli", *args], capture_output=True, text=True, timeout=120)


def equation(layers, context, kv_heads, head_dim, b, batch):
    """M_KV = 2·L·n·n_kv·d_h·b·B, written out independently of ricllm."""
    return 2 * layers * context * kv_heads * head_dim * b * batch


# ---------------------------------------------------------------- seed numbers


def test_llama3_8b_fp16_bytes_per_token_and_100k_sequence():
    assert kv_bytes_per_token(LLAMA3, 2) == 131_072 == LLAMA3.kv_bytes_per_token(2)
    assert kv_product(LLAMA3, 2) == "2·32·8·128·2 = 131,072 B"
    one_100k = kv_cache_bytes(LLAMA3, 100_000, 1, 2)
    assert one_100k == 13_107_200_000
    assert format_size(one_100k) == "13.11 GB (12.21 GiB)"


def test_llama2_70b_bytes_per_token_and_128k_context():
    per_token = kv_bytes_per_token(LLAMA2_70B, 2)
    assert per_token == 327_680
    assert round(per_token / 2**20, 2) == 0.31  # the seed's "0.31 MB" is MiB: 327,680 B is 0.33 MB
    assert kv_cache_bytes(LLAMA2_70B, 131_072, 1, 2) == 42_949_672_960 == 40 * GiB


def test_seed_000_4096_token_example_is_1_34_gb_not_2_7():
    one_sequence = kv_cache_bytes(LLAMA2_70B, 4096, 1, 2)
    assert one_sequence == 2 * 80 * 4096 * 8 * 128 * 2 == 1_342_177_280
    assert format_size(one_sequence) == "1.34 GB (1.25 GiB)"
    assert kv_cache_bytes(LLAMA2_70B, 4096, 10, 2) == 13_421_772_800  # ten users: 13.4 GB, not 27 GB


def test_named_shapes_have_the_published_parameter_counts():
    assert LLAMA3.num_parameters() == 8_030_261_248
    assert LLAMA2_70B.num_parameters() == 68_976_648_192
    assert SMOLLM2.num_parameters() == 134_515_008


# ---------------------------------------------------------------- grid, limits, boundaries


def llama3_plan(**overrides):
    kwargs = dict(memory_bytes=80e9, reserved_bytes=4 * GiB, bandwidth_bytes_per_s=3.35e12, deadline_s=0.5,
                  tokens=32, kv_bytes=2, weights=LLAMA3.num_parameters() * 2)
    kwargs.update(overrides)
    return plan(LLAMA3, **kwargs)


def test_every_grid_cell_agrees_with_the_equation():
    p = llama3_plan()
    weights, available = LLAMA3.num_parameters() * 2, 80e9 - 4 * GiB - LLAMA3.num_parameters() * 2
    assert p.contexts == [512, 1024, 2048, 4096, 8192]  # capped at Llama-3-8B's 8K
    assert p.batches == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    statuses = set()
    for cell in p.cells:
        kv = equation(32, cell.context, 8, 128, 2, cell.batch)
        time_s = 32 * (weights + kv) / 3.35e12
        expected = "mem" if kv > available else "time" if time_s > 0.5 else "ok"
        assert (cell.kv_bytes, cell.status) == (kv, expected)
        assert cell.time_s == pytest.approx(time_s, rel=1e-12)
        statuses.add(cell.status)
    assert statuses == {"ok", "mem"}
    assert p.cell(8192, 32).kv_bytes == 34_359_738_368 and p.cell(8192, 32).status == "ok"
    assert p.cell(8192, 64).status == "mem"  # 68.7 GB of KV > 59.6 GB available


def test_largest_batch_and_context_are_the_last_admissible_integers():
    p = llama3_plan()
    budget = p.budget
    for context, limit in p.max_batch_per_context.items():
        assert budget.status(kv_cache_bytes(LLAMA3, context, limit.value, 2)) == "ok"
        assert budget.status(kv_cache_bytes(LLAMA3, context, limit.value + 1, 2)) == limit.bound_by
    for batch, limit in p.max_context_per_batch.items():
        assert limit.value <= 8192
        if limit.bound_by == "model max":
            assert limit.value == 8192
        else:
            assert budget.status(kv_cache_bytes(LLAMA3, limit.value + 1, batch, 2)) == limit.bound_by
    assert p.max_batch_per_context[512].value == 540  # 32·(16.06 GB + 540·67.1 MB)/3.35 TB/s ≤ 0.5 s


def exact_plan(memory, deadline_s):
    """Weights 2^34 B, 2^40 B/s, 32 tokens: the KV of 4K × 8 is 2^32 B and its answer takes exactly 0.625 s."""
    return plan(LLAMA3, memory, 0, 2**40, deadline_s, 32, 2, 2**34, contexts=[4096], batches=[8, 16])


def test_memory_boundary_flips_ok_to_mem_at_the_exact_byte():
    kv = equation(32, 4096, 8, 128, 2, 8)
    assert kv == 2**32
    at_boundary = exact_plan(2**34 + kv, 1.0)
    assert at_boundary.budget.available_bytes == kv
    assert at_boundary.cell(4096, 8).status == "ok"
    assert at_boundary.max_batch_per_context[4096].value == 8
    assert at_boundary.max_batch_per_context[4096].bound_by == "mem"
    one_byte_short = exact_plan(2**34 + kv - 1, 1.0)
    assert one_byte_short.cell(4096, 8).status == "mem"
    assert one_byte_short.max_batch_per_context[4096].value == 7


def test_deadline_boundary_flips_ok_to_time():
    memory = 2**40
    assert exact_plan(memory, 0.625).cell(4096, 8).time_s == 0.625
    on_time = exact_plan(memory, 0.625)
    assert on_time.cell(4096, 8).status == "ok" and on_time.cell(4096, 16).status == "time"
    assert on_time.max_batch_per_context[4096].value == 8
    assert on_time.max_batch_per_context[4096].bound_by == "time"
    late = exact_plan(memory, 0.6249)
    assert late.cell(4096, 8).status == "time"
    assert late.max_batch_per_context[4096].value == 7


def test_weights_alone_over_the_deadline_admit_nothing():
    p = exact_plan(2**40, 0.4)  # 32 · 2^34 / 2^40 = 0.5 s > 0.4 s
    assert {c.status for c in p.cells} == {"time"}
    assert p.max_batch_per_context[4096].value == 0 and p.max_context_per_batch[8].value == 0


def test_grid_is_capped_at_the_model_max_which_can_be_overridden():
    seventy = plan(LLAMA2_70B, 400e9, 0, 4.8e12, 1.0, 16, 2, LLAMA2_70B.num_parameters() * 2)
    assert seventy.contexts == [512, 1024, 2048, 4096] and seventy.context_cap == 4096
    assert seventy.max_context_per_batch[1].value == 4096
    assert seventy.max_context_per_batch[1].bound_by == "model max"
    long = plan(LLAMA2_70B, 400e9, 0, 4.8e12, 1.0, 16, 2, LLAMA2_70B.num_parameters() * 2, max_context=131_072)
    assert long.contexts[-1] == 131_072 and long.cell(131_072, 1).kv_bytes == 40 * GiB
    odd = plan(LLAMA2_70B, 400e9, 0, 4.8e12, 1.0, 16, 2, 0, max_context=100_000)
    assert odd.contexts[-2:] == [65_536, 100_000]


# ---------------------------------------------------------------- what-ifs


def test_what_ifs_scale_with_kv_heads_and_kv_width():
    p = llama3_plan()
    rows = {w.label: w for w in p.what_ifs}
    gqa = rows["GQA (as is)"].bytes_per_token
    assert gqa == 131_072
    assert rows["MHA (n_kv = heads)"].bytes_per_token == (32 / 8) * gqa == 524_288
    assert rows["MQA (n_kv = 1)"].bytes_per_token == gqa / 8
    assert rows["KV fp8"].bytes_per_token == gqa / 2
    # integer rows carry one fp32 scale per (token, KV head): 2·32·8·4 = 2,048 B per token on top
    assert rows["KV int8"].bytes_per_token == gqa / 2 + 2 * 32 * 8 * 4 == 67_584
    assert rows["KV int4"].bytes_per_token == rows["KV fp16"].bytes_per_token / 4 + 2 * 32 * 8 * 4 == 34_816
    for w in p.what_ifs:
        assert w.max_tokens == int(p.budget.available_bytes // w.bytes_per_token)
        kv_at_ref = w.bytes_per_token * p.reference_context * w.max_batch.value
        assert p.budget.status(kv_at_ref) == "ok"
        assert p.budget.status(kv_at_ref + w.bytes_per_token * p.reference_context) != "ok"
    assert p.reference_context == 4096


def test_smollm2_mha_what_if_is_three_times_gqa():
    p = plan(SMOLLM2, 2 * GiB, 1 * GiB, 31e9, 0.5, 32, 2, SMOLLM2.num_parameters() * 2)
    rows = {w.label: w for w in p.what_ifs}
    assert rows["MHA (n_kv = heads)"].bytes_per_token == 3 * rows["GQA (as is)"].bytes_per_token == 69_120


# ---------------------------------------------------------------- input checks


@pytest.mark.parametrize("overrides, message", [
    (dict(memory_bytes=-1), "cannot be negative"),
    (dict(reserved_bytes=100e9), "exceeds the memory"),
    (dict(tokens=0), "at least 1"),
    (dict(deadline_s=0), "deadline"),
    (dict(bandwidth_bytes_per_s=0), "bandwidth"),
    (dict(deadline_s=float("inf")), "finite"),
    (dict(memory_bytes=16 * GiB), r"weights do not fit: memory 17.18 GB \(16.00 GiB\)"),
])
def test_bad_inputs_raise_a_ricllm_error(overrides, message):
    with pytest.raises(PlanError, match=message) as info:
        llama3_plan(**overrides)
    assert isinstance(info.value, RicllmError)


def test_bandwidth_units_are_decimal():
    assert parse_bandwidth("900GB/s") == 900e9
    assert parse_bandwidth("3.35TB/s") == pytest.approx(3.35e12)
    assert parse_bandwidth("31 GB/s") == 31e9
    assert parse_bandwidth("1GiB/s") == GiB
    for bad in ("900", "fast", "900GBs", "-1GB/s"):
        with pytest.raises(PlanError, match="--bandwidth"):
            parse_bandwidth(bad)


def test_unknown_shape_lists_the_known_names():
    with pytest.raises(PlanError, match="llama-2-70b, llama-3-8b, smollm2-135m"):
        resolve_model("llama-9-1t", None)
    assert resolve_model("Llama-3-8B", None)[1] == 8_030_261_248 * 2


def test_checkpoint_weights_come_from_the_file_size(tiny_gguf):
    spec, weights, source = resolve_model(str(tiny_gguf), None)
    assert weights == tiny_gguf.stat().st_size and "size on disk" in source
    assert resolve_model(str(tiny_gguf), 0.5)[1] == spec.num_parameters() * 0.5
    p = plan(spec, 1 * GiB, 0, 31e9, 0.5, 8, 2, weights)
    assert p.kv_bytes_per_token == equation(spec.num_layers, 1, spec.num_kv_heads, spec.head_dim, 2, 1)
    assert p.contexts[-1] == spec.max_position_embeddings


# ---------------------------------------------------------------- text, JSON, CLI


def test_text_report_shows_both_unit_systems_and_the_time_model():
    text = render_text(llama3_plan())
    assert "2·32·8·128·2 = 131,072 B = 131.07 KB (128.00 KiB)" in text
    assert "16,060,522,496 B = 16.06 GB (14.96 GiB)" in text
    assert "lower bound" in text and "tokens × (M_weights + M_KV(n, B)) / BW" in text
    assert "MHA (n_kv = heads)" in text and "KV int4" in text


def test_cli_prints_the_llama3_product_and_exits_0():
    result = ricllm("plan", "llama-3-8b", "--memory", "80GB", "--reserved", "4GiB", "--bandwidth", "3.35TB/s",
                    "--deadline-ms", "500", "--tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "131,072 B" in result.stdout and "2·32·8·128·2" in result.stdout
    assert "59.64 GB (55.55 GiB)" in result.stdout  # 80 GB − 4 GiB − 16.06 GB left for the KV


def test_cli_json_carries_the_numbers():
    result = ricllm("plan", "llama-2-70b", "--memory", "192GB", "--reserved", "8GiB", "--bandwidth", "4.8TB/s",
                    "--deadline-ms", "1000", "--tokens", "16", "--max-context", "131072", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kv_bytes_per_token"] == 327_680 and data["kv_product"] == "2·80·8·128·2 = 327,680 B"
    assert data["weights_bytes"] == 68_976_648_192 * 2
    assert data["available_kv_bytes"] == 192_000_000_000 - 8 * GiB - 68_976_648_192 * 2
    cell = next(c for c in data["grid"] if c["context"] == 4096 and c["batch"] == 1)
    assert cell["kv_bytes"] == 1_342_177_280 and cell["status"] == "ok"
    at_128k = {c["batch"]: c for c in data["grid"] if c["context"] == 131_072}
    assert at_128k[1]["kv_bytes"] == 40 * GiB and at_128k[1]["status"] == "ok"  # 42.9 GB ≤ 45.5 GB left
    assert at_128k[2]["status"] == "mem"
    assert {w["label"]: w["bytes_per_token"] for w in data["what_ifs"]}["KV int4"] == 81_920 + 2 * 80 * 8 * 4  # + a 4-byte scale per row
    assert len(data["max_batch_per_context"]) == 9 and "lower bound" in data["time_model"]


@pytest.mark.parametrize("args, message", [
    (["llama-9-1t"], "known shapes: llama-2-70b, llama-3-8b, smollm2-135m"),
    (["llama-3-8b", "--memory=-16GiB"], "--memory cannot be negative"),
    (["llama-3-8b", "--memory", "8GiB", "--reserved", "9GiB"], "exceeds the memory"),
    (["llama-3-8b", "--tokens", "0"], "at least 1"),
    (["llama-3-8b", "--bandwidth", "lots"], "--bandwidth: cannot parse 'lots'"),
    (["llama-3-8b", "--memory", "16GiB"], "weights do not fit"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
    result = ricllm("plan", *args)
    assert result.returncode == 2
    assert "ricllm: error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_adapters_add_their_bytes_to_the_weights(tiny_gguf, tmp_path):
    """What the node holds for LoRA adapters counts as weights: the estimate is rank × Σ(in + out) of
    the seven projections × layers × 2 bytes each, and an adapter read from its folder counts its
    own parameters, so a plan with adapters has less room for KV and a slower roofline."""
    from tests.lora_adapters import write_lora_adapter

    spec, weights, _ = resolve_model(str(tiny_gguf), None)
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    estimate, what = adapters_bytes(spec, (), max_loras=3, rank=8)
    assert estimate == 3 * 8 * per_layer * spec.num_layers * 2 and "3 LoRA adapters of rank 8" in what

    folder = write_lora_adapter(tmp_path / "a", spec, rank=4, projections=("q", "v"))
    read, what = adapters_bytes(spec, [f"a={folder}"], max_loras=0, rank=8)
    assert read == 4 * ((h + q) + (h + kv)) * spec.num_layers * 2 and "1 LoRA adapter read" in what

    done = ricllm("plan", str(tiny_gguf), "--max-loras", "3", "--json")
    assert json.loads(done.stdout)["weights_bytes"] == weights + estimate
    bad = ricllm("plan", str(tiny_gguf), "--lora-modules", "no-equals-sign")
    assert bad.returncode != 0 and "name=path" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- a model with sliding-window layers

GEMMA3 = NAMED_SHAPES["gemma-3-270m"]


def test_gemma3_270m_kv_is_the_per_group_equation_with_the_sliding_layers_capped_at_their_window():
    assert GEMMA3.num_parameters() == 268_098_176
    # 3 global layers keep every token, 15 sliding-window layers their last 512
    grouped = equation(3, 4096, 1, 256, 2, 1) + equation(15, 512, 1, 256, 2, 1)
    assert kv_cache_bytes(GEMMA3, 4096, 1, 2) == grouped == 20_447_232
    assert kv_cache_bytes(GEMMA3, 300, 8, 2) == equation(18, 300, 1, 256, 2, 8)  # shorter than the window: whole
    whole = equation(18, 4096, 1, 256, 2, 1)
    text = render_text(plan(GEMMA3, 16 * GiB, 4 * GiB, 900e9, 0.5, 32, 2, GEMMA3.num_parameters() * 2))
    assert "2·3·4096·1·256·2 + 2·15·512·1·256·2 = 20.45 MB (19.50 MiB)" in text
    assert f"{format_size(whole)}; saved {1 - grouped / whole:.1%}" in text and "saved 72.9%" in text


def test_gemma3_limits_use_the_grouped_cache():
    p = plan(GEMMA3, 1 * GiB, 0, 900e9, 10.0, 32, 2, 0, contexts=[4096], batches=[1, 64])
    limit = p.max_batch_per_context[4096]
    assert p.budget.fits_memory(kv_cache_bytes(GEMMA3, 4096, limit.value, 2))
    assert not p.budget.fits_memory(kv_cache_bytes(GEMMA3, 4096, limit.value + 1, 2))
    assert limit.value == GiB // 20_447_232
    longest = p.max_context_per_batch[64]
    assert p.budget.fits_memory(kv_cache_bytes(GEMMA3, longest.value, 64, 2))
    assert longest.bound_by == "model max" or not p.budget.fits_memory(kv_cache_bytes(GEMMA3, longest.value + 1, 64, 2))


def test_cli_json_carries_the_gemma3_groups_and_the_whole_figure():
    result = ricllm("plan", "gemma-3-270m", "--json", "--contexts", "4K", "--batches", "1")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kv_groups"] == [{"num_layers": 3, "window": 0}, {"num_layers": 15, "window": 512}]
    assert data["kv_bytes_at_reference_context"] == 20_447_232
    assert data["kv_bytes_at_reference_context_every_layer_whole"] == 75_497_472
    assert data["grid"][0]["kv_bytes"] == 20_447_232
