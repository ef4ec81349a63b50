"""The summary math of benchmarks/bench_cpu.py on made-up repeats: medians and ranges, per-repeat
ratios against the better llama.cpp configuration, the interleaving order, the bandwidth roofline
and the targets' verdict lines. No model, no engine, no child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

import benchmarks.bench_cpu as bench

SIZES = {"prompt_len": 256, "new_tokens": 128, "streams": [1, 32], "prefill_len": 512, "prefill_repeats": 3}


def series(label: str, engine: str, runs: list[dict | None], **spec) -> bench.Series:
    return bench.Series(bench.Config(label, engine, sys.executable, spec), runs)


def run(decode_1: float, decode_32: float = 0.0, prompt: float = 0.0, **more) -> dict:
    return {"decode_1": decode_1, "decode_32": decode_32, "prompt_tps": prompt, **more}


def test_stat_is_the_median_and_range_of_the_repeats_that_ran():
    assert bench.stat([3.0, None, 1.0, 2.0]) == bench.Stat(2.0, 1.0, 3.0, 3)
    assert bench.stat([4.0, 1.0]) == bench.Stat(2.5, 1.0, 4.0, 2)
    assert bench.stat([None, None]) is None


def test_a_ratio_is_the_median_of_per_repeat_ratios_paired_by_repeat():
    ours, theirs = [100.0, 200.0, 120.0, None], [50.0, 200.0, 40.0, 10.0]
    assert bench.per_repeat_ratios(ours, theirs) == [2.0, 1.0, 3.0]  # the fourth repeat has no ricllm run
    assert bench.stat(bench.per_repeat_ratios(ours, theirs)).median == 2.0
    # not the ratio of the medians (120 / 45): a slow minute hits both sides of one repeat alike
    assert bench.ratio_of_medians(bench.stat(ours), bench.stat(theirs)) == pytest.approx(120 / 45)


def test_the_interleaving_runs_every_configuration_once_per_repeat_in_a_rotated_order():
    order = bench.interleaved_order(configs=3, repeats=3)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
    assert [sorted(i for r, i in order if r == repeat) for repeat in range(3)] == [[0, 1, 2]] * 3
    assert [order[3 * repeat][1] for repeat in range(3)] == [0, 1, 2]  # a different configuration first each time
    assert bench.interleaved_order(configs=2, repeats=1) == [(0, 0), (0, 1)]


def test_the_roofline_reads_every_weight_and_the_mean_decode_context_per_token():
    assert bench.mean_decode_context(256, 128) == 320
    # 90 MB of weights and 23040 B of KV per token at 320 tokens: 97.37 MB per token at 20 GB/s
    assert bench.roofline_tps(20e9, 90e6, 23040, 320) == pytest.approx(20e9 / 97_372_800)
    facts = {"weight_bytes": 90e6, "kv_bytes_per_token": 23040}
    fast = series("ricllm", "ricllm", [run(154.0, **facts), run(102.7, **facts), run(205.4, **facts)])
    fraction = bench.roofline_fraction(fast, 20e9, SIZES)
    assert fraction.median == pytest.approx(154.0 * 97_372_800 / 20e9)  # 75%
    assert fraction.low < fraction.median < fraction.high
    assert bench.roofline_fraction(series("hf", "hf", [run(10.0)]), 20e9, SIZES) is None  # no bytes reported


def test_ricllm_is_compared_with_the_better_llama_cpp_configuration_per_measurement():
    fa_off = series("FA off", "llamacpp", [run(80.0, 190.0, 300.0), run(78.0, 192.0, 310.0)])
    fa_on = series("FA on", "llamacpp", [run(70.0, 200.0, 320.0), run(72.0, 210.0, None)])
    assert bench.better_peer([fa_off, fa_on], "decode_1") is fa_off
    assert bench.better_peer([fa_off, fa_on], "decode_32") is fa_on
    assert bench.better_peer([fa_off, fa_on], "prompt_tps") is fa_on  # 320 (one repeat) > 305
    ours = series("ricllm", "ricllm", [run(160.0, 600.0, 2000.0), run(156.0, 630.0, 2100.0)])
    assert bench.ratio_stat(ours, fa_off, "decode_1") == bench.Stat(2.0, 2.0, 2.0, 2)
    assert bench.ratio_stat(ours, None, "decode_1") is None


def test_a_verdict_line_says_pass_fail_or_not_measured_against_at_least_or_at_most():
    assert bench.check_line(bench.Check("decode", 2.1, 2.0, True, "×", "vs FA on")) == \
        "- decode: 2.10× (target ≥ 2.00×; vs FA on): PASS"
    assert bench.check_line(bench.Check("rss", 480.0, 480.0, False, " MB")).endswith(": PASS")
    assert bench.check_line(bench.Check("rss", 481.0, 480.0, False, " MB")) == "- rss: 481 MB (target ≤ 480 MB): FAIL"
    assert bench.check_line(bench.Check("roofline", 0.62, 0.8, True, "%")) == \
        "- roofline: 62% (target ≥ 80%): FAIL"
    assert bench.check_line(bench.Check("decode", None, 3.0, True, "×")).endswith(": not measured")


def default_and_twin(native_32: float = 620.0) -> tuple[bench.Series, bench.Series]:
    facts = {"weight_bytes": 90e6, "kv_bytes_per_token": 23040, "peak_rss_mb": 470.0, "ready_cached_s": 0.40}
    ours = series("int4 native", "ricllm", [run(160.0, native_32, 2100.0, **facts) for _ in range(3)],
                  weights="int4", runtime="native")
    twin = series("int4 torch", "ricllm", [run(150.0, 610.0, 3300.0) for _ in range(3)],
                  weights="int4", runtime="torch")
    return ours, twin


def test_issue_21_targets_on_made_up_medians():
    ours, twin = default_and_twin()
    peers = [series("FA off", "llamacpp", [run(76.0, 190.0, 310.0)] * 3),
             series("FA on", "llamacpp", [run(82.0, 200.0, 300.0)] * 3)]
    checks = {c.name.split(":")[0].split(" (")[0]: c for c in bench.issue_checks(ours, twin, peers, 20e9, SIZES)}
    one = checks["decode, 1 stream vs llama.cpp"]
    assert one.value == pytest.approx(160 / 82) and one.detail == "vs FA on" and one.passed is False
    assert checks["decode, 1 stream"].value == pytest.approx(160 * 97_372_800 / 20e9)  # the roofline line, 78%
    assert checks["decode, 1 stream"].passed is False
    assert checks["decode, 32 streams vs llama.cpp"].value == pytest.approx(3.1) and checks[
        "decode, 32 streams vs llama.cpp"].passed
    native = checks["decode, native ≥ torch runtime at every stream count"]
    assert native.value == pytest.approx(620 / 610) and native.passed and native.detail == "1: 1.07×, 32: 1.02×"
    prompt = checks["prompt"]
    assert prompt.value == pytest.approx(2100 / 310) and prompt.detail == "vs FA off" and prompt.passed
    assert checks["peak RSS, whole run"].passed and checks["time to ready from the weight cache"].passed


def test_the_native_runtime_fails_its_target_when_one_stream_count_is_slower_than_torch():
    ours, twin = default_and_twin(native_32=580.0)
    check = bench.native_vs_torch_check(ours, twin, [1, 32])
    assert check.value == pytest.approx(580 / 610) and check.passed is False
    assert bench.native_vs_torch_check(ours, None, [1, 32]).passed is None


def test_a_stream_count_the_run_left_out_is_not_measured_rather_than_failed():
    ours, twin = default_and_twin()
    peers = [series("FA off", "llamacpp", [run(76.0, None, 310.0)] * 3)]
    quick = dict(SIZES, streams=[1])
    check = bench.vs_peer_check("decode, 32 streams vs llama.cpp", ours, peers, "decode_32", 3.0)
    assert check.passed is None and check.detail == "not measured at this size in this run"
    assert bench.native_vs_torch_check(ours, twin, quick["streams"]).passed is True


def test_without_llama_cpp_every_peer_target_is_not_measured():
    ours, twin = default_and_twin()
    lines = [bench.check_line(c) for c in bench.issue_checks(ours, twin, [], 20e9, SIZES)]
    assert sum(line.endswith("not measured") for line in lines) == 3
    assert "llama.cpp not measured" in lines[0]


def test_the_targets_are_checked_on_the_default_configuration_only():
    configs = [bench.Config("ricllm int8 native", "ricllm", sys.executable, {"weights": "int8", "runtime": "native"}),
               bench.Config("ricllm int4 native", "ricllm", sys.executable, {"weights": "int4", "runtime": "native"})]
    runs = {"ricllm int8 native": [run(120.0, formats=["int8", "int8"], peak_rss_mb=900.0)],
            "ricllm int4 native": [run(150.0, formats=["int4", "int8"], peak_rss_mb=470.0)]}
    labelled = bench.label_series(configs, runs, auto_formats=("int4", "int8"))
    assert labelled[1].label == "ricllm int4 native (int4 layers, int8 head; the default)"
    assert labelled[0].label == "ricllm int8 native (int8 layers, int8 head)"
    text = bench.target_lines(labelled, 20e9, SIZES)
    assert "(ricllm int4 native (int4 layers" in text
    assert "- peak RSS, whole run: 470 MB (target ≤ 480 MB): PASS" in text
    assert "not checked" in bench.target_lines(labelled[:1], 20e9, SIZES)


def test_a_table_cell_shows_the_median_and_the_range_of_several_repeats():
    assert bench.fmt_stat(bench.Stat(140.0, 138.14, 142.3, 3)) == "140.0 [138.1–142.3]"
    assert bench.fmt_stat(bench.Stat(1.84, 1.84, 1.84, 1), ".2f", "×") == "1.84×"
    assert bench.fmt_stat(None) == "–"


def test_the_llama_cpp_build_flags_come_from_its_installed_cmake_config(tmp_path):
    package = tmp_path / "site-packages" / "llama_cpp"
    (package.parent / "lib" / "cmake" / "ggml").mkdir(parents=True)
    assert bench.llamacpp_build_flags(package) is None
    (package.parent / "lib" / "cmake" / "ggml" / "ggml-config.cmake").write_text(
        'set(GGML_AVX512 "OFF")\nset(GGML_NATIVE "ON")\nset(GGML_INCLUDE_DIR "/x")\nset(GGML_OPENMP "ON")\n'
        'include(foo)\nset(GGML_VERSION "0.25.3")\n')
    expected = "GGML_VERSION=0.25.3 GGML_NATIVE=ON GGML_OPENMP=ON (no ISA flag forced on)"
    assert bench.llamacpp_build_flags(package) == expected
    (package.parent / "lib" / "cmake" / "ggml" / "ggml-config.cmake").write_text(
        'set(GGML_NATIVE "OFF")\nset(GGML_AVX2 "ON")\nset(GGML_AVX512 "OFF")\nset(GGML_FMA "ON")\n')
    assert bench.llamacpp_build_flags(package) == "GGML_NATIVE=OFF GGML_AVX2=ON GGML_FMA=ON"


def test_ricllm_env_takes_key_value_pairs_and_rejects_anything_else():
    assert bench.env_pair("RICLLM_CPU_KERNELS=avx2") == ("RICLLM_CPU_KERNELS", "avx2")
    assert bench.env_pair("A=") == ("A", "")
    with pytest.raises(Exception, match="KEY=VALUE"):
        bench.env_pair("RICLLM_NO_AMX")


def test_each_source_tree_gets_its_own_ricllm_configurations_importing_from_it(tmp_path):
    other = tmp_path / "other-revision"
    (other / "ricllm").mkdir(parents=True)
    (other / "ricllm" / "__init__.py").write_text("")
    root = str(Path(__file__).resolve().parents[1])
    args = bench.parse_args_from(["--configs", "int4:native", "int8:native", "--tree", f"old={other}",
                                  "--tree", f"new={root}", "--skip-hf", "--skip-llamacpp"])
    configs = bench.configurations(args, llamacpp_ok=False)
    assert [c.label for c in configs] == ["ricllm int4 native [old]", "ricllm int4 native [new]",
                                          "ricllm int8 native [old]", "ricllm int8 native [new]"]
    assert [c.env["PYTHONPATH"] for c in configs] == [str(other.resolve()), root] * 2
    with pytest.raises(Exception, match="not a checkout of ricllm"):
        bench.source_tree(f"bad={tmp_path}")
    with pytest.raises(Exception, match="NAME=PATH"):
        bench.source_tree(str(other))


def test_the_benchmark_rejects_a_malformed_option_without_a_traceback():
    result = subprocess.run([sys.executable, str(bench.THIS), "--ricllm-env", "oops", "--repeats", "1"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "expected KEY=VALUE" in result.stderr and "Traceback" not in result.stderr


def test_setup_names_an_unknown_option_before_installing_anything():
    setup = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
    result = subprocess.run(["bash", str(setup), "--benchmark"], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "unknown option --benchmark" in result.stderr


def test_avx2_like_for_like_holds_ricllm_and_torch_to_avx2_and_compares_with_the_avx2_llama_cpp():
    args = bench.parse_args_from(["--configs", "int4:native", "int4:torch", "--avx2-like-for-like"])
    configs = bench.configurations(args, llamacpp_ok=True, extra_buffers=False, avx2_peer=("/venv/bin/python", True))
    ricllm = [c for c in configs if c.engine == "ricllm"]
    assert all(c.env["RICLLM_CPU_KERNELS"] == "avx2" and c.env["ATEN_CPU_CAPABILITY"] == "avx2" for c in ricllm)
    hf = next(c for c in configs if c.engine == "hf")
    assert hf.env["ATEN_CPU_CAPABILITY"] == "avx2" and "RICLLM_CPU_KERNELS" not in hf.env
    peers = [c for c in configs if c.engine == "llamacpp"]
    assert [(c.python, c.spec["compared"], c.spec["extra_buffers"]) for c in peers] == [
        (args.llamacpp_python, False, False), (args.llamacpp_python, False, False),
        ("/venv/bin/python", True, True), ("/venv/bin/python", True, True)]
    # the ratios are against the AVX2 build only, though the native one measured faster
    labels = [c.label for c in peers]
    runs = {label: [run(500.0 if "native" in label else 100.0)] for label in labels}
    series = [bench.Series(c, runs[c.label]) for c in peers]
    assert {s.config.python for s in bench.compared_peers(series)} == {"/venv/bin/python"}
    assert bench.better_peer(bench.compared_peers(series), "decode_1").label == labels[2]
    # without a second build, the one llama.cpp is the comparison
    plain = bench.configurations(bench.parse_args_from(["--configs", "int4:native"]), llamacpp_ok=True)
    assert [c.spec["compared"] for c in plain if c.engine == "llamacpp"] == [True, True]
    assert "ATEN_CPU_CAPABILITY" not in next(c for c in plain if c.engine == "hf").env


def test_the_avx2_llama_cpp_is_built_at_the_locked_version_with_avx512_and_amx_off():
    assert bench.locked_version("llama-cpp-python") == next(
        line.split("==")[1] for line in (bench.ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("llama_cpp_python=="))
    flags = dict(flag.removeprefix("-D").split("=") for flag in bench.AVX2_LLAMACPP_CMAKE.split())
    assert flags["GGML_NATIVE"] == "OFF" and flags["GGML_AVX2"] == "ON" and flags["GGML_FMA"] == "ON"
    assert all(v == "OFF" for k, v in flags.items() if k.startswith(("GGML_AVX512", "GGML_AMX")))
    help_text = subprocess.run([sys.executable, str(bench.THIS), "--help"], check=True, capture_output=True,
                               text=True, timeout=60).stdout
    assert "--avx2-like-for-like" in help_text


def test_the_onnx_runtime_and_ort_genai_are_divided_by_the_default_per_repeat():
    configs = [bench.Config("native", "ricllm", sys.executable, {"weights": "int4", "runtime": "native"}),
               bench.Config("onnx", "ricllm", sys.executable, {"weights": "auto", "runtime": "onnx"}),
               bench.Config("ORT GenAI", "ortgenai", sys.executable),
               bench.Config("FA on", "llamacpp", sys.executable)]
    runs = {"native": [run(200.0, 600.0, 1000.0, formats=["int4", "int8"]), run(100.0, 600.0, 1000.0)],
            "onnx": [run(100.0, 150.0, 250.0, formats=["int4", "int8"]), run(60.0, 300.0, None)],
            "ORT GenAI": [run(80.0, 240.0, 500.0), run(50.0, 120.0, 200.0)], "FA on": [run(90.0), run(90.0)]}
    series = bench.label_series(configs, runs, auto_formats=("int4", "int8"))
    table = bench.native_ratio_table(series, SIZES)
    lines = table.splitlines()
    assert lines[0] == ("| / native (int4 layers, int8 head; the default) | onnx (int4 layers, int8 head) | "
                        "ORT GenAI |")  # llama.cpp has its own table
    # one stream: onnx 0.5 and 0.6, ORT GenAI 0.4 and 0.5, paired by repeat
    assert lines[2] == "| decode, 1 stream | 0.55× [0.50–0.60] | 0.45× [0.40–0.50] |"
    assert lines[3] == "| decode, 32 streams | 0.38× [0.25–0.50] | 0.30× [0.20–0.40] |"
    assert lines[4] == "| prompt (512 tokens) | 0.25× | 0.35× [0.20–0.50] |"  # onnx's second prompt is missing
    assert bench.native_ratio_table(series[:1], SIZES) is None  # nothing beside the default
    assert bench.native_ratio_table(series[1:], SIZES) is None  # no default to divide by


def test_ort_genai_runs_as_a_peer_under_its_interpreter_with_its_built_model(tmp_path):
    build = {"weight_bytes": 84e6, "kv_bytes_per_token": 46080}
    peer = bench.Peer("/venv/bin/python", {"PYTHONPATH": "/cache/ortgenai-0.18.0"}, tmp_path, build)
    args = bench.parse_args_from(["--configs", "int4:native", "--ortgenai", "--skip-hf"])
    assert args.ortgenai and args.ortgenai_python is None
    configs = bench.configurations(args, llamacpp_ok=False, ortgenai=peer)
    ort = [c for c in configs if c.engine == "ortgenai"]
    assert len(ort) == 1 and ort[0].python == "/venv/bin/python"
    assert ort[0].spec == {"ortgenai_model": str(tmp_path), "ortgenai_build": build}
    env = bench.child_env(ort[0].env)
    assert env["PYTHONPATH"] == "/cache/ortgenai-0.18.0" and env["OMP_NUM_THREADS"] == str(bench.THREADS)
    assert bench.ORTGENAI_SESSION["model"]["decoder"]["session_options"]["intra_op_num_threads"] == bench.THREADS
    assert [c.engine for c in bench.configurations(args, llamacpp_ok=False)] == ["ricllm"]  # no peer: no row


def test_ort_genai_notes_name_its_versions_session_builder_and_what_differs():
    build = {"builder": "python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4", "gguf": "m.gguf",
             "versions": {"onnxruntime-genai": "0.18.0", "onnx-ir": "1.1.0"}, "transformers": "5.25.0",
             "hf_folder_s": None, "builder_s": 9.5}
    facts = {"version": "0.18.0", "onnxruntime": "libonnxruntime.so.1.31.1", "device": "CPU"}
    peer = bench.Series(bench.Config("ORT GenAI", "ortgenai", "/venv/bin/python", {"ortgenai_build": build}),
                        [run(40.0, **facts)])
    text = "\n".join(bench.ortgenai_notes(peer))
    assert "onnxruntime-genai 0.18.0 on ONNX Runtime libonnxruntime.so.1.31.1 (CPU execution provider)" in text
    assert f'"intra_op_num_threads": {bench.THREADS}' in text and build["builder"] in text
    assert "the HF folder of an earlier build, then the builder 9.5 s" in text
    assert "not like for like" in text and "fp32" in text and "static" in text
    build["hf_folder_s"] = 31.2
    assert "the HF folder 31.2 s, then the builder 9.5 s" in "\n".join(bench.ortgenai_notes(peer))
